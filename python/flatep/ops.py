"""FlatEP's ops as PyTorch custom ops (``torch.ops.flatep.*``), so that ``torch.compile(fullgraph=True)`` traces code
calling Buffer.plan / dispatch / combine / entry_values and ExpertPools.prefetch / write_grads / reduce_grad without a
graph break (design §3, "torch.compile").

Design. Custom ops take tensors and primitive arguments only, while FlatEP's state lives in Python objects (Buffer,
ExpertPools) and in C++ plans. So:

* Buffers and ExpertPools get a process-unique int id at construction (``_op_id``); the ops take it as an int (a
  constant of the compiled graph) and look the object up in a registry of weak references.
* A plan crosses as two tensors: ``handle``, a CPU int64 [1] tensor holding the plan's registry id, and ``storage``,
  the int32 tensor the plan's device arrays live in (``plan_words`` words; on the CPU backend a [3*epn] copy of
  slot_expert and cu_seqlens). The C++ plan is held by the registry for exactly as long as the handle's memory lives
  (the handle is a tensor over a numpy array whose finaliser drops the entry), and every op takes both tensors as
  inputs, so autograd saves them for backward and the compiler keeps the device storage alive for as long as any op
  that reads the plan through the C++ side may run. The id is read on the host from a CPU tensor: no device sync.
* The Buffer ops are functional (fresh outputs; fake implementations give their shapes and dtypes from the Buffer's
  sizes); dispatch and combine have registered autograd, exactly autograd.py's backward (combine of the row
  gradients and entry_values of the weight gradients; dispatch of the output gradient and combine_grad).
* The pools ops write memory the C++ runtime owns. They are declared to mutate the compute views they write
  (prefetch: every projection's weights view; write_grads: the projection's grads view; reduce_grad: every grads
  view), which is true, keeps them from being dead-code eliminated and orders the grouped GEMMs that read the views
  after them. Should the compiler hand an op a copy of a view (functionalisation without re-inplacing), the op copies
  the result into it, so the copy holds what the view holds.
* nn.MoE's experts: ``experts`` (functional: the grouped expert FFN over the compute views, y with h and a, the bf16
  activations its registered autograd saves) and ``experts_backward`` (mutating the gradient views: prefetch again,
  the FFN's backward by hand, write_grads with accumulate into main_grad, reduce_grad; returns the rows' gradient).
  The arithmetic lives in flatep.ffn (ffn_forward, ffn_backward, experts_backward_step); design §3 says why by hand.
* stream: 0 = the current stream, 1 = the Buffer's / pools' own ``comm_stream`` (ordered after the current stream,
  which then waits for it: the call is complete in the current stream's order). num_sms: -1 = the object's setting.
  previous_event / async_finish (an EventHandle is a Python object) are eager-only.

Eager calls keep today's direct path (no dispatcher overhead); the methods route through these ops only while
torch.compile traces (torch.compiler.is_compiling()). Where torch.library.custom_op is missing (torch < 2.4, e.g.
Debian's torch 1.13), nothing is registered, AVAILABLE is False and every call takes the direct path.
"""

import itertools
import weakref
from typing import List, Optional, Tuple

import numpy
import torch

from . import ffn as _ffn

AVAILABLE = all(hasattr(torch.library, name) for name in ("custom_op", "register_fake", "register_autograd"))

_ids = itertools.count(1)
_objects = {}  # id -> weakref of a Buffer or ExpertPools
_plans = {}  # plan id -> (C++ plan, num_tokens)


def _is_compiling_fn():
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling
    dynamo = getattr(torch, "_dynamo", None)
    if dynamo is not None and hasattr(dynamo, "is_compiling"):
        return dynamo.is_compiling
    return lambda: False


_is_compiling = _is_compiling_fn()


def compiling():
    """True while torch.compile traces (then the methods call torch.ops.flatep.*); always False without custom ops."""
    return AVAILABLE and _is_compiling()


def register_object(obj):
    """A new op id for a Buffer or ExpertPools (held weakly)."""
    key = next(_ids)
    _objects[key] = weakref.ref(obj)
    return key


def _object(key, kind):
    ref = _objects.get(key)
    obj = ref() if ref is not None else None
    if obj is None:
        raise RuntimeError(f"flatep ops: {kind} {key} no longer exists")
    return obj


class _Handle(numpy.ndarray):
    """The numpy array a plan handle tensor lives in (a subclass, so that it takes a finaliser)."""


