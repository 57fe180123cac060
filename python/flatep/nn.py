"""flatep.nn.MoE: a Mixture-of-Experts layer on FlatEP (router, experts on ExpertPools, grouped GEMM, combine).

Per rank: x [s, H] -> router (fp32 softmax, top-K, weights renormalised to sum 1) -> plan -> dispatch ->
prefetch replicas -> expert FFN over the compute views with offs = cu_seqlens (bf16 values, fp32 accumulation;
torch._grouped_mm on GPU when available, a loop over groups elsewhere) -> weighted combine. The expert FFN is

    activation="swiglu" (default): h = x @ W1, W1 [H, 2F] = [gate | up] fused (columns [0, F) the gate projection,
                                   [F, 2F) the up projection: the layout grouped-GEMM MoE kernels use);
                                   a = silu(h[:, :F]) * h[:, F:]; y = a @ W2, W2 [F, H]
    activation="silu":             h = x @ W1, W1 [H, F]; a = silu(h); y = a @ W2, W2 [F, H]

with h rounded to bf16 (the GEMM's bf16 output, fp32 accumulation), a computed in fp32 from h and rounded to bf16,
y rounded to bf16 (see expert_ffn).

FP8 rows (fp8=True, H a multiple of 128; docs/design.md §6 "FP8 rows"): dispatch moves the token rows as e4m3 plus one
fp32 scale per 128 channels (flatep.fp8's rule), about half the bytes of bf16; the receive rows are dequantised to
bf16 on the device (exactly e4m3 value * scale, rounded once to bf16, the bits of flatep.fp8.dequantize) and the
expert FFN runs in bf16 from there (torch._grouped_mm; _FP8DispatchExpertsFunction says why not
torch._scaled_grouped_mm). Backward is all bf16: the rows' gradient is the gradient at the dequantised rows, sent back
to the tokens through an unweighted bf16 combine (straight through the quantisation, as bf16 dispatch's backward),
the routing weights' through entry_values; the expert GEMMs' backward is bf16 with fp32 weight gradients, as without
FP8. Accuracy against the bf16 layer: tests/python/test_moe_fp8.py and benchmarks/layer/moe_fp8.py.

Shared expert (shared_ffn=F_s): a dense FFN of the layer's activation, W1 [H, 2F_s] (swiglu) or [H, F_s], W2 [F_s, H],
applied to every token and added to the routed output: out = bf16(fp32(routed) + fp32(shared)). Its weights are
ordinary fp32 Parameters (shared_w1, shared_w2), replicated like the router (all-reduce .grad), used as bf16 values
(shared_expert_ffn). With ``overlap`` (default True) it is computed on the compute (current) stream while plan and
dispatch run on the Buffer's comm_stream (async_finish=True, then handle.current_stream_wait()).

Micro-batches (forward_microbatches(x_list)): the dispatch of micro-batch i+1 overlaps the expert GEMMs of micro-batch
i, and the combine of i the shared expert and GEMMs of i+1; each micro-batch has its own plan; the schedule and why it
is correct: MoE.forward_microbatches. On the CPU backend (no streams, synchronous ops) the same code runs and gives
the bits of the serial path (tests/python/test_moe_overlap.py).

torch.compile (design §3, "torch.compile"): under tracing the experts run through flatep.ops' "experts" custom op
(ffn_forward, saving h and a) and its backward op (experts_backward_step: ffn_backward into main_grad); the shared
expert and forward_microbatches take their serial schedule; fp8=True and a Buffer not yet made raise ValueError.

On a CUDA device with torch._grouped_mm the whole layer (forward and backward) runs without a host synchronisation:
the grouped GEMMs read the compute views with offs = cu_seqlens in device memory. (Without torch._grouped_mm the
loop reads cu_seqlens on the host, a synchronisation.)

Parameters:
    router.weight [E, H]     fp32, replicated on every rank: all-reduce its gradient (.grad) like any data-parallel
                             parameter (MoE.replicated_parameters()).
    w1 [epn, H, 2F] (swiglu) or [epn, H, F] (silu), w2 [epn, F, H]
                             bf16, this rank's experts rank*epn .. rank*epn+epn-1 (MoE.expert_parameters()).
                             Zero copy: each IS the own part of the layer's ExpertPools compute view (the memory the
                             grouped GEMM reads), so nothing is copied in per forward. Their fp32 gradient is
                             ``w1.main_grad`` / ``w2.main_grad`` (Megatron's convention), the own part of the pools'
                             gradient view: backward adds into it (accumulating over micro-batches until zeroed,
                             e.g. by flatep.optim.MainGradOptimizer.zero_grad) and ``.grad`` stays None. It includes
                             the contributions computed on replicas elsewhere (reduce_grad), so it needs no
                             all-reduce. Keep them bf16 on the layer's device: converting the module (``.float()``,
                             ``.to(other device)``) replaces their memory, and the next forward raises ValueError.
                             ``state_dict`` / ``load_state_dict`` copy into and out of the library's memory in place.
    shared_w1 [H, 2F_s] or [H, F_s], shared_w2 [F_s, H]
                             (shared_ffn only) fp32, replicated on every rank like the router
                             (MoE.replicated_parameters()); used as bf16 values.
"""


import functools

import torch

from . import _C
from . import fp8 as _fp8
from . import ops as _ops
from ._tensors import check_int
from .buffer import shared_buffer
from .distributed import group_rank_size, resolve_device
from .ffn import (  # noqa: F401 - the expert FFN's arithmetic (flatep.ffn), importable from here as before
    ACTIVATIONS, activate, check_activation, expert_ffn, expert_projections, experts_backward_step, ffn_backward,
    ffn_forward, grouped_ffn, w1_columns, _has_grouped_mm, _past_end,
)
from .buffer import Buffer
from .placement import LayerPlacement
from .pools import shared_pools
from .serving import check_inference, check_num_slots, serving_experts

_BF16 = torch.bfloat16

