"""flatep.ExpertPools and flatep.ExpertLayer: expert weights with redundant-expert slots (design §5).

Once per process and group, ExpertPools allocates per projection p of shape [rows, cols] a slot pool (bf16
[epn, rows, cols]: where this step's replicas land) and a reduce pool (fp32, same shape: where replicas' gradients
are computed), shared by every layer. Each layer registers once and gets, per projection, torch tensors over the
C++ memory (no copies):

    layer.weights(p)      bf16 [2*epn, rows, cols]  compute view: own experts [0, epn), then the slot pool
    layer.grads(p)        fp32 [2*epn, rows, cols]  own gradients [0, epn), then the reduce pool
    layer.own_weights(p)  bf16 [epn, rows, cols]    aliases weights(p)[:epn]
    layer.own_grads(p)    fp32 [epn, rows, cols]    aliases grads(p)[:epn]

Per step: write the layer's own weights, ``pools.prefetch(plan, layer)`` (collective: owners push replicas into the
slot pools), run the grouped GEMM over weights(p) with offs = plan.cu_seqlens; in backward write the GEMM's weight
gradients into grads(p) with ``pools.write_grads(plan, layer, p, grad)`` (local: own groups, and the slots used this
step), then ``pools.reduce_grad(plan, layer)`` (collective: replicas' grads are added into the owners' own_grads in
ascending (rank, slot) order and the consumed slots are zeroed).

The tensors are valid while the ExpertLayer (and its ExpertPools) object lives: keep a reference.

On a CUDA device (FlatEP built with CUDA) the memory is device memory (CUDA VMM: each compute view is one contiguous
virtual range over the layer's allocation followed by the pool's), and prefetch / reduce_grad are enqueued on
``torch.cuda.current_stream(device)`` at the time of the call, like flatep.Buffer's ops, without a host
synchronisation. The plan must come from a Buffer on the same device.

Serving (``num_slots=B`` with B < epn; docs/design.md §5 "Serving layout"): each rank keeps only B replica slots and
every layer's own weights are symmetric memory that every rank maps. ``layer.weights(p)`` is then one view
``[view_rows, rows, cols]`` (view_rows = R*Q + B, Q = ``pools.view_stride`` >= epn), laid out the same on every rank:
rank r's own experts at rows [r*Q, r*Q + epn) (``pools.view_row(e)``: the row of expert e; rows r*Q + epn .. r*Q + Q
are padding the mapping granularity needs: readable, unspecified values, empty groups of every plan), then this
rank's B slots at rows [R*Q, R*Q + B). A plan of a Buffer built from the pools (``Buffer(..., pools=pools)``) has one
group per view row (cu_seqlens [view_rows]), so a grouped GEMM over the view with offs = cu_seqlens reads every
replica beyond the B slots straight from its owner's memory; ``prefetch`` pulls the B slotted experts from their owners
(one barrier, or none with ``plan_ordered=True``, which flatep.nn.MoE passes). Serving pools are forward-only
(``grads`` / ``own_grads`` are None; reduce_grad and write_grads refuse) and register_layer is collective there.

Weights other than bf16 (e.g. FP8): a projection may be given as (rows, cols, dtype) with dtype torch.float8_e4m3fn
(or torch.uint8 for e4m3 bytes on a torch without it), torch.float32 (e.g. per-block scales of an e4m3 projection) or
torch.bfloat16 (the default). Prefetch moves every projection as bytes, so an e4m3 projection and its scales
projection travel together; the GEMM that consumes them is the caller's. Pools with a projection that is not bf16
are forward-only.
"""

import torch

from . import _C
from . import fp8 as _fp8
from . import ops as _ops
from ._bootstrap import arrive as _virtual_arrive
from ._tensors import (
    _ELEMENT_BYTES, INT64_MAX, address, cache_key, check_int, check_tensor, check_timeout, tensor_at,
)
from .buffer import Plan
from .distributed import group_rank_size, resolve_device, transport_for
from .launch import OpLaunch, check_num_sms, device_guard, stream_handle


