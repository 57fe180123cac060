"""flatep.baseline: the all-to-all expert-parallel MoE layer FlatEP is compared against (not FlatEP).

:class:`AllToAllMoE` is the layer EP users run today (Megatron-Core's all-to-all token dispatcher, plain torch ops): the
same router, init and numerics as :class:`flatep.nn.MoE`, with the experts' rows moved by two exact-size all-to-alls
instead of FlatEP's plan, dispatch, replicas and combine:

    counts: every rank's per-expert counts all-gathered ([R, E], as Megatron gathers them) and read on the host (a
            synchronisation: the split sizes of the all-to-alls)
    dispatch: this rank's entries sorted by expert (by_expert), their bf16 token rows sent with all_to_all_single,
            regrouped by [local expert][source rank] (by_local_expert)
    experts: the grouped FFN of flatep.nn (flatep.ffn.grouped_ffn: h, a, y rounded to bf16) over the received rows,
            offs = the exact group ends (no padding, no replicas: a hot expert's rows all land on its owner)
    combine: the outputs sent back with the reverse all-to-all, then out[t] = bf16(sum over t's K entries of
            w * y in fp32) (weighted_sum: one rounding)
    backward: autograd through the same path (the reverse all-to-alls), the weighted sum's backward in chunks
            (weighted_unpermute_backward), the experts' weight gradients added into ``main_grad`` (fp32)

Numerics against nn.MoE (same weights, same routing): the router, the token rows, every expert row's h, a and y are
the same operations on the same values; the layers differ in summation order only where FlatEP splits a sum: its
combine adds a token's K terms as per-destination-rank partials rounded to bf16, then the partials in fp32 (design
§6), where this layer adds the K terms in one fp32 sum; an expert's weight gradient is FlatEP's sum of the owner's and
the replicas' partial gradients (each a bf16 GEMM output on a GPU), here one GEMM over all its rows.
tests/python/test_train_lm.py holds the two layers to each other within bf16 tolerance.

Parameters (the names and shapes of nn.MoE, so state_dicts are interchangeable): ``router.weight`` [E, H] fp32,
replicated; ``w1`` [epn, H, 2F] (swiglu) or [epn, H, F] (silu) and ``w2`` [epn, F, H] bf16 Parameters of this rank's
experts with an fp32 ``main_grad`` that backward adds into (``.grad`` stays None), so that
flatep.optim.MainGradOptimizer treats both layers alike; ``shared_w1`` / ``shared_w2`` fp32 with ``shared_ffn``.

Collectives (:func:`collectives`): a torch.distributed group (gloo: CUDA tensors staged through host memory and bf16
moved as bytes, since gloo has neither CUDA all-to-all nor bf16; NCCL: direct) or a flatep.virtual.VirtualRank. On
virtual ranks an all-to-all is one autograd node over every rank's rows (the copies run on each rank's stream), so
the backward of every rank runs in ONE autograd call: :func:`backward` (a per-rank ``loss.backward()`` would meet its
peers inside the autograd engine's one worker thread per device and wait forever). flatep.nn.MoE needs no such call:
its ops never block the host.

The pure helpers (by_expert, by_local_expert, weighted_sum, weighted_unpermute_backward, all_to_all_rows) are also
those of benchmarks/layer/moe_layer.py's Baseline.
"""

import torch
import torch.distributed as dist

from ._bootstrap import OwnTransportGroup
from ._tensors import check_int
from .distributed import group_rank_size, resolve_device
from .ffn import _has_grouped_mm, check_activation, expert_projections, grouped_ffn
from .nn import (
    MoE, add_shared, init_expert_weights, init_router_weight, init_shared_weights, route, shared_expert_ffn,
)

BF16 = torch.bfloat16
# Entries per chunk of the weighted sum's backward (weighted_unpermute_backward): its fp32 temporaries are
# [chunk, H] (470 MB at H=7168), whatever S*K.
UNPERMUTE_CHUNK_ROWS = 16384


# ---- the permutations and the weighted sum ----


def by_expert(idx, K):
    """Entries of topk_idx [s, K] sorted by expert (= by destination rank), stably: (order, token of each)."""
    order = torch.sort(idx.reshape(-1), stable=True).indices
    return order, torch.div(order, K, rounding_mode="floor")