#: nn.MoE's default row padding of every expert group (Buffer's `align`), chosen by measurement: the grouped GEMMs'
#: time over FlatEP's groups at align 16/32/64/128 (benchmarks/probes/grouped_mm_align.py). torch._grouped_mm itself
#: needs no group alignment for the operand layouts this module passes (16-byte aligned bases and strides only). On
#: the H200 (MoonEP's shape, F 512 / 2048, maxvio 0.2 / 20;
#: benchmarks/results/grouped_mm_align_R8_S8192_E384_H7168_K8_h200.csv)
#: the expert FFN's forward + backward summed 66.7 / 67.0 / 68.2 / 70.5 ms at align 16 / 32 / 64 / 128: the GEMMs' time
#: barely moves with align, the receive rows (and every pass over them) shrink with it.
DEFAULT_ALIGN = 16


def route(x, router_weight, topk, topk_idx=None):
    """Router: logits = x @ router_weight.T in fp32, softmax, top-K (or the given topk_idx [s, K]), weights
    renormalised to sum 1. Returns (weights [s, K] fp32, topk_idx [s, K] int64)."""
    probs = torch.softmax(x.float() @ router_weight.float().t(), dim=-1)
    if topk_idx is None:
        weights, idx = probs.topk(topk, dim=-1)
    else:
        if (not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype not in (torch.int32, torch.int64)
                or tuple(topk_idx.shape) != (x.shape[0], topk)):
            got = f"{str(topk_idx.dtype)[6:]} {list(topk_idx.shape)}" if isinstance(topk_idx, torch.Tensor) else \
                type(topk_idx).__name__
            raise ValueError(f"MoE: topk_idx must be an int32 or int64 tensor [s={x.shape[0]}, K={topk}], got {got}")
        idx = topk_idx.to(device=probs.device, dtype=torch.long)
        # An id outside [0, E) is the plan's to report (one line naming it and its index, without a host read of the
        # ids on a GPU): the gather reads a valid column for it meanwhile.
        weights = probs.gather(1, idx.clamp(0, probs.shape[1] - 1))
    return weights / weights.sum(dim=-1, keepdim=True), idx


def init_expert_weights(hidden, ffn, expert_ids, seed, activation="swiglu"):
    """Deterministic per-expert init (N(0, 1/H) for W1, gate and up alike, N(0, 1/F) for W2, drawn in that order from a
    torch.Generator seeded seed * 1_000_003 + expert id + 1), so a sharded layer and the dense reference built with
    the same seed hold the same experts. W1 is [H, 2F] for swiglu, [H, F] for silu. The router (init_router_weight)
    draws [E, H] N(0, 1/H) from seed * 1_000_003, the shared expert (init_shared_weights) from seed * 1_000_003 +
    500_000_009."""
    cols = w1_columns(ffn, activation)
    w1 = torch.empty(len(expert_ids), hidden, cols)
    w2 = torch.empty(len(expert_ids), ffn, hidden)
    for i, e in enumerate(expert_ids):
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(e) + 1)
        w1[i] = torch.randn(hidden, cols, generator=g) / hidden**0.5
        w2[i] = torch.randn(ffn, hidden, generator=g) / ffn**0.5
    return w1, w2


def init_router_weight(hidden, num_experts, seed):
    g = torch.Generator().manual_seed(int(seed) * 1_000_003)
    return torch.randn(num_experts, hidden, generator=g) / hidden**0.5


def init_shared_weights(hidden, ffn, seed, activation="swiglu"):
    """Deterministic init of the shared expert (as init_expert_weights, from its own stream of `seed`): W1 [H, 2F]
    (swiglu) or [H, F], W2 [F, H], fp32."""
    cols = w1_columns(ffn, activation)
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 500_000_009)
    w1 = torch.randn(hidden, cols, generator=g) / hidden**0.5
    w2 = torch.randn(ffn, hidden, generator=g) / ffn**0.5
    return w1, w2


def _bf16_values(w):
    """w's values rounded to bf16, gradient passed straight through in w's dtype (fp32 masters keep fp32 grads)."""
    return w + (w.to(_BF16).to(w.dtype) - w).detach()


def shared_expert_ffn(x, w1, w2, activation):
    """The shared expert on every token: x [s, H] bf16, w1 [H, 2F] (swiglu) or [H, F], w2 [F, H] (fp32 masters or
    bf16) -> [s, H] bf16, the weights used as bf16 values. CUDA: two bf16 GEMMs (fp32 accumulation, bf16 out) with
    the activation of expert_ffn between them; elsewhere expert_ffn itself (fp32 matmuls rounded at the same points,
    as flatep.testing.DenseMoE's shared expert on any device)."""
    if x.is_cuda:
        h = x.to(_BF16) @ w1.to(_BF16)
        a = activate(h, activation)
        return a @ w2.to(_BF16)
    return expert_ffn(x, _bf16_values(w1), _bf16_values(w2), activation)


def add_shared(routed, shared):
    """out = bf16(fp32(routed) + fp32(shared)): the routed output plus the shared expert's, rounded once."""
    return (routed.float() + shared.float()).to(_BF16)