#: The weight dtypes a projection may have (e4m3 as torch.uint8 bytes on a torch without float8_e4m3fn).
_WEIGHT_DTYPES = (torch.bfloat16, torch.float32, torch.uint8) + ((_fp8.E4M3_DTYPE,) if _fp8.E4M3_DTYPE else ())


def _dtype_name(dtype):
    """The C++ messages' name of a weight dtype."""
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, "e4m3")


def _projection_shape(i, shape, epn):
    """((rows, cols), dtype) of projection i given as (rows, cols) or (rows, cols, dtype); one-line ValueErrors."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    dtype = shape[2] if len(shape) == 3 else torch.bfloat16
    dims = shape[:2]
    if len(shape) not in (2, 3) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
        raise ValueError(f"ExpertPools: projection {i} must be (rows, cols) or (rows, cols, dtype) with positive int "
                         f"rows and cols, got {shape!r}")
    if dtype not in _WEIGHT_DTYPES:
        names = ", ".join(str(d) for d in _WEIGHT_DTYPES)
        raise ValueError(f"ExpertPools: projection {i} dtype must be one of {names}, got {dtype!r}")
    if max(dims) > INT64_MAX:  # the C++ check's message, for sizes its int64 cannot hold
        raise ValueError(f"ExpertPools: projection {i} of [{dims[0]}][{dims[1]}] x {epn} experts is too large")
    nbytes = _ELEMENT_BYTES[dtype]
    if dims[0] * dims[1] * nbytes % 16:  # the C++ check's message, before the transport's collective set-up
        raise ValueError(
            f"ExpertPools: projection {i} of [{dims[0]}][{dims[1]}] has {dims[0] * dims[1] * nbytes} bytes per "
            f"expert ({_dtype_name(dtype)}), not a multiple of 16; rows * cols must be a multiple of {16 // nbytes}"
        )
    return (int(dims[0]), int(dims[1])), dtype


class ExpertLayer:
    """One layer's expert memory; get it from :meth:`ExpertPools.register_layer`."""

    def __init__(self, pools, clayer, index=0):
        self.pools = pools
        self._layer = clayer
        self._index = index  # position in pools.layers (what the custom ops take)
        epn, device, view_rows = pools.experts_per_rank, pools.device, pools.view_rows
        self._weights, self._grads, self._own_weights, self._own_grads = [], [], [], []
        for p, ((rows, cols), dtype) in enumerate(zip(pools.projections, pools.dtypes)):
            self._weights.append(tensor_at(clayer.weights(p), (view_rows, rows, cols), dtype, device, self))
            self._own_weights.append(tensor_at(clayer.own_weights(p), (epn, rows, cols), dtype, device, self))
            trains = pools.trains
            self._grads.append(
                tensor_at(clayer.grads(p), (view_rows, rows, cols), torch.float32, device, self) if trains else None
            )
            self._own_grads.append(
                tensor_at(clayer.own_grads(p), (epn, rows, cols), torch.float32, device, self) if trains else None
            )

    def _projection(self, p):
        n = len(self._weights)
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < n:
            raise ValueError(f"projection must be an int in [0, {n}), got {p!r}")
        return p

    def weights(self, p):
        """[view_rows, rows, cols] compute view of projection p, in the projection's dtype (bf16 unless given):
        training [2*epn] (own experts, then the slot pool), serving [R*Q + B] (every rank's own experts read in
        place, then this rank's B slots; see the module docstring)."""
        return self._weights[self._projection(p)]

    def grads(self, p):
        """fp32 [2*epn, rows, cols] gradient view of projection p (None for forward-only pools)."""
        return self._grads[self._projection(p)]

    def own_weights(self, p):
        """[epn, rows, cols]: this layer's own experts of projection p (the same memory as their rows of
        weights(p))."""
        return self._own_weights[self._projection(p)]

    def own_grads(self, p):
        """fp32 [epn, rows, cols]: this layer's own experts' gradients of projection p (None for forward-only
        pools)."""
        return self._own_grads[self._projection(p)]


