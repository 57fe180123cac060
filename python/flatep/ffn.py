"""The expert FFN's arithmetic, shared by flatep.nn (the MoE layer's eager path) and flatep.ops (its torch.compile
path): per expert group of receive rows,

    activation="swiglu": h = x @ W1, W1 [H, 2F] = [gate | up]; a = silu(h[:, :F]) * h[:, F:]; y = a @ W2, W2 [F, H]
    activation="silu":   h = x @ W1, W1 [H, F];               a = silu(h);                    y = a @ W2

with h, a and y rounded to bf16 (fp32 accumulation), as a bf16 grouped GEMM gives them (see expert_ffn). Everything
here is importable from flatep.nn too. On a GPU, activate_rows and zero_rows_from_end are the same activation and
zeroing as CUDA kernels bounded by the last group end (read on the device); grouped_ffn uses them where autograd
records nothing.
"""

import torch
import torch.nn.functional as F

from . import _C
from ._tensors import shape_text
from .launch import device_guard, stream_handle

_BF16 = torch.bfloat16

#: The expert activations nn.MoE and flatep.testing.DenseMoE accept (the first is their default).
ACTIVATIONS = ("swiglu", "silu")


def check_activation(op, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    return activation


def w1_columns(ffn, activation):
    """Columns of one expert's W1: 2F for swiglu (gate and up fused), F for silu."""
    return 2 * ffn if check_activation("w1_columns", activation) == "swiglu" else ffn


def expert_projections(hidden, ffn, activation):
    """The ExpertPools projections of an expert FFN: [(H, 2F), (F, H)] for swiglu, [(H, F), (F, H)] for silu."""
    return [(hidden, w1_columns(ffn, activation)), (ffn, hidden)]


def _activation_of(w1, w2, activation):
    """The activation the weights' shapes say (W1's columns 2F: swiglu, F: silu, F = W2's rows), checked against the
    one given (None: inferred)."""
    ffn, cols = w2.shape[-2], w1.shape[-1]
    inferred = "swiglu" if cols == 2 * ffn else "silu" if cols == ffn else None
    if inferred is None or (activation is not None and check_activation("expert_ffn", activation) != inferred):
        want = f"{2 * ffn} (swiglu) or {ffn} (silu)" if activation is None else w1_columns(ffn, activation)
        raise ValueError(f"expert_ffn: w1 has {cols} columns, but w2 has F={ffn} rows: w1 needs {want} columns")
    return inferred


def activate(h, activation):
    """The expert activation on h [n, 2F] (swiglu: columns [0, F) gate, [F, 2F) up) or [n, F] (silu), bf16 values:
    silu(gate) * up or silu(h), computed in fp32 and rounded to bf16 -> [n, F] bf16."""
    hf = h.float()
    if activation == "silu":
        return F.silu(hf).to(_BF16)
    ffn = h.shape[-1] // 2
    return (F.silu(hf[..., :ffn]) * hf[..., ffn:]).to(_BF16)


def expert_ffn(x, w1, w2, activation=None):
    """One expert on its rows: x [n, H] (bf16 values), w1 [H, 2F] (swiglu: [gate | up]) or [H, F] (silu), w2 [F, H]
    (bf16 values, any float dtype) -> [n, H] bf16. activation: 'swiglu', 'silu' or None (from the shapes). Matmuls
    accumulate in fp32; h, the activation (computed in fp32) and the output are rounded to bf16, as a bf16 grouped
    GEMM does. flatep.testing.DenseMoE writes the same rounding points out on its own (an oracle shares no code with
    what it judges)."""
    activation = _activation_of(w1, w2, activation)
    h = (x.float() @ w1.float()).to(_BF16)
    a = activate(h, activation)
    return (a.float() @ w2.float()).to(_BF16)


def _has_grouped_mm(x):
    return x.is_cuda and hasattr(torch, "_grouped_mm")


#: Groups one torch._grouped_mm call takes: it checks group_count < 1024 ("Can't process more than 1024 groups"). A
#: serving weights view has R*Q + B groups, above it when experts are small (Q follows the mapping granularity) or
#: when E + B > 1023.
MAX_GROUPS = 1023


def grouped_mm(x, w, offs, mm=None, max_groups=MAX_GROUPS):
    """torch._grouped_mm(x, w, offs=offs) for any number of groups w.shape[0]: above max_groups, one call per run of
    max_groups groups, each on its rows moved to the front (a gather at the run's first row, read on the device) and
    its output moved back (a gather and a where): no host sync, static shapes, so graph capture still works. Rows past
    the last group end are left unwritten by torch._grouped_mm; here they are zero when chunked. mm: the grouped GEMM
    (tests pass a reference of the same contract)."""
    mm = torch._grouped_mm if mm is None else mm
    num_groups = w.shape[0]
    if num_groups <= max_groups:
        return mm(x, w, offs=offs)
    n = x.shape[0]
    rows = torch.arange(n, device=x.device)
    out = torch.zeros(n, w.shape[-1], dtype=x.dtype, device=x.device)
    for first in range(0, num_groups, max_groups):
        last = min(num_groups, first + max_groups)
        start = offs[first - 1].long() if first > 0 else torch.zeros((), dtype=torch.long, device=x.device)
        ends = offs[first:last] - start.to(offs.dtype)
        y = mm(x.index_select(0, (rows + start).clamp_(max=max(n - 1, 0))), w[first:last], offs=ends)
        back = y.index_select(0, (rows - start).clamp_(min=0))
        mine = (rows >= start) & (rows < start + ends[-1].long())
        out = torch.where(mine.unsqueeze(1), back, out)
    return out


def _past_end(num_rows, offs):
    """[num_rows, 1] bool on offs' device: rows at or past the last group end offs[-1] (read on the device)."""
    return torch.arange(num_rows, device=offs.device).unsqueeze(1) >= offs[-1]


def _zero_past_end(y, offs):
    """y's rows past the last group end (which torch._grouped_mm leaves unwritten) set to zero in place: one pass
    over y (a torch.where against zeros_like(y) reads and writes y and a zero tensor, and writes the zeros first).
    Under autograd the same gradient as the where's: grad_y with those rows zero."""
    return y.masked_fill_(_past_end(y.shape[0], offs), 0)


def _tensor_arg(op, name, value):
    """Raises the one-line ValueError naming `op` and `name` unless `value` is a torch.Tensor (before any other check
    reads its attributes)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_rows_args(op, rows, rows_name, cu_seqlens, *others):
    """The checks activate_rows and zero_rows_from_end share, in an order that touches no device: `rows` (and each
    (name, tensor) of `others`, already shape-checked by the caller) bf16, 2-D and contiguous; cu_seqlens a 1-D int32
    tensor with at least one group end; then every tensor on one CUDA device (rows'). One-line ValueErrors naming the
    argument and the value."""
    for name, t in ((rows_name, rows),) + others:
        if t.dtype != _BF16:
            raise ValueError(f"{op}: {name} must be bfloat16, got {str(t.dtype).replace('torch.', '')}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {shape_text(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (row-major), got strides {tuple(t.stride())} for "
                             f"shape {shape_text(t.shape)}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{op}: cu_seqlens must be int32, got {str(cu_seqlens.dtype).replace('torch.', '')}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{op}: cu_seqlens must be 1-D with at least one group end, got shape "
                         f"{shape_text(cu_seqlens.shape)}")
    device = rows.device
    if device.type != "cuda":
        raise ValueError(f"{op}: {rows_name} must be on a CUDA device, got {device}")
    for name, t in others + (("cu_seqlens", cu_seqlens),):
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, but {rows_name} is on {device}; pass all on one device")
    if not _C.has_cuda:
        raise RuntimeError(f"{op}: flatep._C was built without CUDA (flatep._C.has_cuda is False)")
    return device


def _end_address(cu_seqlens):
    """The device address of cu_seqlens' last element (the last group end), which the kernels read."""
    return cu_seqlens.data_ptr() + (cu_seqlens.shape[0] - 1) * cu_seqlens.stride(0) * cu_seqlens.element_size()


def activate_rows(h, cu_seqlens, activation, out=None, zero_past_end=True):
    """activate(h, activation) on the rows below the last group end cu_seqlens[-1], read on the device, and zero on
    the others, in one CUDA kernel (flatep::activate_rows): h [n, 2F] (swiglu) or [n, F] (silu) bf16, contiguous;
    cu_seqlens [G] int32 on h's device (only its last element is read); out: a contiguous [n, F] bf16 tensor to write
    (None: a new one) -> out. Rows below the end are bitwise activate's (silu(x) = x / (1 + exp(-x)) in fp32, as
    torch's CUDA silu, times up in fp32, one rounding to bf16); rows past it are written as zero without reading h,
    or, with zero_past_end=False, neither read nor written (unspecified: for a grouped GEMM whose groups end there,
    which reads none of them; the kernel's work then follows the real rows alone, not the receive capacity).
    Enqueued on the current stream, no host sync: graph-capturable, and a replay reads cu_seqlens' value then. Bad
    arguments raise a one-line ValueError before anything touches the device."""
    op = "activate_rows"
    if not isinstance(zero_past_end, bool):
        raise ValueError(f"{op}: zero_past_end must be a bool, got {zero_past_end!r}")
    activation = check_activation(op, activation)
    h = _tensor_arg(op, "h", h)
    cu_seqlens = _tensor_arg(op, "cu_seqlens", cu_seqlens)
    cols = h.shape[-1] if h.dim() == 2 else None
    ffn = None if cols is None else (cols // 2 if activation == "swiglu" else cols)
    if cols is not None and (ffn < 1 or (activation == "swiglu" and cols % 2)):
        want = ("an even number >= 2 of columns (2F: gate, then up)" if activation == "swiglu"
                else "a column or more (F)")
        raise ValueError(f"{op}: h must have {want} for {activation}, got shape {shape_text(h.shape)}")
    others = ()
    if out is not None:
        out = _tensor_arg(op, "out", out)
        if h.dim() == 2 and tuple(out.shape) != (h.shape[0], ffn):
            raise ValueError(f"{op}: out must have shape {shape_text((h.shape[0], ffn))} ([n, F] for h of shape "
                             f"{shape_text(h.shape)}), got {shape_text(out.shape)}")
        others = (("out", out),)
    device = _check_rows_args(op, h, "h", cu_seqlens, *others)
    if out is None:
        out = torch.empty(h.shape[0], ffn, dtype=_BF16, device=device)
    with device_guard(device):
        _C.activate_rows(h.data_ptr(), out.data_ptr(), h.shape[0], ffn, activation == "swiglu",
                         _end_address(cu_seqlens), zero_past_end=zero_past_end, stream=stream_handle(device))
    return out


def zero_rows_from_end(y, cu_seqlens):
    """y's rows at and past the last group end cu_seqlens[-1] (read on the device) set to zero in place, the rows
    below it untouched, in one CUDA kernel (flatep::zero_rows_from_end): y [n, H] bf16, contiguous; cu_seqlens [G]
    int32 on y's device -> y. The work is the zero stores only (_zero_past_end's masked_fill reads and writes every
    row). Current stream, no host sync, graph-capturable; bad arguments raise a one-line ValueError first."""
    op = "zero_rows_from_end"
    y = _tensor_arg(op, "y", y)
    cu_seqlens = _tensor_arg(op, "cu_seqlens", cu_seqlens)
    device = _check_rows_args(op, y, "y", cu_seqlens)
    with device_guard(device):
        _C.zero_rows_from_end(y.data_ptr(), y.shape[0], y.shape[1], _end_address(cu_seqlens),
                              stream=stream_handle(device))
    return y


def _records_grad(*tensors):
    """Whether autograd would record an operation on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def grouped_ffn(x, w1, w2, cu_seqlens, activation=None, zero_past_end=True):
    """Grouped expert FFN over receive rows: x [NvS, H] bf16, w1 [G, H, 2F] (swiglu) or [G, H, F] (silu),
    w2 [G, F, H], cu_seqlens [G] int32 (inclusive group ends) -> [NvS, H] bf16; rows past the last group end are
    zero (unless zero_past_end=False, below). activation: as expert_ffn (None: from the shapes).

    On a GPU with torch._grouped_mm: two grouped GEMMs. When autograd records nothing (serving: no_grad or
    inference_mode), the activation and the zeroing of y's rows past the end are the kernels activate_rows and
    zero_rows_from_end, whose work is bounded by the end read on the device (NvS is the receive capacity: ~8x the
    real rows for the owner planner); the values are bitwise those of the torch ops autograd differentiates, which
    run otherwise. zero_past_end=False (there only) skips that zeroing and the activation's zero stores past the end
    (the second GEMM reads no row past it): y's rows past the end are then unspecified, for a caller that reads none of
    them (Buffer.combine reads only the plan's real rows), and no kernel's work follows the receive capacity, which
    with the owner planner is ~R times the real rows."""
    if not isinstance(zero_past_end, bool):
        raise ValueError(f"grouped_ffn: zero_past_end must be a bool, got {zero_past_end!r}")
    activation = _activation_of(w1, w2, activation)
    if _has_grouped_mm(x) and w1.dtype == _BF16:
        offs = cu_seqlens.to(device=x.device, dtype=torch.int32)
        h = grouped_mm(x, w1, offs)
        if _C.has_cuda and not _records_grad(x, w1, w2) and h.is_contiguous():
            y = grouped_mm(activate_rows(h, offs, activation, zero_past_end=zero_past_end), w2, offs)
            if not zero_past_end:
                return y
            return zero_rows_from_end(y, offs) if y.is_contiguous() else _zero_past_end(y, offs)
        a = activate(h, activation)
        y = grouped_mm(a, w2, offs)
        return _zero_past_end(y, offs)
    ends = [int(e) for e in cu_seqlens.tolist()]
    pieces, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            pieces.append(expert_ffn(x[start:end], w1[g], w2[g], activation))
        start = max(start, end)
    if start < x.shape[0]:
        pieces.append(torch.zeros(x.shape[0] - start, x.shape[1], dtype=_BF16, device=x.device))
    return torch.cat(pieces, dim=0)


def _groups(cu_seqlens):
    """(g, start, end) of every group with rows, from inclusive group ends cu_seqlens (read on the host), as
    grouped_ffn's loop walks them."""
    start = 0
    for g, end in enumerate(int(e) for e in cu_seqlens.tolist()):
        if end > start:
            yield g, start, end
        start = max(start, end)


def ffn_forward(x, w1, w2, cu_seqlens, activation, save):
    """grouped_ffn that also returns what ffn_backward needs: (y, h, a) with y [NvS, H] bf16 (bitwise grouped_ffn's:
    the same operations on the same layouts), h [NvS, 2F or F] the first GEMM's bf16 output and a [NvS, F] the bf16
    activation (both [0, .] when save=False). x [NvS, H] bf16; w1, w2 the bf16 compute views. The torch.compile path
    of nn.MoE (flatep.ops "experts"): saving h and a, the backward recomputes no GEMM."""
    activation = _activation_of(w1, w2, activation)
    n, cols, ffn = x.shape[0], w1.shape[-1], w2.shape[-2]
    if _has_grouped_mm(x) and w1.dtype == _BF16:
        offs = cu_seqlens.to(device=x.device, dtype=torch.int32)
        h = grouped_mm(x, w1, offs)
        a = activate(h, activation)
        y = _zero_past_end(grouped_mm(a, w2, offs), offs)
    else:  # the loop of grouped_ffn over fp32 copies of each group's weights (what the eager path's copies hold)
        y = torch.zeros(n, w2.shape[-1], dtype=_BF16, device=x.device)
        h = torch.zeros(n if save else 0, cols, dtype=_BF16, device=x.device)
        a = torch.zeros(n if save else 0, ffn, dtype=_BF16, device=x.device)
        for g, start, end in _groups(cu_seqlens):
            hg = (x[start:end].float() @ w1[g].float()).to(_BF16)
            ag = activate(hg, activation)
            y[start:end] = (ag.float() @ w2[g].float()).to(_BF16)
            if save:
                h[start:end], a[start:end] = hg, ag
    if not save:
        h = torch.empty(0, cols, dtype=_BF16, device=x.device)
        a = torch.empty(0, ffn, dtype=_BF16, device=x.device)
    return y, h, a


def _activation_backward(grad_a, h, activation):
    """Gradient at h [n, 2F or F] bf16 of activate(h) given grad_a [n, F] bf16: the operations autograd runs for
    activate (the fp32 values recomputed from h: two elementwise passes, no GEMM), rounded to bf16 as the gradient of
    h.float() is."""
    hf, gp = h.float(), grad_a.float()
    if activation == "silu":
        return torch.ops.aten.silu_backward(gp, hf).to(_BF16)
    ffn = h.shape[-1] // 2
    gate, up = hf[..., :ffn], hf[..., ffn:]
    grad_gate = torch.ops.aten.silu_backward(gp * up, gate)
    return torch.cat([grad_gate, gp * F.silu(gate)], dim=-1).to(_BF16)


def ffn_backward(grad_y, x, h, a, w1, w2, cu_seqlens, activation, want_x, want_w1, want_w2):
    """Backward of ffn_forward from its saved (x, h, a) and the compute views w1, w2 (holding the forward's values):
    (grad_x [NvS, H] bf16 or None, grad_w1, grad_w2 [2*epn, ...] or None), the values autograd gives for
    grouped_ffn (the eager path of nn.MoE): the GPU path its grouped-GEMM backward formulas (bf16 weight gradients,
    grad_x zero past the last group end), the loop fp32 GEMMs per group (fp32 weight gradients, zero for groups
    without rows)."""
    activation = _activation_of(w1, w2, activation)
    grad_x = grad_w1 = grad_w2 = None
    if _has_grouped_mm(x) and w1.dtype == _BF16:
        offs = cu_seqlens.to(device=x.device, dtype=torch.int32)
        past_end = _past_end(x.shape[0], offs)
        grad_y = grad_y.masked_fill(past_end, 0)
        if want_w2:
            grad_w2 = torch._grouped_mm(a.transpose(-2, -1), grad_y, offs=offs)
        if want_w1 or want_x:
            grad_h = _activation_backward(torch._grouped_mm(grad_y, w2.transpose(-2, -1), offs=offs), h, activation)
            if want_w1:
                grad_w1 = torch._grouped_mm(x.transpose(-2, -1), grad_h, offs=offs)
            if want_x:
                grad_x = torch._grouped_mm(grad_h, w1.transpose(-2, -1), offs=offs).masked_fill_(past_end, 0)
        return grad_x, grad_w1, grad_w2
    fp32 = dict(dtype=torch.float32, device=x.device)
    grad_w1 = torch.zeros(w1.shape, **fp32) if want_w1 else None
    grad_w2 = torch.zeros(w2.shape, **fp32) if want_w2 else None
    grad_x = torch.zeros(x.shape, dtype=_BF16, device=x.device) if want_x else None
    for g, start, end in _groups(cu_seqlens):
        grad_yg = grad_y[start:end].float()
        if want_w2:
            grad_w2[g] = a[start:end].float().t().mm(grad_yg)
        if want_w1 or want_x:
            grad_ag = grad_yg.mm(w2[g].float().t()).to(_BF16)
            grad_hg = _activation_backward(grad_ag, h[start:end], activation).float()
            if want_w1:
                grad_w1[g] = x[start:end].float().t().mm(grad_hg)
            if want_x:
                grad_x[start:end] = grad_hg.mm(w1[g].float().t()).to(_BF16)
    return grad_x, grad_w1, grad_w2


def experts_backward_step(pools, layer, plan, grad_y, x, h, a, cu_seqlens, activation, want_x, want_w1, want_w2):
    """The experts' backward on the torch.compile path (the body of flatep.ops "experts_backward"): prefetch again
    (collective; another layer may have written the shared slot pool since the forward), ffn_backward over the
    compute views, the weight gradients into main_grad (write_grads with accumulate, then reduce_grad: collective),
    as flatep.nn's eager _experts_backward does. Returns grad_x (None when not wanted)."""
    pools._prefetch_raw(plan, layer)
    grad_x, grad_w1, grad_w2 = ffn_backward(grad_y, x, h, a, layer.weights(0), layer.weights(1), cu_seqlens,
                                            activation, want_x, want_w1, want_w2)
    for p, grad in enumerate((grad_w1, grad_w2)):
        if grad is not None:
            pools._write_grads_raw(plan, layer, p, grad.contiguous(), True)
    if want_w1 or want_w2:
        pools._reduce_grad_raw(plan, layer)
    return grad_x