def by_local_expert(recv_matrix, total=None):
    """recv_matrix [R sources, epn local experts]: counts of rows that arrive ordered by [source][local expert].
    Returns the order that regroups them by [local expert][source] and the grouped-GEMM offs (inclusive group ends).
    total: the number of rows (recv_matrix's sum) when the caller knows it on the host, so that a device recv_matrix
    needs no synchronisation here."""
    R, epn = recv_matrix.shape
    blocks = torch.repeat_interleave(torch.arange(R * epn, device=recv_matrix.device), recv_matrix.reshape(-1),
                                     output_size=total)
    key = (blocks % epn) * R + torch.div(blocks, epn, rounding_mode="floor")
    return torch.sort(key, stable=True).indices, torch.cumsum(recv_matrix.sum(0), 0).to(torch.int32)


def weighted_unpermute_backward(grad_out, token_of, back, w_sorted, chunk_rows=UNPERMUTE_CHUNK_ROWS):
    """Backward of the baseline's weighted sum out[t] = bf16(sum over t's entries e of back[e] * w_sorted[e]) (fp32
    sum), entries e in the by-expert order, t = token_of[e]: grad_back[e] = bf16(grad_out[t] * w_sorted[e]) (one fp32
    multiply, one rounding) and grad_w_sorted[e] = <grad_out[t], back[e]> in fp32 (exact bf16 products, torch's fp32
    sum). The arithmetic autograd runs for the forward expression (its bits on the CPU; on a GPU torch's row sums may
    group differently), in chunks of `chunk_rows` entries: the fp32 temporaries are [chunk_rows, H], where autograd
    materialises four [S*K, H] fp32 tensors (1.9 GB each at S=8192, K=8, H=7168). Returns (grad_back [S*K, H] bf16,
    grad_w_sorted [S*K] fp32)."""
    n = back.shape[0]
    grad_back = torch.empty_like(back)
    grad_w = torch.empty(n, dtype=torch.float32, device=back.device)
    for lo in range(0, n, chunk_rows):
        hi = min(lo + chunk_rows, n)
        g = grad_out.index_select(0, token_of[lo:hi])  # bf16 rows of the entries' tokens
        torch.mul(g, w_sorted[lo:hi].unsqueeze(1), out=grad_back[lo:hi])  # fp32 math, bf16 store
        grad_w[lo:hi] = back[lo:hi].float().mul_(g).sum(1)
    return grad_back, grad_w


def weighted_sum(back, w_sorted, token_of, num_tokens):
    """The baseline's combine: out [S, H] bf16, the fp32 sum of each token's K rows back [S*K, H] bf16 (by-expert
    order) times their weights w_sorted [S*K] fp32 (Megatron's unpermute with probabilities)."""
    out = torch.zeros(num_tokens, back.shape[1], dtype=torch.float32, device=back.device)
    return out.index_add_(0, token_of, back.float() * w_sorted.unsqueeze(1)).to(BF16)


class _WeightedSum(torch.autograd.Function):
    """weighted_sum with the backward of weighted_unpermute_backward."""

    @staticmethod
    def forward(ctx, back, w_sorted, token_of, num_tokens):
        ctx.save_for_backward(back, w_sorted, token_of)
        return weighted_sum(back, w_sorted, token_of, num_tokens)

    @staticmethod
    def backward(ctx, grad_out):
        back, w_sorted, token_of = ctx.saved_tensors
        grad_back, grad_w = weighted_unpermute_backward(grad_out.to(BF16).contiguous(), token_of, back, w_sorted)
        return grad_back, grad_w, None, None


# ---- collectives: a torch.distributed group or a virtual rank ----