class ExpertPools:
    """Slot and reduce pools of one process for a group (collective constructor).

    Args:
        group: torch.distributed process group (None: the default group, or a one-rank world).
        experts_per_rank (int): epn = E / R of the Buffers whose plans are used.
        projections (list of (rows, cols) or (rows, cols, dtype)): per projection, the shape of one expert's weight
            matrix, e.g. [(H, F), (F, H)] for an FFN x @ W1 -> act -> @ W2, and its dtype: torch.bfloat16 (the
            default), torch.float8_e4m3fn (or torch.uint8: e4m3 bytes) or torch.float32 (e.g. block scales); one
            expert's bytes a multiple of 16 (rows * cols a multiple of 8 for bf16, 16 for e4m3, 4 for fp32).
        num_slots (int or None): B, replica slots per rank, in [0, epn]; None or epn: training (today's layout);
            B < epn: serving (module docstring). The pools own B and the view stride Q: a Buffer whose plans these
            serving pools take is built from them, ``flatep.Buffer(..., pools=pools)``, and takes both.
        device: 'cpu' (the CPU backend, default) or a CUDA device (FlatEP built with CUDA; 'cuda' means the current
            device). Plans must come from Buffers on the same device.
        timeout_s (float): bound on every cross-rank wait of this object, seconds in (0, 86400]; kept from
            construction on, whatever later objects of the group set. None: the group's transport's timeout at
            construction (FLATEP_TIMEOUT_S or 100 s, unless virtual_ranks or an earlier object set one).
        num_sms (int or None): SM budget of the pools' kernels (thread blocks per launch, 0 = no cap; None:
            FLATEP_NUM_SMS); each op also takes num_sms for that call (the pools' own stays as it is). No effect on the
            CPU backend.
        stream_priority (int): priority of the pools' own ``comm_stream`` (CUDA devices; None on the CPU backend).

    Attributes: experts_per_rank, projections (list of (rows, cols)), dtypes (per projection), num_slots (B),
    serving (B < epn), trains (gradients available: training and bf16 weights only), view_stride (Q; epn in
    training), view_rows (rows of every weights view: R*Q + B, or 2*epn in training), view_row(e) (serving: the
    view row of expert e's own weights).

    prefetch, reduce_grad and write_grads take stream / previous_event / async_finish / num_sms like flatep.Buffer's
    ops (see its docstring: streams and events); with async_finish=True they return an EventHandle.
    """

    def __init__(self, group, experts_per_rank, projections, *, num_slots=None, device=None, timeout_s=None,
                 num_sms=None, stream_priority=0):
        if isinstance(experts_per_rank, bool) or not isinstance(experts_per_rank, int) or experts_per_rank < 1:
            raise ValueError(f"ExpertPools: experts_per_rank must be a positive int, got {experts_per_rank!r}")
        check_int("ExpertPools", "experts_per_rank", experts_per_rank, "in [1, 2147483647]")
        if num_slots is not None:  # None is epn; the C++ constructor checks B against epn (the one check of B)
            check_int("ExpertPools", "num_slots", num_slots, "None or an int >= 0", 0)
        timeout_s = check_timeout("ExpertPools", timeout_s)
        check_num_sms("ExpertPools", num_sms)  # its type; the C++ checks its value
        check_int("ExpertPools", "stream_priority", stream_priority, "an int (torch.cuda.Stream priority)")
        shapes, dtypes = [], []
        for i, shape in enumerate(projections):
            shape, dtype = _projection_shape(i, shape, experts_per_rank)
            shapes.append(shape)
            dtypes.append(dtype)
        if not shapes:
            raise ValueError("ExpertPools: at least one projection is needed")
        self.group = group
        self.rank, self.num_ranks = group_rank_size(group)
        self.experts_per_rank = experts_per_rank
        self.projections = shapes
        self.dtypes = dtypes
        transport = transport_for(group, device, timeout_s)  # validates the device first
        self.device = resolve_device(device)
        cshapes = [(rows, cols, _ELEMENT_BYTES[d]) for (rows, cols), d in zip(shapes, dtypes)]
        with device_guard(self.device):
            self._pools = _C.ExpertPools(transport, experts_per_rank, cshapes, -1 if num_slots is None else num_slots)
        self.num_slots = self._pools.num_slots
        self.serving = self._pools.serving
        self.trains = self._pools.trains
        self.view_stride = self._pools.view_stride
        self.view_rows = self._pools.view_rows
        if num_sms is not None:
            self._pools.num_sms = num_sms
        self.comm_stream = None
        if self.device.type == "cuda":
            self.comm_stream = torch.cuda.Stream(self.device, priority=stream_priority)
        self._op_id = _ops.register_object(self) if _ops.AVAILABLE else None
        self.layers = []
        self._slots_hold = None  # what the slot pool holds after a static placement's move (flatep.placement)

    def view_row(self, expert):
        """Serving: the row of expert e's own weights in every weights view (home(e)*Q + e % epn)."""
        check_int("view_row", "expert", expert, f"in [0, E={self.num_ranks * self.experts_per_rank})")
        return self._pools.view_row(expert)

    def _check_trains(self, op):
        if not self.trains:
            why = (f"serving: num_slots={self.num_slots} < epn={self.experts_per_rank}" if self.serving
                   else "a projection's weights are not bf16")
            raise ValueError(f"{op}: these pools are forward-only ({why}); gradients need num_slots = epn and bf16 "
                             "weights")

    @property
    def num_sms(self):
        """int: the pools' SM budget (thread blocks per launch; 0 = no cap), which every op called without num_sms uses.
        Settable."""
        return self._pools.num_sms

    @num_sms.setter
    def num_sms(self, value):
        self._pools.num_sms = check_num_sms("ExpertPools", value, none_ok=False)

    def register_layer(self):
        """A new layer's zero-filled weights and grads with their compute views (local in training; collective in
        serving, where the own weights are symmetric memory every rank maps)."""
        layer = ExpertLayer(self, self._pools.register_layer(), len(self.layers))  # on the transport's device
        self.layers.append(layer)
        return layer

    def _launch(self, op, stream, previous_event, num_sms):
        return OpLaunch(self.device, stream, previous_event, check_num_sms(op, num_sms), op)

    def _run(self, op, body, stream, previous_event, async_finish, num_sms, reads):
        """Runs body(num_sms) on the op's stream (the default path: directly, with -1: the pools' budget); returns the
        EventHandle or None."""
        if stream is None and previous_event is None and num_sms is None and not async_finish:
            body(-1)
            return None
        with self._launch(op, stream, previous_event, num_sms) as launch:
            body(launch.num_sms)
        return launch.finish(async_finish, reads, ())

    # raw ops (no checks; flatep.ops calls them inside its OpLaunch): on the current stream, with SM budget num_sms
    # (-1: the pools')
    def _prefetch_raw(self, plan, layer, *, num_sms=-1, plan_ordered=False):
        self._slots_hold = None  # every prefetch rewrites the slot pool (flatep.nn.MoE records its static moves)
        with device_guard(self.device):
            _virtual_arrive(self.group, "prefetch")
            self._pools.prefetch(plan._plan, layer._layer, stream=stream_handle(self.device), num_sms=num_sms,
                                 plan_ordered=plan_ordered)

    def _reduce_grad_raw(self, plan, layer, *, num_sms=-1):
        with device_guard(self.device):
            _virtual_arrive(self.group, "reduce_grad")
            self._pools.reduce_grad(plan._plan, layer._layer, stream=stream_handle(self.device), num_sms=num_sms)

    def _write_grads_raw(self, plan, layer, projection, grad, accumulate, *, num_sms=-1):
        with device_guard(self.device):
            self._pools.write_grads(plan._plan, layer._layer, projection, address(grad), grad.element_size(),
                                    bool(accumulate), stream=stream_handle(self.device), num_sms=num_sms)

    def _resolve(self, op, plan, layer):
        if not isinstance(plan, Plan):
            raise ValueError(f"{op}: plan must be a flatep.Plan from Buffer.plan(), got {type(plan).__name__}")
        if layer is None:
            if len(self.layers) != 1:
                raise ValueError(f"{op}: layer is required when {len(self.layers)} layers are registered (not 1)")
            layer = self.layers[0]
        if not isinstance(layer, ExpertLayer) or layer.pools is not self:
            raise ValueError(f"{op}: layer must be an ExpertLayer registered with these pools")
        if plan._buffer.device != self.device:
            raise ValueError(f"{op}: plan was made by a Buffer on {plan._buffer.device}, but these pools are on "
                             f"{self.device}")
        return layer

    def _op_args(self, op, stream, previous_event, async_finish, num_sms):
        code = _ops.stream_code(op, self, stream, previous_event, async_finish)
        return code, check_num_sms(op, num_sms)

    def prefetch(self, plan, layer=None, *, stream=None, previous_event=None, async_finish=False, num_sms=None,
                 plan_ordered=False):
        """Collective: owners push this step's replicas (plan.slot_expert of every rank) of every projection into the
        slot pools, i.e. into every layer's weights(p)[epn:] (serving: each rank pulls its B slotted experts from their
        owners). Call after writing own_weights and before the GEMM. Returns None (with async_finish=True: the
        EventHandle; the GEMM's stream waits for it).

        plan_ordered=True (serving pools only; every rank alike): the pull takes no barrier of its own, since the plan
        op that made `plan` met every rank after its last write of its own weights. The caller promises that no rank
        writes its layer's own weights from that plan op until the next Buffer op after this prefetch (the step's
        combine): write weights between steps. flatep.nn.MoE's serving layers pass it."""
        layer = self._resolve("prefetch", plan, layer)
        if not isinstance(plan_ordered, bool):
            raise ValueError(f"prefetch: plan_ordered must be a bool, got {plan_ordered!r}")
        if plan_ordered and not self.serving:
            raise ValueError("prefetch: plan_ordered=True needs serving pools (num_slots < epn): training's push "
                             f"needs its two barriers; these pools have num_slots={self.num_slots}")
        if _ops.compiling():
            code, num_sms = self._op_args("prefetch", stream, previous_event, async_finish, num_sms)
            _ops.prefetch_op(self._op_id, layer._index, plan._handle, plan._storage, layer._weights, code, num_sms,
                             plan_ordered)
            return None
        return self._run("prefetch", lambda n: self._prefetch_raw(plan, layer, num_sms=n, plan_ordered=plan_ordered),
                         stream, previous_event, async_finish, num_sms, (plan._storage,))

    def placement_bytes(self, plan, all_ranks=False):
        """Bytes that prefetch with a static plan (planner='static') copies into this rank's slots (all_ranks=True:
        every rank's, summed): the placed slots times one expert's bytes over every projection. Local, no
        synchronisation. It is what moving a placement costs once: later plans of the same placement need no
        prefetch while the slots still hold it (prefetch moves the same bytes again whenever it is called)."""
        if not isinstance(plan, Plan):
            raise ValueError(f"placement_bytes: plan must be a flatep.Plan from Buffer.plan(), got "
                             f"{type(plan).__name__}")
        return self._pools.placement_bytes(plan._plan, -1 if all_ranks else self.rank)

    def reduce_grad(self, plan, layer=None, *, stream=None, previous_event=None, async_finish=False, num_sms=None):
        """Collective: adds the replicas' gradients (grads(p)[epn:] of every rank) into the owners' own_grads(p) in
        ascending (rank, slot) order in fp32, then zeroes the consumed slots. Returns None (with async_finish=True:
        the EventHandle)."""
        layer = self._resolve("reduce_grad", plan, layer)
        self._check_trains("reduce_grad")
        if _ops.compiling():
            code, num_sms = self._op_args("reduce_grad", stream, previous_event, async_finish, num_sms)
            _ops.reduce_grad_op(self._op_id, layer._index, plan._handle, plan._storage, layer._grads, code, num_sms)
            return None
        return self._run("reduce_grad", lambda n: self._reduce_grad_raw(plan, layer, num_sms=n), stream, previous_event,
                         async_finish, num_sms, (plan._storage,))

    def write_grads(self, plan, layer, projection, grad, accumulate=False, *, stream=None, previous_event=None,
                    async_finish=False, num_sms=None):
        """Local (not collective), in backward before reduce_grad: writes projection p's weight gradients as a grouped
        GEMM over layer.weights(p) computes them into layer.grads(p), in the state reduce_grad expects.

        Args:
            grad (torch.Tensor): [2*epn, rows, cols] bf16 or fp32; group g < epn is own expert g, group epn + j slot j.
        Own groups are always written (converted exactly to fp32; zero for a group without rows this step, whatever
        grad holds there); slot j only when it is used this step (plan.slot_expert[j] >= 0) and has rows; other slots
        are not touched (their reduce pool stays zero, as reduce_grad left it). accumulate=True: own groups with rows
        are added into own_grads(p) (one fp32 add per element) and own groups without rows are not touched, so the
        own gradients accumulate over micro-batches until the caller zeroes them (Megatron's ``main_grad``); slots
        as above. Enqueued on the current stream on a CUDA device (no host synchronisation)."""
        layer = self._resolve("write_grads", plan, layer)
        self._check_trains("write_grads")
        n = len(self.projections)
        if isinstance(projection, bool) or not isinstance(projection, int) or not 0 <= projection < n:
            raise ValueError(f"write_grads: projection must be an int in [0, {n}), got {projection!r}")
        rows, cols = self.projections[projection]
        grad = check_tensor(
            "write_grads", "grad", grad, (torch.bfloat16, torch.float32), (2 * self.experts_per_rank, rows, cols),
            self.device,
        )
        if _ops.compiling():
            code, num_sms = self._op_args("write_grads", stream, previous_event, async_finish, num_sms)
            _ops.write_grads_op(self._op_id, layer._index, plan._handle, plan._storage, projection, grad,
                                bool(accumulate), layer._grads[projection], code, num_sms)
            return None
        return self._run("write_grads",
                         lambda n: self._write_grads_raw(plan, layer, projection, grad, accumulate, num_sms=n),
                         stream, previous_event, async_finish, num_sms, (plan._storage, grad))

    def _checked_projection(self, p):
        n = len(self.projections)
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < n:
            raise ValueError(f"projection must be an int in [0, {n}), got {p!r}")
        return p

    def slot_pool(self, p):
        """[B, rows, cols] in projection p's dtype: this rank's slot pool of projection p (B = num_slots; the view's
        rows after the own experts)."""
        rows, cols = self.projections[self._checked_projection(p)]
        shape = (self.num_slots, rows, cols)
        if self.num_slots == 0:
            return torch.empty(shape, dtype=self.dtypes[p], device=self.device)
        return tensor_at(self._pools.slot_pool(p), shape, self.dtypes[p], self.device, self)

    def reduce_pool(self, p):
        """fp32 [epn, rows, cols]: this rank's reduce pool of projection p (None for forward-only pools)."""
        rows, cols = self.projections[self._checked_projection(p)]
        if not self.trains:
            return None
        shape = (self.experts_per_rank, rows, cols)
        return tensor_at(self._pools.reduce_pool(p), shape, torch.float32, self.device, self)


