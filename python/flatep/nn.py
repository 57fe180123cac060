"""flatep.nn.MoE: a Mixture-of-Experts layer on FlatEP (router, experts on ExpertPools, grouped GEMM, combine).

Per rank: x [s, H] -> router (fp32 softmax, top-K, weights renormalised to sum 1) -> plan -> dispatch ->
prefetch replicas -> expert FFN y = silu(x @ W1) @ W2 over the compute views with offs = cu_seqlens (bf16 values,
fp32 accumulation; torch._grouped_mm on GPU when available, a loop over groups elsewhere) -> weighted combine.

On a CUDA device with torch._grouped_mm the whole layer (forward and backward) runs without a host synchronisation:
the grouped GEMMs read the compute views with offs = cu_seqlens in device memory. (Without torch._grouped_mm the
loop reads cu_seqlens on the host, a synchronisation.)

Parameters:
    router.weight [E, H]     fp32, replicated on every rank: all-reduce its gradient (.grad) like any data-parallel
                             parameter (MoE.replicated_parameters()).
    w1 [epn, H, F], w2 [epn, F, H]    bf16, this rank's experts rank*epn .. rank*epn+epn-1 (MoE.expert_parameters()).
                             Zero copy: each IS the own part of the layer's ExpertPools compute view (the memory the
                             grouped GEMM reads), so nothing is copied in per forward. Their fp32 gradient is
                             ``w1.main_grad`` / ``w2.main_grad`` (Megatron's convention), the own part of the pools'
                             gradient view: backward adds into it (accumulating over micro-batches until zeroed,
                             e.g. by flatep.optim.MainGradOptimizer.zero_grad) and ``.grad`` stays None. It includes
                             the contributions computed on replicas elsewhere (reduce_grad), so it needs no
                             all-reduce. Keep them bf16 on the layer's device: converting the module (``.float()``,
                             ``.to(other device)``) replaces their memory, and the next forward raises ValueError.
                             ``state_dict`` / ``load_state_dict`` copy into and out of the library's memory in place.
"""

import torch
import torch.nn.functional as F

from ._tensors import check_int
from .buffer import shared_buffer
from .distributed import group_rank_size, resolve_device
from .pools import shared_pools

_BF16 = torch.bfloat16


def expert_ffn(x, w1, w2):
    """One expert on its rows: x [n, H] (bf16 values), w1 [H, F], w2 [F, H] (bf16 values, any float dtype) ->
    [n, H] bf16. Matmuls accumulate in fp32; h, silu(h) and the output are rounded to bf16, as a bf16 grouped GEMM
    does. Shared by the distributed layer and the dense reference so both round at the same points."""
    h = (x.float() @ w1.float()).to(_BF16)
    a = F.silu(h.float()).to(_BF16)
    return (a.float() @ w2.float()).to(_BF16)


def _has_grouped_mm(x):
    return x.is_cuda and hasattr(torch, "_grouped_mm")


def grouped_ffn(x, w1, w2, cu_seqlens):
    """Grouped expert FFN over receive rows: x [NvS, H] bf16, w1 [G, H, F], w2 [G, F, H], cu_seqlens [G] int32
    (inclusive group ends) -> [NvS, H] bf16; rows past the last group end are zero."""
    if _has_grouped_mm(x) and w1.dtype == _BF16:
        offs = cu_seqlens.to(device=x.device, dtype=torch.int32)
        h = torch._grouped_mm(x, w1, offs=offs)
        a = F.silu(h.float()).to(_BF16)
        y = torch._grouped_mm(a, w2, offs=offs)
        end = torch.arange(x.shape[0], device=x.device).unsqueeze(1) < offs[-1]
        return torch.where(end, y, torch.zeros_like(y))
    ends = [int(e) for e in cu_seqlens.tolist()]
    pieces, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            pieces.append(expert_ffn(x[start:end], w1[g], w2[g]))
        start = max(start, end)
    if start < x.shape[0]:
        pieces.append(torch.zeros(x.shape[0] - start, x.shape[1], dtype=_BF16, device=x.device))
    return torch.cat(pieces, dim=0)