def plan_handle(cplan):
    """A CPU int64 [1] tensor naming `cplan` in the registry, for as long as the tensor's memory lives."""
    key = next(_ids)
    array = numpy.zeros(1, dtype=numpy.int64).view(_Handle)
    array[0] = key
    _plans[key] = cplan
    weakref.finalize(array, _plans.pop, key, None)
    return torch.from_numpy(array)


def plan_of(handle):
    """The C++ plan a handle names (RuntimeError when it is gone)."""
    key = int(handle[0])
    cplan = _plans.get(key)
    if cplan is None:
        raise RuntimeError(f"flatep ops: plan {key} no longer exists (its handle tensor was freed)")
    return cplan


class _OpPlan:
    """What the raw ops read of a Plan, rebuilt from (handle, storage) inside an op."""

    __slots__ = ("_plan", "_storage", "num_tokens")

    def __init__(self, handle, storage):
        self._plan = plan_of(handle)
        self._storage = storage
        self.num_tokens = self._plan.num_tokens


def _stream(obj, code):
    if code == 0:
        return None
    if code == 1:
        return obj.comm_stream
    raise ValueError(f"flatep ops: stream code must be 0 (current) or 1 (the object's comm_stream), got {code}")


def _dense(t):
    """`t` contiguous (the raw ops take data pointers); None stays None."""
    return None if t is None else t.contiguous()


def _empty(like, dtype):
    return torch.empty(0, dtype=dtype, device=like.device)