def _stream_of(device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _record(stream):
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


class Collectives:
    """The collectives the baseline layer and a data-parallel trainer need, over a torch.distributed group (None: the
    default group) or a flatep.virtual.VirtualRank, with torch.distributed's meaning: ``all_reduce`` (sum, in place),
    ``all_gather`` (a list of every rank's tensor), ``all_gather_object``, ``broadcast``, ``barrier``,
    ``all_to_all_single`` (no autograd) and ``all_to_all_rows`` (autograd). Attributes: rank, size, backend ('gloo',
    'nccl', ..., or 'virtual').

    On gloo, CUDA tensors go through host memory (gloo has no CUDA all-to-all) and bf16 travels as bytes (gloo has no
    bf16; a bf16 all_reduce is refused: sum fp32 gradients). On virtual ranks every collective runs on the ranks'
    threads at once (flatep.virtual.run_threads), stream-ordered on CUDA; all_reduce adds in rank order."""

    def __init__(self, group=None):
        self.group = group
        self.virtual = isinstance(group, OwnTransportGroup)
        self.rank, self.size = group_rank_size(group)
        if self.virtual:
            self.backend = "virtual"
        elif dist.is_available() and dist.is_initialized():
            self.backend = dist.get_backend(group)
        else:  # one process, no group: every collective is the identity
            self.backend = "single"

    def __repr__(self):
        return f"Collectives({self.backend}, rank {self.rank} of {self.size})"

    def _staged(self, t):
        """(the tensor a torch.distributed call takes, whether the result must be copied back into t)."""
        if self.backend == "gloo" and t.is_cuda:
            return t.cpu(), True
        return t, False

    def all_reduce(self, tensor):
        """In place: the sum over ranks. Returns tensor."""
        if self.virtual:
            return self.group.all_reduce(tensor)
        if self.backend == "single":
            return tensor
        if self.backend == "gloo" and tensor.dtype == BF16:
            raise ValueError("Collectives.all_reduce: gloo has no bf16 sum; all-reduce fp32 tensors")
        staged, back = self._staged(tensor)
        dist.all_reduce(staged, group=self.group)
        if back:
            tensor.copy_(staged)
        return tensor

    def all_gather(self, tensor):
        """[rank 0's tensor, ..., rank R-1's] (same shape and dtype on every rank)."""
        if self.virtual:
            return self.group.all_gather(tensor)
        if self.backend == "single":
            return [tensor.clone()]
        staged, back = self._staged(tensor.contiguous())
        raw = staged.view(torch.uint8) if staged.dtype == BF16 and self.backend == "gloo" else staged
        out = [torch.empty_like(raw) for _ in range(self.size)]
        dist.all_gather(out, raw, group=self.group)
        out = [o.view(staged.dtype) for o in out]
        return [o.to(tensor.device) for o in out] if back else out

    def all_gather_object(self, obj):
        if self.virtual:
            return self.group.all_gather_object(obj)
        if self.backend == "single":
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, tensor, src):
        if self.virtual:
            return self.group.broadcast(tensor, src)
        if self.backend == "single":
            return tensor
        staged, back = self._staged(tensor)
        raw = staged.view(torch.uint8) if staged.dtype == BF16 and self.backend == "gloo" else staged
        dist.broadcast(raw, src=_global_rank(self.group, src), group=self.group)
        if back:
            tensor.copy_(staged)
        return tensor

    def barrier(self):
        if self.virtual:
            return self.group.barrier()
        if self.backend != "single":
            dist.barrier(group=self.group)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes):
        """torch.distributed.all_to_all_single over the first dimension (no autograd). Returns output."""
        if self.virtual:
            return self.group.all_to_all_single(output, input, output_split_sizes, input_split_sizes)
        if self.backend == "single":
            return output.copy_(input)
        staged_in, _ = self._staged(input.contiguous())
        staged_out, back = self._staged(output)
        if self.backend == "gloo" and staged_in.dtype == BF16:  # gloo has no bf16: move the bytes
            # Each element's two bytes along a new last dimension: the split sizes still count rows (dim 0), a 1-D
            # tensor's included (its uint8 view alone would have twice the rows).
            raw_out, raw_in = (t.unsqueeze(-1).view(torch.uint8) for t in (staged_out, staged_in))
            dist.all_to_all_single(raw_out, raw_in, output_split_sizes, input_split_sizes, group=self.group)
        else:
            dist.all_to_all_single(staged_out, staged_in, output_split_sizes, input_split_sizes, group=self.group)
        if back:
            output.copy_(staged_out)
        return output

    def all_to_all_rows(self, x, output_split_sizes, input_split_sizes):
        """all_to_all_single of x's rows with autograd (backward: the reverse all-to-all of the gradient). On virtual
        ranks the backward of every rank must run in one autograd call (flatep.baseline.backward)."""
        out_splits, in_splits = [int(v) for v in output_split_sizes], [int(v) for v in input_split_sizes]
        if self.virtual:
            return _virtual_all_to_all_rows(self.group, x, out_splits, in_splits)
        if self.backend not in ("gloo", "single"):
            try:
                from torch.distributed.nn.functional import all_to_all_single
            except ImportError:
                all_to_all_single = None
            if all_to_all_single is not None:
                out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
                return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.group)
        return _AllToAll.apply(x, out_splits, in_splits, self)