def route(x, router_weight, topk, topk_idx=None):
    """Router: logits = x @ router_weight.T in fp32, softmax, top-K (or the given topk_idx [s, K]), weights
    renormalised to sum 1. Returns (weights [s, K] fp32, topk_idx [s, K] int64)."""
    probs = torch.softmax(x.float() @ router_weight.float().t(), dim=-1)
    if topk_idx is None:
        weights, idx = probs.topk(topk, dim=-1)
    else:
        idx = topk_idx.to(device=probs.device, dtype=torch.long)
        weights = probs.gather(1, idx)
    return weights / weights.sum(dim=-1, keepdim=True), idx


def init_expert_weights(hidden, ffn, expert_ids, seed):
    """Deterministic per-expert init (N(0, 1/H) for W1, N(0, 1/F) for W2, from seed and the expert id), so a
    sharded layer and the dense reference built with the same seed hold the same experts."""
    w1 = torch.empty(len(expert_ids), hidden, ffn)
    w2 = torch.empty(len(expert_ids), ffn, hidden)
    for i, e in enumerate(expert_ids):
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(e) + 1)
        w1[i] = torch.randn(hidden, ffn, generator=g) / hidden**0.5
        w2[i] = torch.randn(ffn, hidden, generator=g) / ffn**0.5
    return w1, w2


def init_router_weight(hidden, num_experts, seed):
    g = torch.Generator().manual_seed(int(seed) * 1_000_003)
    return torch.randn(num_experts, hidden, generator=g) / hidden**0.5


class _ExpertsFunction(torch.autograd.Function):
    """recv_x [NvS, H] bf16, w1 [epn, H, F], w2 [epn, F, H] (the layer's bf16 own weights, the compute views' own
    part) -> y [NvS, H] bf16.

    Forward: prefetch (collective), grouped FFN over the compute views (no weight copy: w1 and w2 are that memory).
    Backward: the GEMM's weight gradients into the grads views (write_grads with accumulate: added into the own
    experts' main_grad, the replica slots used this step overwritten), reduce_grad (collective: replicas' gradients
    added into the owners' main_grad). Returns no gradient for w1 / w2: theirs is main_grad."""

    @staticmethod
    def forward(ctx, moe, plan, recv_x, w1, w2):
        pools, layer = moe.pools, moe.expert_layer
        pools.prefetch(plan, layer)
        on_views = _has_grouped_mm(recv_x)
        with torch.enable_grad():
            x_leaf = recv_x.detach().requires_grad_(ctx.needs_input_grad[2])
            # CPU: fp32 copies of the views (the loop computes in fp32 anyway), which also frees backward from the
            # slot pool. GPU: the bf16 views themselves; backward prefetches again (another layer may have written
            # the shared slot pool in between).
            w1_leaf = (layer.weights(0) if on_views else layer.weights(0).float()).detach().requires_grad_()
            w2_leaf = (layer.weights(1) if on_views else layer.weights(1).float()).detach().requires_grad_()
            y = grouped_ffn(x_leaf, w1_leaf, w2_leaf, plan.cu_seqlens)
        ctx.moe, ctx.plan, ctx.on_views = moe, plan, on_views
        ctx.graph = (y, x_leaf, w1_leaf, w2_leaf)
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        moe, plan = ctx.moe, ctx.plan
        pools, layer = moe.pools, moe.expert_layer
        y, x_leaf, w1_leaf, w2_leaf = ctx.graph
        ctx.graph = None
        want_w = (ctx.needs_input_grad[3], ctx.needs_input_grad[4])  # the same on every rank (collectives below)
        inputs = [leaf for leaf, want in zip((w1_leaf, w2_leaf), want_w) if want]
        if x_leaf.requires_grad:
            inputs.append(x_leaf)
        if not inputs:
            return None, None, None, None, None
        if ctx.on_views:
            pools.prefetch(plan, layer)
        grads = list(torch.autograd.grad(y, inputs, grad_y.to(y.dtype)))
        # Own groups with rows added into main_grad (groups without rows untouched: a grouped GEMM need not write
        # them) and the slots used this step; the plan decides on the device, no synchronisation. Unused slots keep
        # their zero reduce pool (a projection not written this step adds zeros).
        for p in (0, 1):
            if want_w[p]:
                pools.write_grads(plan, layer, p, grads.pop(0), accumulate=True)
        if any(want_w):
            pools.reduce_grad(plan, layer)
        grad_x = grads.pop(0) if x_leaf.requires_grad else None
        if grad_x is not None and ctx.on_views:  # rows past the last group end are unspecified: make them zero
            end = plan.cu_seqlens[-1].to(device=grad_x.device, dtype=torch.int64)
            past_end = torch.arange(grad_x.shape[0], device=grad_x.device) >= end
            grad_x = grad_x.masked_fill(past_end.unsqueeze(1), 0)
        return None, None, grad_x, None, None