_shared = {}


def shared_pools(group, experts_per_rank, projections, device=None, num_sms=None, stream_priority=0, num_slots=None):
    """The process's ExpertPools for (group, epn, projections, device, num_slots), created on first use (collective
    then). Arguments that the pools take as the same value share them (num_slots None and epn; a projection with and
    without its default dtype torch.bfloat16, as a tuple or a list; device None and 'cpu'); any other difference gets
    pools of their own, and an argument the pools refuse raises their ValueError whatever is cached."""
    device = resolve_device(device)
    slots = None if type(num_slots) is int and num_slots == experts_per_rank else num_slots
    try:  # ((rows, cols), dtype) of each: (rows, cols) and (rows, cols, torch.bfloat16) are one projection
        shapes = tuple(_projection_shape(i, p, experts_per_rank) for i, p in enumerate(projections))
    except (TypeError, ValueError):  # the constructor refuses them, with its own message
        shapes = None
    key = (id(group),) + cache_key(experts_per_rank, shapes, str(device), num_sms, stream_priority, slots)
    entry = _shared.get(key)
    if entry is None:
        pools = ExpertPools(group, experts_per_rank, projections, num_slots=slots, device=device, num_sms=num_sms,
                            stream_priority=stream_priority)
        entry = (group, pools)
        _shared[key] = entry
    return entry[1]


def release_shared_pools():
    _shared.clear()