def collectives(group=None):
    """The Collectives of `group` (a torch.distributed group, None, or a flatep.virtual.VirtualRank); a Collectives
    passes through."""
    return group if isinstance(group, Collectives) else Collectives(group)


def _global_rank(group, rank):
    if group is None or group is dist.group.WORLD:
        return rank
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank  # torch < 2.0
    return get(group, rank)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd over a Collectives (gloo, one process, or where torch.distributed.nn lacks
    it)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, coll):
        ctx.splits, ctx.coll = (out_splits, in_splits), coll
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        return coll.all_to_all_single(out, x.contiguous(), out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        return ctx.coll.all_to_all_single(back, grad.contiguous(), in_splits, out_splits), None, None, None


def all_to_all_rows(x, out_splits, in_splits, group):
    """x's rows exchanged by all_to_all_single over `group` (a torch.distributed group, a VirtualRank or a
    Collectives), with autograd."""
    return collectives(group).all_to_all_rows(x, out_splits, in_splits)


# ---- the all-to-all of virtual ranks: one autograd node over every rank's rows ----


def _check_splits(rank, posted):
    """Every rank's split sizes agree (rank p's input_split_sizes[d] == rank d's output_split_sizes[p]): the same
    check, with the same message, on every rank (each sees every rank's posting)."""
    size = len(posted)
    for p in range(size):
        _, in_p, _, _, _ = posted[p]
        if len(in_p) != size or min(in_p) < 0:
            raise ValueError(f"virtual rank {rank}: all_to_all_rows: rank {p}'s input_split_sizes must be {size} "
                             f"non-negative ints, got {in_p}")
        for d in range(size):
            out_d = posted[d][2]
            if len(out_d) != size or in_p[d] != out_d[p]:
                raise ValueError(f"virtual rank {rank}: all_to_all_rows: rank {p} sends {in_p[d]} rows to rank {d}, "
                                 f"whose output_split_sizes is {out_d}")


def _virtual_all_to_all_rows(group, x, out_splits, in_splits):
    if sum(in_splits) != x.shape[0]:
        raise ValueError(f"all_to_all_rows: input_split_sizes sum to {sum(in_splits)}, x has {x.shape[0]} rows")
    stream = _stream_of(x.device)
    posted = group.all_gather_object((x, in_splits, out_splits, stream, _record(stream)))
    _check_splits(group.rank, posted)
    outs = None
    if group.rank == 0:  # one node for the world, built on rank 0's thread; every rank takes its output
        outs = _JointAllToAll.apply(posted, *[p[0] for p in posted])
    elif torch.is_grad_enabled() and x.requires_grad:
        # A node made and dropped, so that every rank's thread numbers as many autograd nodes as rank 0's. The engine
        # runs the ready nodes of the one backward by their sequence numbers, counted per thread: with the counts in
        # step the order over the ranks' nodes (hence the order gradients are summed in) is the same at every step
        # of every run, a resumed one included.
        x.view_as(x)
    return group.all_gather_object(outs)[0][group.rank]


def _stream_context(stream):
    return torch.cuda.stream(stream) if stream is not None else _NoStream()


class _NoStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _exchange(tensors, splits_in, streams, events):
    """out[d] = cat over sources p of tensors[p]'s rows for d (splits_in[p][d] rows at sum(splits_in[p][:d])), made on
    stream d after every source's event, the sources' memory kept for stream d."""
    size = len(tensors)
    outs = []
    for d in range(size):
        with _stream_context(streams[d]):
            pieces = []
            for p in range(size):
                if streams[d] is not None:
                    streams[d].wait_event(events[p])
                lo = sum(splits_in[p][:d])
                pieces.append(tensors[p][lo:lo + splits_in[p][d]])
            outs.append(torch.cat(pieces, dim=0))
            if streams[d] is not None:
                for t in tensors:
                    t.record_stream(streams[d])
    return outs


class _JointAllToAll(torch.autograd.Function):
    """Every virtual rank's all-to-all as one node: inputs rank p's rows, outputs rank d's received rows; backward
    the reverse exchange of the output gradients (every rank's, which is why the ranks' backward is one call)."""

    @staticmethod
    def forward(ctx, posted, *xs):
        streams = [p[3] for p in posted]
        splits_in = [p[1] for p in posted]
        splits_out = [p[2] for p in posted]
        ctx.streams, ctx.splits_out = streams, splits_out
        return tuple(_exchange([x.detach() for x in xs], splits_in, streams, [p[4] for p in posted]))

    @staticmethod
    def backward(ctx, *grads):
        streams = ctx.streams
        # The engine made this node's stream wait for every incoming gradient; each rank's part is computed on its
        # own stream after that, and this node's stream waits for all of them (its outputs' consumers wait on it).
        here = torch.cuda.current_stream() if streams[0] is not None else None
        ready = _record(here)
        events = [ready] * len(grads)
        # The gradient of output d is rank d's [sum(splits_out[d]), H]: rows from source p at sum(splits_out[d][:p]).
        back = _exchange([g.contiguous() for g in grads], ctx.splits_out, streams, events)
        if here is not None:
            for s in streams:
                here.wait_stream(s)
        return (None,) + tuple(back)


def backward(losses, grad_scale=1.0):
    """The backward of every virtual rank's loss in ONE autograd call (torch.autograd.backward over the list, seed
    gradients grad_scale, e.g. 1/R), as the baseline's virtual all-to-all needs. Call it on one thread after every
    rank's forward, e.g. on rank 0's in flatep.virtual.run_threads. Torch's stream semantics: the seeds are made on the
    calling thread's current stream, every node runs on its forward's stream after its inputs, and the calling stream
    waits for the gradients at the end. Returns an event recorded on the calling stream then (None on the CPU): every
    other rank's stream must wait for it before it reads its gradients."""
    losses = list(losses)
    torch.autograd.backward(losses, [torch.full_like(loss, grad_scale) for loss in losses])
    return _record(_stream_of(losses[0].device)) if losses else None


# ---- the layer ----


class _BaselineExperts(torch.autograd.Function):
    """recv_x [n, H] bf16 (rows grouped by local expert), offs [epn] int32 (exact group ends), w1, w2 (this rank's bf16
    expert Parameters) -> y [n, H] bf16 through flatep.ffn.grouped_ffn (on a GPU the bf16 Parameters themselves, as
    nn.MoE's compute views; elsewhere their fp32 copies, as nn.MoE's loop). Backward adds the weight gradients into
    w1.main_grad / w2.main_grad (fp32; groups without rows add nothing) and returns none for w1 / w2."""

    @staticmethod
    def forward(ctx, moe, recv_x, offs, w1, w2):
        on_views = _has_grouped_mm(recv_x)
        ctx.moe, ctx.offs, ctx.on_views = moe, offs, on_views
        ctx.num_rows = recv_x.shape[0]
        if recv_x.shape[0] == 0:  # no rows here this step (every expert of this rank unused)
            ctx.graph = None
            return recv_x.new_zeros(0, recv_x.shape[1])
        with torch.enable_grad():
            x_leaf = recv_x.detach().requires_grad_(ctx.needs_input_grad[1])
            w1_leaf = (w1 if on_views else w1.float()).detach().requires_grad_()
            w2_leaf = (w2 if on_views else w2.float()).detach().requires_grad_()
            y = grouped_ffn(x_leaf, w1_leaf, w2_leaf, offs, moe.activation)
        ctx.graph = (y, x_leaf, w1_leaf, w2_leaf)
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        moe = ctx.moe
        if ctx.graph is None:
            return None, grad_y.new_zeros(0, grad_y.shape[1]), None, None, None
        y, x_leaf, w1_leaf, w2_leaf = ctx.graph
        ctx.graph = None
        inputs = [w1_leaf, w2_leaf] + ([x_leaf] if x_leaf.requires_grad else [])
        if y.requires_grad:
            grads = list(torch.autograd.grad(y, inputs, grad_y.to(y.dtype), allow_unused=True))
        else:
            grads = [None] * len(inputs)
        grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, inputs)]
        sizes = torch.diff(ctx.offs, prepend=ctx.offs.new_zeros(1))
        empty = (sizes == 0).view(-1, 1, 1)  # a grouped GEMM need not write the gradient of a group without rows
        with torch.no_grad():
            for param, grad in zip((moe.w1, moe.w2), grads[:2]):
                if ctx.on_views:
                    grad = grad.masked_fill(empty, 0)
                param.main_grad.add_(grad)
        grad_x = grads[2] if x_leaf.requires_grad else None
        return None, grad_x, None, None, None