def _stream_event(device):
    """An event recorded now on the current CUDA stream of `device` (None on the CPU backend: ops are synchronous)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def dequantize_rows(q, scales):
    """FP8 receive rows back to bf16: q [N, H] e4m3 (float8_e4m3fn or uint8), scales [N, H/128] fp32 -> [N, H] bf16,
    each value e4m3_value * scale in fp32 rounded once to bf16: the bits of flatep.fp8.dequantize(q, scales,
    torch.bfloat16). On a GPU with Triton: one kernel (_make_triton_dequantize); else, with torch's float8 dtype,
    two elementwise passes and no fp32 temporary (e4m3 -> bf16 is exact; the product is computed in fp32 and written
    as bf16); uint8 bytes (torch < 2.1) go through flatep.fp8."""
    if q.dtype == torch.uint8:
        return _fp8.dequantize(q, scales, _BF16)
    triton_dequantize = _triton_dequantize() if q.is_cuda else None
    if triton_dequantize is not None:
        return triton_dequantize(q, scales)
    rows = q.to(_BF16)
    blocks = rows.view(q.shape[0], q.shape[1] // _fp8.BLOCK, _fp8.BLOCK)
    torch.mul(blocks, scales.unsqueeze(-1), out=blocks)
    return rows


def _make_triton_dequantize():
    """One-pass dequantisation on a GPU (Triton, where installed): reads the e4m3 bytes and the block scales once and
    writes bf16, ~4x less time than the two torch passes (benchmarks/layer/moe_fp8.py). The same arithmetic: e4m3 ->
    fp32 (exact), one fp32 multiply, round to nearest even to bf16."""
    # Triton comes with CUDA builds of torch (a dependency of torch's CUDA wheels) and has no Debian package; the
    # CPU backend never needs it: an optional import (scripts/check_deps.py's BUNDLED_OPTIONAL).
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(q_ptr, s_ptr, out_ptr, num_blocks, BLOCKS: tl.constexpr, CHANNELS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        live = b < num_blocks
        scale = tl.load(s_ptr + b, mask=live, other=0.0)
        at = b[:, None] * CHANNELS + tl.arange(0, CHANNELS)[None, :]
        q = tl.load(q_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (q * scale[:, None]).to(tl.bfloat16), mask=live[:, None])

    def dequantize(q, scales):
        q, scales = q.contiguous(), scales.contiguous()
        out = torch.empty(q.shape, dtype=_BF16, device=q.device)
        num_blocks = scales.numel()
        if num_blocks:
            blocks = 32
            with torch.cuda.device(q.device):
                kernel[(triton.cdiv(num_blocks, blocks),)](q, scales, out, num_blocks, BLOCKS=blocks,
                                                           CHANNELS=_fp8.BLOCK, num_warps=4)
        return out

    return dequantize


@functools.lru_cache(maxsize=None)
def _triton_dequantize():
    """_make_triton_dequantize()'s function (None without Triton or torch's float8 dtype), made at the first use on
    a GPU, never at import: importing flatep must not start CUDA, since CUDA_MODULE_LOADING and
    CUDA_DEVICE_MAX_CONNECTIONS take effect only when set before it starts (flatep.virtual)."""
    return _make_triton_dequantize() if _fp8.E4M3_DTYPE else None


def _experts_forward(ctx, moe, plan, recv_x, want_x_grad):
    """The experts' forward shared by both autograd functions: prefetch (collective), the grouped FFN over the
    compute views with its autograd graph kept in ctx for _experts_backward. Returns y [NvS, H] bf16 (detached)."""
    pools, layer = moe.pools, moe.expert_layer
    pools.prefetch(plan, layer)
    on_views = _has_grouped_mm(recv_x)
    with torch.enable_grad():
        x_leaf = recv_x.detach().requires_grad_(want_x_grad)
        # CPU: fp32 copies of the views (the loop computes in fp32 anyway), which also frees backward from the
        # slot pool. GPU: the bf16 views themselves; backward prefetches again (another layer may have written
        # the shared slot pool in between).
        w1_leaf = (layer.weights(0) if on_views else layer.weights(0).float()).detach().requires_grad_()
        w2_leaf = (layer.weights(1) if on_views else layer.weights(1).float()).detach().requires_grad_()
        y = grouped_ffn(x_leaf, w1_leaf, w2_leaf, plan.cu_seqlens, moe.activation)
    ctx.moe, ctx.plan, ctx.on_views = moe, plan, on_views
    ctx.graph = (y, x_leaf, w1_leaf, w2_leaf)
    return y.detach()


def _experts_backward(ctx, grad_y, want_w):
    """Backward of _experts_forward: the weight gradients into main_grad (write_grads with accumulate, reduce_grad:
    collective) for the projections in want_w (the same on every rank); returns the rows' gradient [NvS, H] bf16
    (zero past the last group end) or None where the rows needed none."""
    moe, plan = ctx.moe, ctx.plan
    pools, layer = moe.pools, moe.expert_layer
    y, x_leaf, w1_leaf, w2_leaf = ctx.graph
    ctx.graph = None
    inputs = [leaf for leaf, want in zip((w1_leaf, w2_leaf), want_w) if want]
    if x_leaf.requires_grad:
        inputs.append(x_leaf)
    if not inputs:
        return None
    if ctx.on_views:
        pools.prefetch(plan, layer)
    if y.requires_grad:  # allow_unused: a leaf no group of this rank's rows reached has no gradient (zero)
        grads = torch.autograd.grad(y, inputs, grad_y.to(y.dtype), allow_unused=True)
    else:  # no rows on this rank this step (the CPU loop then builds y from zeros alone)
        grads = [None] * len(inputs)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, inputs)]
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
        # in place (autograd.grad returned a tensor of its own): one pass over grad_x, no second [NvS, H] tensor
        grad_x = grad_x.masked_fill_(_past_end(grad_x.shape[0], plan.cu_seqlens.to(grad_x.device)), 0)
    return grad_x


class _ExpertsFunction(torch.autograd.Function):
    """recv_x [NvS, H] bf16, w1 [epn, H, 2F or F], w2 [epn, F, H] (the layer's bf16 own weights, the compute views'
    own part) -> y [NvS, H] bf16.

    Forward: prefetch (collective), grouped FFN over the compute views (no weight copy: w1 and w2 are that memory).
    Backward: the GEMM's weight gradients into the grads views (write_grads with accumulate: added into the own
    experts' main_grad, the replica slots used this step overwritten), reduce_grad (collective: replicas' gradients
    added into the owners' main_grad). Returns no gradient for w1 / w2: theirs is main_grad."""

    @staticmethod
    def forward(ctx, moe, plan, recv_x, w1, w2):
        return _experts_forward(ctx, moe, plan, recv_x, ctx.needs_input_grad[2])

    @staticmethod
    def backward(ctx, grad_y):
        want_w = (ctx.needs_input_grad[3], ctx.needs_input_grad[4])
        return None, None, _experts_backward(ctx, grad_y, want_w), None, None