if AVAILABLE:
    from torch import Tensor

    # ---- Buffer ----

    @torch.library.custom_op("flatep::plan", mutates_args=())
    def plan_op(buffer_id: int, topk_idx: Tensor, stream: int, num_sms: int) -> Tuple[Tensor, Tensor]:
        b = _object(buffer_id, "Buffer")
        topk_idx = topk_idx.contiguous()
        with b._launch("plan", _stream(b, stream), None, num_sms) as launch:
            cplan, storage = b._plan_raw(topk_idx, num_sms=launch.num_sms)
        launch.finish(False, (topk_idx,), (storage,))
        if storage is None:  # the CPU backend: a copy of this rank's slot_expert and cu_seqlens
            storage = torch.cat([
                torch.from_numpy(cplan.slot_expert(b.rank)), torch.from_numpy(cplan.cu_seqlens(b.rank))
            ]).to(torch.int32)
        return plan_handle(cplan), storage

    @plan_op.register_fake
    def _(buffer_id, topk_idx, stream, num_sms):
        b = _object(buffer_id, "Buffer")
        words = b._plan_words if b.device.type == "cuda" else b.experts_per_rank + b.num_groups
        handle = torch.empty(1, dtype=torch.int64, device="cpu")
        return handle, torch.empty(words, dtype=torch.int32, device=topk_idx.device)

    @torch.library.custom_op("flatep::dispatch", mutates_args=())
    def dispatch_op(
        buffer_id: int, handle: Tensor, storage: Tensor, x: Tensor, topk_weights: Optional[Tensor],
        want_weights: bool, zero_fill: bool, stream: int, num_sms: int,
    ) -> Tuple[Tensor, Tensor]:
        b = _object(buffer_id, "Buffer")
        x, topk_weights = _dense(x), _dense(topk_weights)
        with b._launch("dispatch", _stream(b, stream), None, num_sms) as launch:
            recv_x, recv_w = b._dispatch_raw(_OpPlan(handle, storage), x, topk_weights, want_weights, zero_fill,
                                            num_sms=launch.num_sms)
        launch.finish(False, (x, topk_weights, storage), (recv_x, recv_w))
        return recv_x, recv_w if recv_w is not None else _empty(x, torch.float32)

    @dispatch_op.register_fake
    def _(buffer_id, handle, storage, x, topk_weights, want_weights, zero_fill, stream, num_sms):
        b = _object(buffer_id, "Buffer")
        recv_x = x.new_empty((b.num_recv_rows, b.hidden), dtype=torch.bfloat16)
        recv_w = x.new_empty((b.num_recv_rows if want_weights else 0,), dtype=torch.float32)
        return recv_x, recv_w

    @torch.library.custom_op("flatep::combine", mutates_args=())
    def combine_op(
        buffer_id: int, handle: Tensor, storage: Tensor, num_tokens: int, y: Tensor, weights: Optional[Tensor],
        stream: int, num_sms: int,
    ) -> Tensor:
        b = _object(buffer_id, "Buffer")
        y, weights = _dense(y), _dense(weights)
        with b._launch("combine", _stream(b, stream), None, num_sms) as launch:
            out = b._combine_raw(_OpPlan(handle, storage), y, weights, num_sms=launch.num_sms)
        launch.finish(False, (y, weights, storage), (out,))
        return out

    @combine_op.register_fake
    def _(buffer_id, handle, storage, num_tokens, y, weights, stream, num_sms):
        b = _object(buffer_id, "Buffer")
        return y.new_empty((num_tokens, b.hidden), dtype=torch.bfloat16)

    @torch.library.custom_op("flatep::entry_values", mutates_args=())
    def entry_values_op(
        buffer_id: int, handle: Tensor, storage: Tensor, num_tokens: int, row_values: Tensor, stream: int,
        num_sms: int,
    ) -> Tensor:
        b = _object(buffer_id, "Buffer")
        row_values = _dense(row_values)
        with b._launch("entry_values", _stream(b, stream), None, num_sms) as launch:
            out = b._entry_values_raw(_OpPlan(handle, storage), row_values, num_sms=launch.num_sms)
        launch.finish(False, (row_values, storage), (out,))
        return out

    @entry_values_op.register_fake
    def _(buffer_id, handle, storage, num_tokens, row_values, stream, num_sms):
        b = _object(buffer_id, "Buffer")
        return row_values.new_empty((num_tokens, b.topk), dtype=torch.float32)

    @torch.library.custom_op("flatep::combine_grad", mutates_args=())
    def combine_grad_op(
        buffer_id: int, handle: Tensor, storage: Tensor, rows: Tensor, y: Tensor, weights: Tensor, want_y: bool,
        want_weights: bool, stream: int, num_sms: int,
    ) -> Tuple[Tensor, Tensor]:
        b = _object(buffer_id, "Buffer")
        rows, y, weights = _dense(rows), _dense(y), _dense(weights)
        with b._launch("combine_grad", _stream(b, stream), None, num_sms) as launch:
            grad_y, grad_w = b._combine_grad_raw(_OpPlan(handle, storage), rows, y, weights, want_y, want_weights,
                                                 num_sms=launch.num_sms)
        launch.finish(False, (rows, y, weights, storage), (grad_y, grad_w))
        return (grad_y if grad_y is not None else _empty(rows, torch.bfloat16),
                grad_w if grad_w is not None else _empty(rows, torch.float32))

    @combine_grad_op.register_fake
    def _(buffer_id, handle, storage, rows, y, weights, want_y, want_weights, stream, num_sms):
        b = _object(buffer_id, "Buffer")
        grad_y = rows.new_empty((b.num_recv_rows, b.hidden) if want_y else (0,), dtype=torch.bfloat16)
        grad_w = rows.new_empty((b.num_recv_rows if want_weights else 0,), dtype=torch.float32)
        return grad_y, grad_w

    # autograd: the backward of autograd.py's DispatchFunction / CombineFunction, through the ops themselves

    def _dispatch_setup(ctx, inputs, output):
        buffer_id, handle, storage, x, topk_weights, want_weights, zero_fill, stream, num_sms = inputs
        ctx.save_for_backward(handle, storage)
        ctx.args = (buffer_id, stream, num_sms, x.shape[0])
        ctx.has_weights = topk_weights is not None

    def _dispatch_backward(ctx, grad_recv_x, grad_recv_w):
        handle, storage = ctx.saved_tensors
        buffer_id, stream, num_sms, num_tokens = ctx.args
        grad_x = grad_w = None
        if ctx.needs_input_grad[3] and grad_recv_x is not None:
            rows = grad_recv_x.to(torch.bfloat16).contiguous()
            grad_x = combine_op(buffer_id, handle, storage, num_tokens, rows, None, stream, num_sms)
        if ctx.has_weights and ctx.needs_input_grad[4] and grad_recv_w is not None:
            values = grad_recv_w.to(torch.float32).contiguous()
            grad_w = entry_values_op(buffer_id, handle, storage, num_tokens, values, stream, num_sms)
        return None, None, None, grad_x, grad_w, None, None, None, None

    torch.library.register_autograd("flatep::dispatch", _dispatch_backward, setup_context=_dispatch_setup)

    def _combine_setup(ctx, inputs, output):
        buffer_id, handle, storage, num_tokens, y, weights, stream, num_sms = inputs
        ctx.has_weights = weights is not None
        ctx.args = (buffer_id, stream, num_sms)
        if weights is not None:
            ctx.save_for_backward(handle, storage, y, weights)
        else:
            ctx.save_for_backward(handle, storage)

    def _combine_backward(ctx, grad_out):
        buffer_id, stream, num_sms = ctx.args
        saved = ctx.saved_tensors
        handle, storage = saved[0], saved[1]
        # Weighted: rows only feed combine_grad (never past the last group end): no fill. Unweighted: rows are grad_y.
        rows, _ = dispatch_op(
            buffer_id, handle, storage, grad_out.to(torch.bfloat16).contiguous(), None, False,
            not ctx.has_weights, stream, num_sms,
        )
        if not ctx.has_weights:
            return None, None, None, None, rows, None, None, None
        y, weights = saved[2], saved[3]
        want_y, want_w = bool(ctx.needs_input_grad[4]), bool(ctx.needs_input_grad[5])
        grad_y = grad_w = None
        if want_y or want_w:
            grad_y, grad_w = combine_grad_op(buffer_id, handle, storage, rows, y, weights, want_y, want_w, stream,
                                             num_sms)
        return None, None, None, None, grad_y if want_y else None, grad_w if want_w else None, None, None

    torch.library.register_autograd("flatep::combine", _combine_backward, setup_context=_combine_setup)

    # ---- ExpertPools (mutating the compute views they write; see the module docstring) ----

    def _sync_views(passed, real):
        """Copies the real views into tensors the compiler passed instead of them (copies), if any."""
        for t, r in zip(passed, real):
            if t.data_ptr() != r.data_ptr():
                t.copy_(r)

    @torch.library.custom_op("flatep::prefetch", mutates_args=("weights",))
    def prefetch_op(
        pools_id: int, layer: int, handle: Tensor, storage: Tensor, weights: List[Tensor], stream: int, num_sms: int,
        plan_ordered: bool = False,
    ) -> None:
        p = _object(pools_id, "ExpertPools")
        ex = p.layers[layer]
        with p._launch("prefetch", _stream(p, stream), None, num_sms) as launch:
            p._prefetch_raw(_OpPlan(handle, storage), ex, num_sms=launch.num_sms, plan_ordered=plan_ordered)
            _sync_views(weights, ex._weights)
        launch.finish(False, (storage,), ())

    @prefetch_op.register_fake
    def _(pools_id, layer, handle, storage, weights, stream, num_sms, plan_ordered=False):
        return None

    @torch.library.custom_op("flatep::reduce_grad", mutates_args=("grads",))
    def reduce_grad_op(
        pools_id: int, layer: int, handle: Tensor, storage: Tensor, grads: List[Tensor], stream: int, num_sms: int,
    ) -> None:
        p = _object(pools_id, "ExpertPools")
        ex = p.layers[layer]
        with p._launch("reduce_grad", _stream(p, stream), None, num_sms) as launch:
            # a copy the compiler passed holds what write_grads wrote: the real views hold it too (they were synced)
            p._reduce_grad_raw(_OpPlan(handle, storage), ex, num_sms=launch.num_sms)
            _sync_views(grads, ex._grads)
        launch.finish(False, (storage,), ())

    @reduce_grad_op.register_fake
    def _(pools_id, layer, handle, storage, grads, stream, num_sms):
        return None

    @torch.library.custom_op("flatep::write_grads", mutates_args=("grads",))
    def write_grads_op(
        pools_id: int, layer: int, handle: Tensor, storage: Tensor, projection: int, grad: Tensor, accumulate: bool,
        grads: Tensor, stream: int, num_sms: int,
    ) -> None:
        p = _object(pools_id, "ExpertPools")
        ex = p.layers[layer]
        grad = _dense(grad)
        with p._launch("write_grads", _stream(p, stream), None, num_sms) as launch:
            if grads.data_ptr() != ex._grads[projection].data_ptr():  # a copy: the real view must hold its state
                ex._grads[projection].copy_(grads)
            p._write_grads_raw(_OpPlan(handle, storage), ex, projection, grad, accumulate, num_sms=launch.num_sms)
            _sync_views([grads], [ex._grads[projection]])
        launch.finish(False, (storage, grad), ())

    @write_grads_op.register_fake
    def _(pools_id, layer, handle, storage, projection, grad, accumulate, grads, stream, num_sms):
        return None

    # ---- nn.MoE's experts (see nn._experts_compiled): functional forward, backward into main_grad ----

    @torch.library.custom_op("flatep::experts", mutates_args=())
    def experts_op(
        pools_id: int, layer: int, handle: Tensor, storage: Tensor, cu_seqlens: Tensor, recv_x: Tensor, w1: Tensor,
        w2: Tensor, weights1: Tensor, weights2: Tensor, grads1: Tensor, grads2: Tensor, activation: str, save: bool,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        # w1, w2 (the parameters) and grads1, grads2 (the gradient views) are read by autograd only: the parameters
        # make the backward run when they need gradients, the views are what the backward writes
        return _ffn.ffn_forward(_dense(recv_x), weights1, weights2, cu_seqlens, activation, save)

    @experts_op.register_fake
    def _(pools_id, layer, handle, storage, cu_seqlens, recv_x, w1, w2, weights1, weights2, grads1, grads2,
          activation, save):
        rows = recv_x.shape[0] if save else 0
        y = recv_x.new_empty((recv_x.shape[0], weights2.shape[-1]), dtype=torch.bfloat16)
        h = recv_x.new_empty((rows, weights1.shape[-1]), dtype=torch.bfloat16)
        a = recv_x.new_empty((rows, weights2.shape[-2]), dtype=torch.bfloat16)
        return y, h, a

    @torch.library.custom_op("flatep::experts_backward", mutates_args=("grads1", "grads2"))
    def experts_backward_op(
        pools_id: int, layer: int, handle: Tensor, storage: Tensor, cu_seqlens: Tensor, grad_y: Tensor,
        recv_x: Tensor, h: Tensor, a: Tensor, grads1: Tensor, grads2: Tensor, activation: str, want_x: bool,
        want_w1: bool, want_w2: bool,
    ) -> Tensor:
        # Writes main_grad (the own part of grads1 / grads2) and the reduce pools; prefetches into the compute views
        # again (the slot pool, which no tensor of the graph reads after the forward's experts).
        p = _object(pools_id, "ExpertPools")
        ex = p.layers[layer]
        grad_x = _ffn.experts_backward_step(
            p, ex, _OpPlan(handle, storage), _dense(grad_y.to(torch.bfloat16)), _dense(recv_x), h, a, cu_seqlens,
            activation, want_x, want_w1, want_w2,
        )
        _sync_views([grads1, grads2], ex._grads)
        return grad_x if grad_x is not None else _empty(recv_x, torch.bfloat16)

    @experts_backward_op.register_fake
    def _(pools_id, layer, handle, storage, cu_seqlens, grad_y, recv_x, h, a, grads1, grads2, activation, want_x,
          want_w1, want_w2):
        return recv_x.new_empty(recv_x.shape if want_x else (0,), dtype=torch.bfloat16)

    def _experts_setup(ctx, inputs, output):
        pools_id, layer, handle, storage, cu_seqlens, recv_x, _, _, _, _, grads1, grads2, activation, _ = inputs
        _, h, a = output
        ctx.save_for_backward(handle, storage, cu_seqlens, recv_x, h, a)
        # The gradient views are written (accumulated into) by the backward, not read as saved values: kept as plain
        # references, not saved tensors, so that a layer called twice in one graph (forward_microbatches) passes
        # autograd's saved-version check after the first backward has written them.
        ctx.grad_views = (grads1, grads2)
        ctx.args = (pools_id, layer, activation)

    def _experts_backward(ctx, grad_y, grad_h, grad_a):
        want_x, want_w1, want_w2 = (bool(ctx.needs_input_grad[i]) for i in (5, 6, 7))
        grad_x = None
        if want_x or want_w1 or want_w2:
            pools_id, layer, activation = ctx.args
            handle, storage, cu_seqlens, recv_x, h, a = ctx.saved_tensors
            grads1, grads2 = ctx.grad_views
            grad_x = experts_backward_op(pools_id, layer, handle, storage, cu_seqlens, grad_y, recv_x, h, a, grads1,
                                         grads2, activation, want_x, want_w1, want_w2)
        # none for w1 / w2: their gradient is main_grad
        return (None,) * 5 + (grad_x if want_x else None,) + (None,) * 8

    torch.library.register_autograd("flatep::experts", _experts_backward, setup_context=_experts_setup)

else:  # torch < 2.4: no custom ops; every method takes the direct path
    plan_op = dispatch_op = combine_op = entry_values_op = combine_grad_op = None
    prefetch_op = reduce_grad_op = write_grads_op = experts_op = experts_backward_op = None


def stream_code(op, obj, stream, previous_event, async_finish):
    """The ops' stream argument for a method's stream / previous_event / async_finish while compiling."""
    if previous_event is not None or async_finish:
        raise ValueError(
            f"{op}: previous_event and async_finish are not supported under torch.compile (an EventHandle is a "
            "Python object); pass stream=<the object's comm_stream> or None"
        )
    if stream is None:
        return 0
    if stream is obj.comm_stream:
        return 1
    raise ValueError(f"{op}: under torch.compile, stream must be None or this object's comm_stream")