class AllToAllMoE(torch.nn.Module):
    """The all-to-all EP MoE layer (module docstring) with nn.MoE's constructor arguments that matter and its init.

    Args:
        hidden, ffn, num_experts, topk: H, F, E (a multiple of the group size R), K.
        group: a torch.distributed group (None: the default group, or one process alone) or a VirtualRank.
        num_tokens: accepted for nn.MoE's signature; the all-to-alls size nothing in advance.
        seed: init seed, the same on every rank (flatep.nn.init_expert_weights, init_router_weight,
            init_shared_weights: the weights nn.MoE holds for the same seed).
        device: 'cpu' (default) or a CUDA device.
        activation: 'swiglu' (default) or 'silu', as nn.MoE.
        shared_ffn: F_s of a shared expert on every token (nn.MoE's), or None.

    forward(x [s, H], topk_idx=None [s, K]) -> [s, H] in x's dtype (topk_idx overrides the router's choice; the weights
    stay the router's renormalised probabilities of those experts). After a call: ``last_counts`` [R, E] int64 (CPU:
    every rank's entries per expert, the all-gathered counts) and ``last_loads`` (rows each rank computed: its
    experts' entries, a list of R ints).
    """

    def __init__(self, hidden, ffn, num_experts, topk, group=None, *, num_tokens=None, seed=0, device=None,
                 activation="swiglu", shared_ffn=None):
        super().__init__()
        for name, value, accepted in (
            ("hidden", hidden, "in [1, 2147483647]"),
            ("ffn", ffn, "in [1, 2147483647]"),
            ("num_experts", num_experts, "in [1, 2147483647]"),
            ("topk", topk, "in [1, 32]"),
        ):
            check_int("AllToAllMoE", name, value, accepted, low=1, high=32 if name == "topk" else 2**31 - 1)
        if num_tokens is not None:
            check_int("AllToAllMoE", "num_tokens", num_tokens, "None or in [1, 2147483647]", low=1)
        if topk > num_experts:
            raise ValueError(f"AllToAllMoE: topk (K) must be at most num_experts={num_experts}, got {topk}")
        self.coll = collectives(group)
        self.rank, self.num_ranks = self.coll.rank, self.coll.size
        if num_experts % self.num_ranks:
            raise ValueError(
                f"AllToAllMoE: num_experts must be a multiple of the group size R={self.num_ranks}, got {num_experts}")
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        self.activation = check_activation("AllToAllMoE", activation)
        self.device = resolve_device(device)
        if self.coll.virtual and self.device != self.coll.group.device:
            raise ValueError(
                f"AllToAllMoE: device {self.device} differs from the virtual rank's {self.coll.group.device}")
        self.experts_per_rank = num_experts // self.num_ranks
        self.expert_offset = self.rank * self.experts_per_rank
        self.router = torch.nn.Linear(hidden, num_experts, bias=False, device=self.device)
        with torch.no_grad():
            self.router.weight.copy_(init_router_weight(hidden, num_experts, seed))
        own = range(self.expert_offset, self.expert_offset + self.experts_per_rank)
        w1, w2 = init_expert_weights(hidden, ffn, own, seed, self.activation)
        self.w1 = torch.nn.Parameter(w1.to(device=self.device, dtype=BF16))
        self.w2 = torch.nn.Parameter(w2.to(device=self.device, dtype=BF16))
        for param in (self.w1, self.w2):
            param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=self.device)
        self.projections = expert_projections(hidden, ffn, self.activation)
        if shared_ffn is not None:
            check_int("AllToAllMoE", "shared_ffn", shared_ffn, "None or in [1, 2147483647]", low=1)
        self.shared_ffn = shared_ffn
        self.shared_w1 = self.shared_w2 = None
        if shared_ffn is not None:
            sw1, sw2 = init_shared_weights(hidden, shared_ffn, seed, self.activation)
            self.shared_w1 = torch.nn.Parameter(sw1.to(self.device))
            self.shared_w2 = torch.nn.Parameter(sw2.to(self.device))
        self.num_tokens = num_tokens
        #: The order of each token's K terms in the combine's fp32 sum: 'expert' (Megatron's: by expert id) or
        #: 'reversed' (the opposite). Only the summation order changes: what that alone does to a training run is the
        #: noise floor of the loss comparison (benchmarks/training/train_e2e.py --spread).
        self.combine_order = "expert"
        self.last_counts = None
        self.last_loads = None

    # nn.MoE's own accessors (they read only router, shared_w1 / shared_w2, w1 / w2 and main_grad): one copy.
    replicated_parameters = MoE.replicated_parameters
    expert_parameters = MoE.expert_parameters
    zero_main_grad = MoE.zero_main_grad
    _check_input = MoE._check_input

    def forward(self, x, topk_idx=None):
        self._check_input(x)
        if topk_idx is not None and (not isinstance(topk_idx, torch.Tensor) or
                                     tuple(topk_idx.shape) != (x.shape[0], self.topk)):
            shape = list(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__
            raise ValueError(f"AllToAllMoE: topk_idx must be a [s={x.shape[0]}, K={self.topk}] tensor, got {shape}")
        R, epn, E, K, rank = self.num_ranks, self.experts_per_rank, self.num_experts, self.topk, self.rank
        if topk_idx is None:
            weights, idx = route(x, self.router.weight, K)
        else:  # routed after the counts' exchange, which checks the ids on every rank first
            idx = topk_idx.to(device=self.device, dtype=torch.long)
        xb = x.to(BF16)
        # Counts: every rank's per-expert counts, read on the host (the split sizes; Megatron's gather + .cpu()).
        # An id outside [0, E) counts in bucket E, so that every rank sees every rank's and fails alike.
        flat = idx.reshape(-1)
        flat = torch.where((flat < 0) | (flat >= E), torch.full_like(flat, E), flat)
        counts = torch.bincount(flat, minlength=E + 1)
        matrix = torch.stack(self.coll.all_gather(counts)).cpu()  # [R, E + 1] int64
        bad = matrix[:, E].nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"AllToAllMoE: topk_idx of rank(s) {bad} holds expert ids outside [0, {E})")
        matrix = matrix[:, :E]
        if topk_idx is not None:
            weights, idx = route(x, self.router.weight, K, idx)
        send_splits = matrix[rank].view(R, epn).sum(1).tolist()
        recv_host = matrix[:, rank * epn:(rank + 1) * epn]  # [R sources, epn local experts]
        recv_splits = recv_host.sum(1).tolist()
        self.last_counts = matrix
        self.last_loads = matrix.sum(0).view(R, epn).sum(1).tolist()
        order, token_of = by_expert(idx, K)
        sent = xb.index_select(0, token_of)
        recv = self.coll.all_to_all_rows(sent, recv_splits, send_splits)  # rows by [source][local expert]
        regroup, offs = by_local_expert(recv_host.to(self.device), total=sum(recv_splits))
        recv_x = recv.index_select(0, regroup)  # rows by [local expert][source]
        y = _BaselineExperts.apply(self, recv_x, offs, self.w1, self.w2)
        inverse = torch.empty_like(regroup)
        inverse[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        back = self.coll.all_to_all_rows(y.index_select(0, inverse), send_splits, recv_splits)  # my entries, by expert
        w_sorted = weights.reshape(-1).index_select(0, order)
        if self.combine_order == "reversed":  # the same terms summed in the opposite order (see combine_order)
            back, w_sorted, token_of = back.flip(0), w_sorted.flip(0), token_of.flip(0)
        out = _WeightedSum.apply(back, w_sorted, token_of, x.shape[0])
        if self.shared_ffn is not None:
            out = add_shared(out, shared_expert_ffn(xb, self.shared_w1, self.shared_w2, self.activation))
        return out.to(x.dtype)

    def extra_repr(self):
        return (f"hidden={self.hidden}, ffn={self.ffn}, num_experts={self.num_experts}, topk={self.topk}, "
                f"ranks={self.num_ranks}, experts_per_rank={self.experts_per_rank}, activation={self.activation!r}, "
                f"shared_ffn={self.shared_ffn}, collectives={self.coll.backend}")