def _experts_compiled(moe, plan, recv_x):
    """The experts while torch.compile traces (design §3, "torch.compile"): prefetch (the pools' custom op), then the
    "experts" custom op: ffn_forward over the compute views, y with h and a saved for its registered backward
    (experts_backward_step: prefetch again, ffn_backward, write_grads(accumulate) and reduce_grad into main_grad).
    w1 and w2 are inputs so that autograd runs the backward when they need gradients; like _ExpertsFunction it
    returns none for them (theirs is main_grad)."""
    pools, layer = moe.pools, moe.expert_layer
    pools.prefetch(plan, layer)
    save = torch.is_grad_enabled() and (recv_x.requires_grad or moe.w1.requires_grad or moe.w2.requires_grad)
    y, _, _ = _ops.experts_op(
        pools._op_id, layer._index, plan._handle, plan._storage, plan.cu_seqlens, recv_x, moe.w1, moe.w2,
        layer._weights[0], layer._weights[1], layer._grads[0], layer._grads[1], moe.activation, save,
    )
    return y


class _FP8DispatchExpertsFunction(torch.autograd.Function):
    """FP8 dispatch and the experts as one autograd node: x [s, H] bf16, topk_weights [s, K] fp32, w1, w2 ->
    (y [NvS, H] bf16, recv_w [NvS] fp32). (Buffer.dispatch(..., fp8=True) has no autograd; this node defines it.)

    Forward: the raw FP8 dispatch (x quantised inside the op by flatep.fp8's rule), the receive rows dequantised to
    bf16 on the device (dequantize_rows), then the experts exactly as _ExpertsFunction (the bf16 grouped FFN).

    Why not torch._scaled_grouped_mm for the first GEMM: on the H200 (SM90, torch 2.11.0+cu130) the scaled grouped
    GEMM takes e4m3 operands with row-wise fp32 scales only (scale_a [rows] for a 2-D A, scale_b [G, N] for a
    column-major 3-D B); FlatEP's [rows, H/128] block scales are refused ("scale must be a 1D tensor, but got 2D"),
    and torch.nn.functional.scaled_grouped_mm with the BlockWise1x128 / BlockWise128x128 recipes finds "No gemm
    implementation". Mapping the block scales onto one scale per row means requantising every receive row (a second
    rounding) and quantising and transposing W1's compute view every forward (the weights change every step): at
    S=8192, H=7168, F=2048, epn=48, K=8 that is 7.2 ms + 37 ms in torch ops to save 2 ms of GEMM (3.6 ms row-wise
    FP8 against 5.6 ms bf16), while the dequantisation takes 0.46 ms (benchmarks/results/moe_fp8_h200.csv).

    Backward (bf16, like dispatch's own): the experts' backward as _ExpertsFunction (weight gradients into
    main_grad, reduce_grad), then the gradient at the dequantised rows goes back to the tokens through an unweighted
    bf16 combine (the K row gradients of a token summed: straight through the quantisation), and recv_w's gradient
    through entry_values. The collectives run in the order of the bf16 path (experts, combine, entry_values)."""

    @staticmethod
    def forward(ctx, moe, plan, x, topk_weights, w1, w2):
        buffer = moe.buffer
        (recv_q, recv_s), recv_w, _ = buffer._dispatch_fp8_raw(plan, x.contiguous(), None, None,
                                                                topk_weights.contiguous())
        recv_x = dequantize_rows(recv_q, recv_s)
        del recv_q, recv_s
        y = _experts_forward(ctx, moe, plan, recv_x, ctx.needs_input_grad[2])
        ctx.buffer = buffer
        return y, recv_w

    @staticmethod
    def backward(ctx, grad_y, grad_recv_w):
        buffer, plan = ctx.buffer, ctx.plan
        grad_rows = _experts_backward(ctx, grad_y, (ctx.needs_input_grad[4], ctx.needs_input_grad[5]))
        grad_x = grad_w = None
        if ctx.needs_input_grad[2]:
            grad_x = buffer._combine_raw(plan, grad_rows.to(_BF16).contiguous(), None)
        if ctx.needs_input_grad[3]:
            grad_w = buffer._entry_values_raw(plan, grad_recv_w.to(torch.float32).contiguous())
        return None, None, grad_x, grad_w, None, None