class MoE(torch.nn.Module):
    """Mixture-of-Experts layer across the ranks of `group` (one process per rank; collective constructor).

    Args:
        hidden (int): H (a multiple of 8).
        ffn (int): F, expert FFN size.
        num_experts (int): E, a multiple of the group size R.
        topk (int): K.
        group: torch.distributed process group (None: the default group, or a one-rank world).
        num_tokens (int or None): S, the most tokens per rank per call; None: the first call's s.
        align, capacity_factor, planner: see flatep.Buffer.
        seed (int): init seed; every rank must pass the same (see init_expert_weights).
        pools (ExpertPools or None): share one across layers; None: the process's shared pools for this shape.
            The layer's Buffer is likewise the process's shared Buffer for its shape (flatep.buffer.shared_buffer):
            communication memory does not grow with the number of layers.
        device: 'cpu' (default) or a CUDA device (FlatEP built with CUDA); parameters, Buffer and pools live there
            and x must be on it.

    forward(x [s, H] float tensor, topk_idx=None [s, K] int) -> [s, H] in x's dtype. topk_idx overrides the router's
    choice (the weights are still the router's probabilities of those experts, renormalised). After a call,
    ``last_plan`` holds the step's Plan (``last_plan.stats['loads']``: rows per rank).
    """

    def __init__(
        self,
        hidden,
        ffn,
        num_experts,
        topk,
        group=None,
        *,
        num_tokens=None,
        align=128,
        capacity_factor=1.0,
        planner="balanced",
        seed=0,
        pools=None,
        device=None,
    ):
        super().__init__()
        for name, value, accepted in (
            ("hidden", hidden, "a multiple of 8 in [8, 2147483640]"),
            ("ffn", ffn, "in [1, 2147483647]"),
            ("num_experts", num_experts, "in [1, 2147483647]"),
            ("topk", topk, "in [1, 32]"),
        ):  # before any tensor is built from them (torch would fail first, with its own words)
            check_int("MoE", name, value, accepted, low=1)
        self.rank, self.num_ranks = group_rank_size(group)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts % self.num_ranks != 0:
            raise ValueError(
                f"MoE: num_experts must be an int multiple of the group size R={self.num_ranks}, got {num_experts!r}"
            )
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        self.group, self.align, self.capacity_factor, self.planner = group, align, capacity_factor, planner
        self.device = resolve_device(device)
        self.experts_per_rank = num_experts // self.num_ranks
        self.expert_offset = self.rank * self.experts_per_rank
        self.router = torch.nn.Linear(hidden, num_experts, bias=False, device=self.device)
        with torch.no_grad():
            self.router.weight.copy_(init_router_weight(hidden, num_experts, seed))
        self.pools = pools if pools is not None else shared_pools(
            group, self.experts_per_rank, [(hidden, ffn), (ffn, hidden)], self.device
        )
        shapes = [(hidden, ffn), (ffn, hidden)]
        if self.pools.projections != shapes or self.pools.experts_per_rank != self.experts_per_rank:
            raise ValueError(f"MoE: pools must have epn={self.experts_per_rank} and projections {shapes}")
        if self.pools.device != self.device:
            raise ValueError(f"MoE: pools are on {self.pools.device}, the layer on {self.device}")
        self.expert_layer = layer = self.pools.register_layer()
        own = range(self.expert_offset, self.expert_offset + self.experts_per_rank)
        w1, w2 = init_expert_weights(hidden, ffn, own, seed)
        with torch.no_grad():  # once, at construction: from here on the parameters are the library's memory
            layer.own_weights(0).copy_(w1)
            layer.own_weights(1).copy_(w2)
        self.w1 = torch.nn.Parameter(layer.own_weights(0))
        self.w2 = torch.nn.Parameter(layer.own_weights(1))
        for p, param in enumerate((self.w1, self.w2)):
            param.main_grad = layer.own_grads(p)  # fp32, the own part of the pools' gradient view
            param._flatep_owner = layer  # the memory lives while the parameter does
        self.buffer = None
        self.num_tokens = num_tokens
        self.last_plan = None
        if num_tokens is not None:
            self._make_buffer(num_tokens)

    def _make_buffer(self, num_tokens):
        # One Buffer per shape and process, shared by every layer of that shape (like the pools).
        self.buffer = shared_buffer(
            self.group, num_tokens, self.hidden, self.num_experts, self.topk, self.align, self.capacity_factor,
            planner=self.planner, device=self.device,
        )
        self.num_tokens = num_tokens

    def replicated_parameters(self):
        """Parameters every rank holds a full copy of (the router): all-reduce their gradients across the group."""
        return list(self.router.parameters())

    def expert_parameters(self):
        """This rank's expert weights [w1, w2]: bf16 over the library's memory, fp32 gradients in ``main_grad``."""
        return [self.w1, self.w2]

    def zero_main_grad(self):
        """Zeroes the experts' main_grad (backward accumulates into it)."""
        for param in self.expert_parameters():
            param.main_grad.zero_()

    def _check_zero_copy(self):
        layer = self.expert_layer
        for p, (name, param) in enumerate((("w1", self.w1), ("w2", self.w2))):
            own = layer.own_weights(p)
            if param.dtype != own.dtype or param.device != own.device or param.data_ptr() != own.data_ptr():
                raise ValueError(
                    f"MoE: {name} is no longer the library's expert memory (it is {str(param.dtype)[6:]} on "
                    f"{param.device}; was the module converted with .float() / .to()?): expert parameters must stay "
                    f"bf16 on {self.device}; build the layer again"
                )

    @torch.no_grad()
    def load_dense(self, dense):
        """Copies the weights of a flatep.testing.DenseMoE (router and this rank's experts)."""
        lo, hi = self.expert_offset, self.expert_offset + self.experts_per_rank
        self.router.weight.copy_(dense.router_weight)
        self.w1.copy_(dense.w1[lo:hi])
        self.w2.copy_(dense.w2[lo:hi])

    def forward(self, x, topk_idx=None):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"MoE: x must be a [s, H={self.hidden}] tensor, got {shape}")
        if x.device != self.device:
            raise ValueError(f"MoE: x is on {x.device}, but the layer is on {self.device}")
        self._check_zero_copy()
        if self.buffer is None:
            self._make_buffer(int(x.shape[0]))
        weights, idx = route(x, self.router.weight, self.topk, topk_idx)
        plan = self.buffer.plan(idx)
        recv_x, recv_w, _ = self.buffer.dispatch(plan, x.to(_BF16), weights)
        y = _ExpertsFunction.apply(self, plan, recv_x, self.w1, self.w2)
        out = self.buffer.combine(plan, y, recv_w)
        self.last_plan = plan
        return out.to(x.dtype)

    def extra_repr(self):
        return (
            f"hidden={self.hidden}, ffn={self.ffn}, num_experts={self.num_experts}, topk={self.topk}, "
            f"ranks={self.num_ranks}, experts_per_rank={self.experts_per_rank}"
        )