class MoE(torch.nn.Module):
    """Mixture-of-Experts layer across the ranks of `group` (one process per rank; collective constructor).

    Args:
        hidden (int): H (a multiple of 8).
        ffn (int): F, expert FFN size.
        num_experts (int): E, a multiple of the group size R.
        topk (int): K.
        group: torch.distributed process group (None: the default group, or a one-rank world).
        num_tokens (int or None): S, the most tokens per rank per call; None: the first call's s.
        align, capacity_factor, planner: see flatep.Buffer (align's default: DEFAULT_ALIGN). planner='owner' (no
            replicas, no prefetch) suits decode; ``use_planner`` switches planner and S between steps over the same
            weights (e.g. balanced for prefill, owner for decode). planner='static' runs a fixed placement of
            replicas, as serving engines' periodic expert placement does: ``set_placement(slots)`` (collective) gives
            it, the next forward moves the placed weights into the slots (once: later forwards copy no weight while
            the pools' slot pool still holds them; ``last_placement_bytes`` says what a forward moved), and every
            step splits each expert's entries evenly over its copies (docs/design.md §4 "The static planner").
            Its Buffers are the layer's own (a placement is per layer), not the process's shared ones.
        num_slots (int or None): B replica slots per rank (flatep.ExpertPools). None (default) or epn: training.
            B < epn: serving, inference only (forward under torch.no_grad() / torch.inference_mode(); a forward that
            autograd would record raises ValueError): the experts' grouped GEMM runs on the pools' [R*Q + B] weights
            view with the plan's cu_seqlens (flatep.serving), every replica beyond the B slots read in place from its
            owner, no weight copied per step. w1 / w2 are then Parameters without gradient (requires_grad False, no
            main_grad).
        seed (int): init seed; every rank must pass the same (see init_expert_weights).
        pools (ExpertPools or None): share one across layers; None: the process's shared pools for this shape.
            The layer's Buffer is likewise the process's shared Buffer for its shape (flatep.buffer.shared_buffer):
            communication memory does not grow with the number of layers.
        device: 'cpu' (default) or a CUDA device (FlatEP built with CUDA); parameters, Buffer and pools live there
            and x must be on it.
        activation (str): the experts' FFN (module docstring): 'swiglu' (default; w1 [epn, H, 2F] = gate and up
            fused, columns [0, F) gate, [F, 2F) up; the pools' projections [(H, 2F), (F, H)]) or 'silu' (w1
            [epn, H, F]; projections [(H, F), (F, H)]).
        fp8 (bool): dispatch the token rows as FP8 (e4m3 with one fp32 scale per 128 channels; H must be a multiple
            of 128), dequantised to bf16 on the receiving rank before the expert GEMMs; backward in bf16 (module
            docstring; _FP8DispatchExpertsFunction). Read at every forward: ``moe.fp8`` may be switched between
            steps (the weights and the Buffer are the same).
        shared_ffn (int or None): F_s of a shared expert (module docstring): a dense FFN of the layer's activation on
            every token, added to the routed output; parameters shared_w1 [H, 2F_s] (swiglu) or [H, F_s], shared_w2
            [F_s, H], fp32, replicated like the router. None (default): no shared expert.
        overlap (bool): run communication on the Buffer's comm_stream, overlapped with independent compute (the
            shared expert during plan + dispatch; in forward_microbatches also the next micro-batch's dispatch during
            this one's expert GEMMs). False: every op on the current stream, one after the other (the serial
            reference; the same bits). Read at every forward. Only the bf16 path overlaps: with fp8=True, under
            torch.compile, or without a shared expert, forward is the serial path (the CPU backend has no streams:
            there both are the same synchronous ops, in the order of the schedule).

    forward(x [s, H] float tensor, topk_idx=None [s, K] int) -> [s, H] in x's dtype. topk_idx overrides the router's
    choice (the weights are still the router's probabilities of those experts, renormalised). After a call,
    ``last_plan`` holds the step's Plan (``last_plan.stats['loads']``: rows per rank; None after a
    torch.compile'd call).
    forward_microbatches(x_list, topk_idx=None) -> list of outputs: the micro-batches pipelined (see there).
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
        align=DEFAULT_ALIGN,
        capacity_factor=1.0,
        planner="balanced",
        num_slots=None,
        seed=0,
        pools=None,
        device=None,
        activation="swiglu",
        fp8=False,
        shared_ffn=None,
        overlap=True,
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
        self.activation = check_activation("MoE", activation)
        self.fp8 = fp8  # checked by the setter
        self.group, self.align, self.capacity_factor, self.planner = group, align, capacity_factor, planner
        self.device = resolve_device(device)
        self.experts_per_rank = num_experts // self.num_ranks
        self.expert_offset = self.rank * self.experts_per_rank
        self.router = torch.nn.Linear(hidden, num_experts, bias=False, device=self.device)
        with torch.no_grad():
            self.router.weight.copy_(init_router_weight(hidden, num_experts, seed))
        shapes = expert_projections(hidden, ffn, self.activation)
        num_slots = check_num_slots("MoE", num_slots, self.experts_per_rank)
        if pools is None:
            pools = shared_pools(group, self.experts_per_rank, shapes, self.device, num_slots=num_slots)
        self.pools = pools
        if num_slots is not None and pools.num_slots != num_slots:
            raise ValueError(f"MoE: num_slots={num_slots} but the pools have num_slots={pools.num_slots}")
        self.num_slots, self.serving = pools.num_slots, pools.serving
        if self.pools.projections != shapes or self.pools.experts_per_rank != self.experts_per_rank:
            raise ValueError(
                f"MoE: pools must have epn={self.experts_per_rank} and projections {shapes} (activation="
                f"{self.activation!r}), got epn={self.pools.experts_per_rank} and {self.pools.projections}"
            )
        if self.pools.device != self.device:
            raise ValueError(f"MoE: pools are on {self.pools.device}, the layer on {self.device}")
        self.expert_layer = layer = self.pools.register_layer()
        own = range(self.expert_offset, self.expert_offset + self.experts_per_rank)
        w1, w2 = init_expert_weights(hidden, ffn, own, seed, self.activation)
        with torch.no_grad():  # once, at construction: from here on the parameters are the library's memory
            layer.own_weights(0).copy_(w1)
            layer.own_weights(1).copy_(w2)
        self.w1 = torch.nn.Parameter(layer.own_weights(0), requires_grad=not self.serving)
        self.w2 = torch.nn.Parameter(layer.own_weights(1), requires_grad=not self.serving)
        for p, param in enumerate((self.w1, self.w2)):
            param.main_grad = layer.own_grads(p)  # fp32, the own part of the pools' gradient view
            param._flatep_owner = layer  # the memory lives while the parameter does
        if shared_ffn is not None:
            check_int("MoE", "shared_ffn", shared_ffn, "None or in [1, 2147483647]", low=1)
        if not isinstance(overlap, bool):
            raise ValueError(f"MoE: overlap must be a bool, got {overlap!r}")
        self.shared_ffn, self.overlap = shared_ffn, overlap
        self.shared_w1 = self.shared_w2 = None
        if shared_ffn is not None:  # replicated like the router: every rank holds the same fp32 masters
            sw1, sw2 = init_shared_weights(hidden, shared_ffn, seed, self.activation)
            self.shared_w1 = torch.nn.Parameter(sw1.to(self.device))
            self.shared_w2 = torch.nn.Parameter(sw2.to(self.device))
        self.buffer = None
        self.num_tokens = num_tokens
        self.last_plan = None
        self.last_plans = []
        self._static = LayerPlacement()  # planner='static': the placement, the layer's Buffers, the slots' move
        self.last_placement_bytes = 0  # bytes the last forward moved into this rank's slots (planner='static')
        if num_tokens is not None:
            self._make_buffer(num_tokens)

    @property
    def fp8(self):
        """Whether forward dispatches FP8 rows (see the class docstring)."""
        return self._fp8

    @fp8.setter
    def fp8(self, value):
        if not isinstance(value, bool):
            raise ValueError(f"MoE: fp8 must be a bool, got {value!r}")
        if value and self.hidden % _fp8.BLOCK != 0:
            raise ValueError(
                f"MoE: fp8=True needs hidden (H) to be a multiple of {_fp8.BLOCK} (one scale per {_fp8.BLOCK} "
                f"channels), got H={self.hidden}"
            )
        self._fp8 = value

    def _make_buffer(self, num_tokens):
        # One Buffer per shape and process, shared by every layer of that shape (like the pools); a static placement
        # is the layer's own, and so are its Buffers (with the placement set last).
        serving = dict(pools=self.pools) if self.serving else {}  # the Buffer takes B and Q from the pools
        args = (self.group, num_tokens, self.hidden, self.num_experts, self.topk, self.align, self.capacity_factor)
        if self.planner == "static":
            buffer = self._static.buffers.get(num_tokens)
            if buffer is None:
                buffer = Buffer(*args, planner="static", device=self.device, **serving)
                self._static.buffers[num_tokens] = buffer
            held = buffer.placement
            if self._static.slots is not None and (held is None or not torch.equal(held, self._static.slots)):
                buffer.set_placement(self._static.slots)  # collective, like the Buffer's construction
            self.buffer = buffer
        else:
            self.buffer = shared_buffer(*args, planner=self.planner, device=self.device, **serving)
        self.num_tokens = num_tokens

    def set_placement(self, slots):
        """planner='static': the layer's placement (collective): [R, B] expert ids (a list of lists or an int tensor;
        B = num_slots, epn in training), row d the experts rank d's slots hold, -1 empty (flatep.Buffer.set_placement
        says what is valid; flatep.eplb.place computes one from a window of loads). The next forward moves the placed
        replicas' weights into the slots, once: later forwards copy no weight while the pools' slot pool holds them
        (another layer's forward on the same pools, load_state_dict or load_dense make the next forward move them
        again; so does calling set_placement again, e.g. after writing the experts' weights otherwise). A forward that
        autograd records (training) prefetches every step, since the weights change with every optimizer step.
        Bad placements raise ValueError on every rank and leave the layer's placement as it was. The layer needs its
        Buffer first: num_tokens= at construction, or use_planner('static', num_tokens)."""
        if self.planner != "static":
            raise ValueError(f"MoE.set_placement: the layer plans with planner={self.planner!r}; a placement is for "
                             "planner='static' (MoE(..., planner='static') or use_planner('static', num_tokens))")
        if self.buffer is None:
            raise ValueError("MoE.set_placement: the layer has no Buffer yet (S unknown): pass num_tokens= at "
                             "construction or call use_planner('static', num_tokens) first")
        self.buffer.set_placement(slots)  # collective; raises (every rank) before anything changes
        self._static.slots = self.buffer.placement
        self._static.weights_version += 1  # the next forward moves the weights

    @property
    def placement(self):
        """planner='static': the layer's placement ([R, B] int32 tensor) set last; None before set_placement."""
        return self._static.slots

    def use_planner(self, planner, num_tokens=None):
        """Switches the layer's Buffer (collective the first time a combination is used): later forwards plan with
        `planner` ('balanced', 'greedy', 'owner' or 'static') for at most `num_tokens` tokens per rank (None: the
        current S), over the same pools and weights. The Buffers are the process's shared ones
        (flatep.buffer.shared_buffer), so switching back and forth builds nothing new, e.g. prefill with
        use_planner('balanced', S_prefill) and decode with use_planner('owner', S_decode) (the owner planner's receive
        rows are R*S*K: keep its S small). 'static' uses the layer's own Buffers, each given the placement set last
        (set_placement; collective when it changes). Returns the Buffer."""
        num_tokens = self.num_tokens if num_tokens is None else num_tokens
        if num_tokens is None:
            raise ValueError("MoE.use_planner: num_tokens is needed before the first forward")
        previous = self.planner
        self.planner = planner
        try:
            self._make_buffer(num_tokens)
        except Exception:
            self.planner = previous
            raise
        return self.buffer

    def replicated_parameters(self):
        """Parameters every rank holds a full copy of (the router, the shared expert's): all-reduce their gradients
        across the group."""
        shared = [self.shared_w1, self.shared_w2] if self.shared_ffn is not None else []
        return list(self.router.parameters()) + shared

    def expert_parameters(self):
        """This rank's expert weights [w1, w2]: bf16 over the library's memory, fp32 gradients in ``main_grad``."""
        return [self.w1, self.w2]

    def zero_main_grad(self):
        """Zeroes the experts' main_grad (backward accumulates into it; serving layers have none)."""
        for param in self.expert_parameters():
            if param.main_grad is not None:
                param.main_grad.zero_()

    def _check_zero_copy(self):
        layer = self.expert_layer
        compiling = _ops.compiling()  # the compiler traces no data_ptr: dtype and device only
        for p, (name, param) in enumerate((("w1", self.w1), ("w2", self.w2))):
            own = layer.own_weights(p)
            moved = not compiling and param.data_ptr() != own.data_ptr()
            if param.dtype != own.dtype or param.device != own.device or moved:
                raise ValueError(
                    f"MoE: {name} is no longer the library's expert memory (it is {str(param.dtype)[6:]} on "
                    f"{param.device}; was the module converted with .float() / .to()?): expert parameters must stay "
                    f"bf16 on {self.device}; build the layer again"
                )

    @torch.no_grad()
    def load_dense(self, dense):
        """Copies the weights of a flatep.testing.DenseMoE (router and this rank's experts); its activation must be
        this layer's."""
        if getattr(dense, "activation", "silu") != self.activation:
            raise ValueError(f"MoE.load_dense: the dense reference's activation is {dense.activation!r}, this "
                             f"layer's {self.activation!r}")
        if getattr(dense, "shared_ffn", None) != self.shared_ffn:
            raise ValueError(f"MoE.load_dense: the dense reference's shared_ffn is {getattr(dense, 'shared_ffn', None)!r},"
                             f" this layer's {self.shared_ffn!r}")
        lo, hi = self.expert_offset, self.expert_offset + self.experts_per_rank
        self.router.weight.copy_(dense.router_weight)
        if self.shared_ffn is not None:
            self.shared_w1.copy_(dense.shared_w1)
            self.shared_w2.copy_(dense.shared_w2)
        self.w1.copy_(dense.w1[lo:hi])
        self.w2.copy_(dense.w2[lo:hi])
        self._static.weights_version += 1  # planner='static': the slots hold the old weights

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)  # copies into the library's memory in place
        self._static.weights_version += 1  # planner='static': the slots hold the old weights

    def _check_input(self, x, what="x"):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"MoE: {what} must be a [s, H={self.hidden}] tensor, got {shape}")
        if x.device != self.device:
            raise ValueError(f"MoE: {what} is on {x.device}, but the layer is on {self.device}")

    def _check_placement(self):
        if self.planner == "static" and self.buffer.placement_epoch == 0:
            raise ValueError("MoE: planner='static' has no placement yet: call moe.set_placement(slots) (collective) "
                             "before the first forward")

    def _overlapped(self):
        """Whether this forward runs the overlapped schedule (bf16 dispatch, eager, overlap=True)."""
        return self.overlap and not self.fp8 and not _ops.compiling()

    def _shared(self, xb):
        """The shared expert's output on the bf16 rows xb [s, H] -> [s, H] bf16, on the current stream."""
        return shared_expert_ffn(xb, self.shared_w1, self.shared_w2, self.activation)

    def _check_compilable(self):
        """Under torch.compile: what the compiled path does not do raises a ValueError saying so."""
        if not _ops.compiling():
            return
        if self.fp8:
            raise ValueError("MoE: fp8=True is not supported under torch.compile (FP8 dispatch is eager only); set "
                             "moe.fp8 = False for the compiled model or run it eagerly")
        if self.buffer is None:
            raise ValueError("MoE: under torch.compile the layer's Buffer must exist before tracing: pass num_tokens= "
                             "at construction or run one eager forward first")

    def _experts(self, plan, recv_x):
        # Serving pools, and the training layout's inference (autograd records nothing, eager): the FFN without an
        # autograd graph, whose activation and zeroing stop at the last group end (flatep.ffn.grouped_ffn).
        if self.serving or (not torch.is_grad_enabled() and not _ops.compiling()):
            move = True
            if self.planner == "static" and not _ops.compiling():  # the placed weights move once (set_placement)
                move = self._static.needs_move(self.pools, self.expert_layer, plan)
            y = serving_experts(self.pools, self.expert_layer, plan, recv_x, self.activation, move)
            if self.planner == "static" and not _ops.compiling():
                self._static.moved(self.pools, self.expert_layer, plan)
                self.last_placement_bytes = self.pools.placement_bytes(plan) if move else 0
            return y
        if self.planner == "static" and not _ops.compiling():  # training: prefetched every step (the weights change)
            self.last_placement_bytes = self.pools.placement_bytes(plan)
        if _ops.compiling():
            return _experts_compiled(self, plan, recv_x)
        return _ExpertsFunction.apply(self, plan, recv_x, self.w1, self.w2)

    def _bind_context(self):
        """The layer's GPU context current on this thread when its device is torch's current one: a thread that
        never called into CUDA has none, and cuBLAS's first call there (the router's matmul) warns and binds it
        itself, or fails inside a graph capture. Nothing under torch.compile (tracing calls nothing)."""
        if self.device.type == "cuda" and not _ops.compiling() and torch.cuda.current_device() == self.device.index:
            _C.make_device_current(self.device.index)

    def forward(self, x, topk_idx=None):
        self._check_input(x)
        check_inference(self, (x,))
        self._check_zero_copy()
        self._check_compilable()
        self._bind_context()
        if self.buffer is None:
            self._make_buffer(int(x.shape[0]))
        self._check_placement()
        weights, idx = route(x, self.router.weight, self.topk, topk_idx)
        xb = x.to(_BF16)
        shared = None
        # Inference (eager, autograd records nothing; serving layers always): dispatch and combine skip their entry
        # barriers, since this call's plan op already met every rank after the last step's ops (Buffer.dispatch).
        ordered = not _ops.compiling() and (self.serving or not torch.is_grad_enabled())
        if self.shared_ffn is not None and self._overlapped():
            # plan + dispatch on comm_stream (after the routing, in the current stream's order), the shared expert on
            # the current stream meanwhile; then the experts wait for the rows. The combine has no independent work
            # left to hide behind in one micro-batch (forward_microbatches gives it the next one's).
            buffer, comm = self.buffer, self.buffer.comm_stream
            plan, planned = buffer.plan(idx, stream=comm, async_finish=True)
            recv_x, recv_w, _, arrived = buffer.dispatch(plan, xb, weights, stream=comm, previous_event=planned,
                                                         async_finish=True, plan_ordered=ordered)
            shared = self._shared(xb)
            arrived.current_stream_wait()
            y = self._experts(plan, recv_x)
            out, done = buffer.combine(plan, y, recv_w, stream=comm, async_finish=True, plan_ordered=ordered)
            done.current_stream_wait()
        else:
            plan = self.buffer.plan(idx)
            if self.shared_ffn is not None:
                shared = self._shared(xb)
            if self.fp8 and self.serving:  # inference: the FP8 rows dequantised, then the experts on the view
                (recv_q, recv_s), recv_w, _ = self.buffer.dispatch(plan, xb, weights, fp8=True, plan_ordered=ordered)
                y = self._experts(plan, dequantize_rows(recv_q, recv_s))
            elif self.fp8:
                self.buffer._check_plan("dispatch", plan)
                y, recv_w = _FP8DispatchExpertsFunction.apply(self, plan, xb, weights, self.w1, self.w2)
            else:
                recv_x, recv_w, _ = self.buffer.dispatch(plan, xb, weights, plan_ordered=ordered)
                y = self._experts(plan, recv_x)
            out = self.buffer.combine(plan, y, recv_w, plan_ordered=ordered)
        if shared is not None:
            out = add_shared(out, shared)
        if _ops.compiling():  # a Plan made while tracing holds the graph's tensors: none is kept on the module
            plan = None
        self.last_plan = plan
        self.last_plans = [plan] if plan is not None else []
        return out.to(x.dtype)

    def forward_microbatches(self, xs, topk_idx=None):
        """The layer on several micro-batches, pipelined: xs a list of [s_i, H] tensors (s_i <= S), topk_idx None or a
        list of [s_i, K] (or None) -> the list of outputs, the bits of ``[self(x_i, topk_idx_i) for i]`` (forward and
        backward; with two micro-batches also every gradient, the replicated parameters' included: the two
        contributions are added in either order to the same bits; with more, those may differ by fp32 rounding).
        ``last_plans`` holds the micro-batches' plans (one each), ``last_plan`` the last one.

        Schedule (overlap=True, bf16; otherwise the plain loop). Current stream C (compute), the Buffer's comm_stream M:

            C: route all, record `ready` | shared_0 | wait d_0, prefetch_0 + GEMM_0 | shared_1 | wait d_1, GEMM_1 ...
            M: plan_0 d_0 (after ready) | plan_1 d_1 (after ready) | c_0 (after GEMM_0) | plan_2 d_2 | c_1 ...

        so the dispatch of micro-batch i+1 runs during the expert GEMMs of i, and the combine of i during the shared
        expert and GEMMs of i+1. Why it is correct:

        * One Buffer, ops never in flight together: the symmetric receive region and the cross-rank flags are
          rewritten by every op of the Buffer (plan's all-gather, dispatch, combine; design §3/§5), so two of its ops
          must not overlap. Every Buffer op of this schedule is enqueued on the one stream M, in one program order
          (the same on every rank: collectives meet in order), so each starts after the previous one finished: d_{i+1}
          after c_{i-1}, c_i after d_{i+1}. What crosses streams is per micro-batch and owned: each plan owns its
          arrays (plan_{i+1} does not invalidate plan_i), recv_x / recv_w / the combine output are tensors of their
          own (not views of the symmetric region), record_stream'ed by the ops, and C waits on each op's event
          before reading its outputs.
        * One slot pool (ExpertPools, shared by every layer), rewritten by every prefetch: prefetch_{i+1} must not
          run while GEMM_i reads plan_i's replicas. Both are on C, in that order; a peer's prefetch_{i+1} pushes into
          this rank's slots only after this rank entered prefetch_{i+1} (the op's entry barrier), i.e. after its
          GEMM_i. The pools' ops (on C) and the Buffer's (on M) are different objects with their own memory and
          flags, so they may run at the same time.
        * Backward is not pipelined: autograd runs the nodes on the streams of their forward (combine's and
          dispatch's backward on M, complete in C's order), in the same order on every rank; the experts' nodes run
          in the reverse of their forward order, as in the serial loop, so main_grad accumulates in the same order.

        On the CPU backend there are no streams (comm_stream None, events None): the same calls run synchronously
        in the schedule's order and give the serial loop's bits (tests/python/test_moe_overlap.py)."""
        if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)) or not xs:
            raise ValueError(f"MoE.forward_microbatches: xs must be a non-empty list of [s, H] tensors, got "
                             f"{type(xs).__name__}")
        n = len(xs)
        idxs = [None] * n if topk_idx is None else list(topk_idx)
        if len(idxs) != n:
            raise ValueError(f"MoE.forward_microbatches: topk_idx has {len(idxs)} items for {n} micro-batches")
        for i, x in enumerate(xs):
            self._check_input(x, f"xs[{i}]")
        check_inference(self, xs)
        self._check_zero_copy()
        self._check_compilable()
        self._bind_context()
        if self.buffer is None:
            self._make_buffer(max(int(x.shape[0]) for x in xs))
        self._check_placement()
        if n == 1 or not self._overlapped():
            outs, plans = [], []
            for x, idx in zip(xs, idxs):
                outs.append(self.forward(x, idx))
                plans.append(self.last_plan)
            self.last_plans = plans if not _ops.compiling() else []
            return outs
        buffer, comm = self.buffer, self.buffer.comm_stream
        routed = [route(x, self.router.weight, self.topk, idx) for x, idx in zip(xs, idxs)]
        xbs = [x.to(_BF16) for x in xs]
        ready = _stream_event(self.device)  # every micro-batch's rows and routing are ready on C

        def send(i):  # plan_i and d_i on M, ordered after `ready` (not after C's later work)
            plan, planned = buffer.plan(routed[i][1], stream=comm, previous_event=ready, async_finish=True)
            recv_x, recv_w, _, arrived = buffer.dispatch(plan, xbs[i], routed[i][0], stream=comm,
                                                         previous_event=planned, async_finish=True)
            return plan, recv_x, recv_w, arrived

        has_shared = self.shared_ffn is not None
        shared = [None] * n
        pending = send(0)
        if has_shared:
            shared[0] = self._shared(xbs[0])
        combined, plans = [], []
        for i in range(n):
            plan, recv_x, recv_w, arrived = pending
            if i + 1 < n:
                pending = send(i + 1)  # M: after d_i and c_{i-1}; runs during GEMM_i (and shared_{i+1})
            arrived.current_stream_wait()
            y = self._experts(plan, recv_x)  # C: prefetch_i after GEMM_{i-1}
            combined.append(buffer.combine(plan, y, recv_w, stream=comm, async_finish=True))  # M: after GEMM_i
            if has_shared and i + 1 < n:
                shared[i + 1] = self._shared(xbs[i + 1])  # C: during d_{i+1} and c_i
            plans.append(plan)
        outs = []
        for i, (out, done) in enumerate(combined):
            done.current_stream_wait()
            if has_shared:
                out = add_shared(out, shared[i])
            outs.append(out.to(xs[i].dtype))
        self.last_plan, self.last_plans = plans[-1], plans
        return outs

    def extra_repr(self):
        return (
            f"hidden={self.hidden}, ffn={self.ffn}, num_experts={self.num_experts}, topk={self.topk}, "
            f"ranks={self.num_ranks}, experts_per_rank={self.experts_per_rank}, activation={self.activation!r}, "
            f"fp8={self.fp8}, shared_ffn={self.shared_ffn}, overlap={self.overlap}, planner={self.planner!r}, "
            f"num_slots={self.num_slots}"
        )
