"""flatep.Buffer and flatep.Plan: the per-layer communication object of one EP rank (design §3).

Shapes (R ranks, E experts, epn = E/R, S tokens per rank fixed at construction, s <= S tokens this call, K = topk,
H = hidden, NvS = receive rows = round_up(C + 2*epn*(align-1), align), C = ceil(capacity_factor*S*K)):

    plan = buffer.plan(topk_idx)                          # topk_idx [s, K] int32/int64
    recv_x, recv_w, cu_seqlens = buffer.dispatch(plan, x, topk_weights)
                                                          # x [s, H] bf16, topk_weights [s, K] fp32 (or None)
                                                          # recv_x [NvS, H] bf16, recv_w [NvS] fp32,
                                                          # cu_seqlens [2*epn] int32 (grouped-GEMM offs)
    y = grouped_gemm(recv_x, expert_weights, offs=cu_seqlens)    # [NvS, H] bf16
    out = buffer.combine(plan, y, recv_w)                 # [s, H] bf16: sum_k w * y over each token's K rows

FP8 rows (H a multiple of 128; design §6 "FP8 rows"; forward only, see dispatch):

    (recv_q, recv_scales), recv_w, cu_seqlens = buffer.dispatch(plan, x, topk_weights, fp8=True)
                                                          # x [s, H] bf16, quantised inside the op (flatep.fp8's rule),
                                                          # or x = (x_q [s, H] e4m3, x_scales [s, H/128] fp32);
                                                          # recv_q [NvS, H] e4m3, recv_scales [NvS, H/128] fp32

dispatch and combine are autograd-aware (design §3): combine's backward is a dispatch of the output gradient with
the saved plan, dispatch's backward an unweighted combine of the row gradients; the routing weights' gradient
returns to the tokens' ranks through the plan (entry_values). Every call is collective over the group: all ranks
call the same ops in the same order.

On a CUDA device (FlatEP built with CUDA) every op is enqueued on ``torch.cuda.current_stream(device)`` at the time of
the call and never synchronises with the host; inputs must be ready in that stream's order (as for any torch op).
Errors the GPU records (a bad expert id, a timed-out wait, ranks in different ops or steps) are raised at the entry of
a later op, read from host-mapped memory without synchronising; a failed cross-rank wait leaves the Buffer unusable on
every rank (RuntimeError at every later call: build a new one).
Only the Plan's diagnostic accessors (stats, tpe_all, alloc, entry_ranks, entry_rows, real_rows, *_of) copy a device
plan to the host, which waits for the device.
"""

import torch

from . import _C
from . import fp8 as _fp8
from . import ops as _ops
from ._bootstrap import arrive as _virtual_arrive
from ._tensors import address, cache_key, check_int, check_tensor, check_timeout, shape_text, tensor_at
from .autograd import CombineFunction, DispatchFunction
from .distributed import group_rank_size, resolve_device, transport_for
from .launch import EventHandle, OpLaunch, check_num_sms, device_guard, stream_handle
from .placement import placement_words

__all__ = ["Buffer", "Plan", "EventHandle", "shared_buffer", "release_shared_buffers"]

_PLANNERS = ("balanced", "greedy", "owner", "static")


def _load_torch_kernels(device, plan_words):
    """Runs, once at construction, every torch kernel that the ops of this module launch between FlatEP's kernels
    (zero fills of a gradient's rows; the plan storage's allocation). Under CUDA's lazy module loading (torch's
    default) a kernel's first launch loads it, and a load may wait for every kernel running in the context: with
    several ranks in one process (flatep.virtual) that is a deadlock, until the timeout, while a rank's kernel spins
    for a peer whose kernel this thread has yet to enqueue. FlatEP's own kernels are loaded by the C++ runtime."""
    with torch.cuda.device(device):
        torch.zeros(256, 8, dtype=torch.bfloat16, device=device)
        torch.zeros(256, dtype=torch.float32, device=device)
        torch.empty(plan_words, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)  # construction time: the loads are done before any op


def _records_grad(a, b):
    """True when autograd would record an op on tensors a and b (b may be None)."""
    return torch.is_grad_enabled() and (a.requires_grad or (b is not None and b.requires_grad))


def _check_plan_ordered(op, plan_ordered, tensors):
    """plan_ordered as given (a bool); a one-line ValueError when it is not one, or when it is True for a call that
    torch.compile traces or autograd records (their backward runs ops on the same plan, which need the barrier)."""
    if not isinstance(plan_ordered, bool):
        raise ValueError(f"{op}: plan_ordered must be a bool, got {plan_ordered!r}")
    if plan_ordered and (_ops.compiling() or any(
            isinstance(t, torch.Tensor) and torch.is_grad_enabled() and t.requires_grad for t in tensors)):
        raise ValueError(f"{op}: plan_ordered=True is for eager inference (no torch.compile, no input requiring grad): "
                         "a backward runs more ops on the same plan, which need the entry barrier")
    return plan_ordered


class Plan:
    """One step's plan, made by :meth:`Buffer.plan`. Valid for any number of later ops on the Buffer that made it
    (backward reuses the forward's plan), including after later ``plan()`` calls.

    Attributes:
        slot_expert (torch.Tensor): [epn] int32, the expert each replica slot of this rank holds this step (-1: none).
        cu_seqlens (torch.Tensor): [num_groups] int32, inclusive padded ends of this rank's row groups. Training
            layout (num_groups = 2*epn): group g < epn is local expert rank*epn + g, group epn + j is slot j (replica
            of slot_expert[j]). Serving layout (num_slots B < epn; num_groups = R*Q + B): one group per row of the
            ExpertPools weights view: group r*Q + l is expert r*epn + l (read in place from rank r), R*Q + j slot j;
            pad rows are empty groups. Usable as grouped-GEMM ``offs`` over the weights view. On a CUDA buffer both are views of the plan's device memory (read-only: do not write them).
        num_tokens (int): s, the tokens passed to plan().
        generation (int): the Buffer's plan counter (identical on every rank for the same step).
    """

    def __init__(self, buffer, cplan, storage=None, handle=None, num_tokens=None):
        # Eager: cplan is the C++ plan. Under torch.compile (the plan op): cplan is None, (handle, storage) are the
        # op's outputs and the C++ plan is found through the handle when a diagnostic needs it (flatep.ops).
        self._buffer = buffer
        self._cplan = cplan
        self._storage = storage  # device plans: the int32 tensor the plan arrays live in (torch's allocator)
        epn, groups = buffer.experts_per_rank, buffer.num_groups
        self._handle_tensor = handle
        if cplan is None:
            self.num_tokens = num_tokens
            at_slots, at_seqlens = buffer._plan_offsets if buffer.device.type == "cuda" else (0, epn)
            self.slot_expert = storage[at_slots : at_slots + epn]
            self.cu_seqlens = storage[at_seqlens : at_seqlens + groups]
        else:
            self.num_tokens = cplan.num_tokens
            if cplan.on_device:  # views of the plan's own device memory: no copy, no kernel, no synchronisation
                at_slots, at_seqlens = buffer._plan_offsets
                self.slot_expert = storage[at_slots : at_slots + epn]
                self.cu_seqlens = storage[at_seqlens : at_seqlens + groups]
            else:
                self.slot_expert = torch.from_numpy(cplan.slot_expert(buffer.rank))
                self.cu_seqlens = torch.from_numpy(cplan.cu_seqlens(buffer.rank))
                # what a compiled op on this plan takes as storage (flatep.ops: slot_expert then cu_seqlens)
                self._storage = torch.cat([self.slot_expert, self.cu_seqlens]) if _ops.AVAILABLE else None
        self._stats = None
        self._real_rows = None

    @property
    def _handle(self):
        """What the custom ops take (flatep.ops); made at first use, so eager steps, which never need it, keep the
        path they had before torch.compile support (no handle tensor, no registry entry per plan)."""
        if self._handle_tensor is None and self._cplan is not None and _ops.AVAILABLE:
            self._handle_tensor = _ops.plan_handle(self._cplan)
        return self._handle_tensor

    @property
    def _plan(self):
        """The C++ plan."""
        if self._cplan is None:
            self._cplan = _ops.plan_of(self._handle_tensor)
        return self._cplan

    @property
    def generation(self):
        """int: the Buffer's plan counter (identical on every rank for the same step)."""
        return self._plan.generation

    @property
    def placement_epoch(self):
        """int: the static planner: the Buffer's placement_epoch when this plan was made (its slot_expert is that
        placement); 0 for the other planners."""
        return self._plan.placement_epoch

    @property
    def stats(self):
        """dict: loads (list[R] rows each rank computes), loads_before (list[R] without replicas), replicas (total
        replica slots used), P (prefetch makespan: max over ranks of replicas in/out), replicas_in, replicas_out
        (list[R]), entries_total, entries_moved, entries_on_source, max_load_before, max_load_after, min_load_after."""
        if self._stats is None:
            self._stats = self._plan.stats()
        return self._stats

    @property
    def tpe_all(self):
        """[R, E] int32: the all-gathered per-expert entry counts of every rank."""
        return torch.from_numpy(self._plan.tpe_all())

    @property
    def alloc(self):
        """[R, E] int32: entries of expert e computed on rank d."""
        return torch.from_numpy(self._plan.alloc())

    @property
    def entry_ranks(self):
        """[s, K] int32: destination rank of each of this rank's entries (-1: invalid expert id)."""
        return torch.from_numpy(self._plan.entry_ranks())

    @property
    def entry_rows(self):
        """[s, K] int32: destination row of each entry on its destination rank."""
        return torch.from_numpy(self._plan.entry_rows())

    @property
    def real_rows(self):
        """[NvS] bool (CPU): receive rows of this rank that hold an entry (False: padding or unused). On a device
        plan this reads the plan back (a host synchronisation: diagnostics only)."""
        if self._real_rows is None:
            self._real_rows = torch.from_numpy(self._plan.row_heads()) >= 0
        return self._real_rows

    def slot_expert_of(self, rank):
        """[epn] int32 slot_expert of any rank."""
        return torch.from_numpy(self._plan.slot_expert(rank))

    def cu_seqlens_of(self, rank):
        """[num_groups] int32 cu_seqlens of any rank."""
        return torch.from_numpy(self._plan.cu_seqlens(rank))

    def __repr__(self):
        s = self.stats
        return (
            f"flatep.Plan(generation={self.generation}, s={self.num_tokens}, loads={s['loads']}, "
            f"replicas={s['replicas']}, P={s['P']})"
        )


class Buffer:
    """Per-layer EP communication object of this process's rank (collective constructor).

    Args:
        group: torch.distributed process group (None: the default group; when torch.distributed is not initialised,
            a one-rank world). One process per rank; R = the group's size.
        num_tokens (int): S, tokens per rank per step (a call may pass s <= S).
        hidden (int): H, row width in bf16 elements (a multiple of 8).
        num_experts (int): E, a multiple of R.
        topk (int): K, 1..min(32, E).
        align (int): row padding of every non-empty expert group, 1..4096 (1: none).
        capacity_factor (float): 1.0 = exact mode (every rank receives S*K entries); in (1, 4] = slack mode (at most
            ceil(capacity_factor*S*K)).
        planner (str): 'balanced' (default), 'greedy' (the one-donor baseline), 'owner' (no replicas: every entry
            computed on its expert's home rank, no prefetch needed; meant for decode-sized S: the receive capacity is
            the worst case R*S*K rows, so NvS and the receive tensors grow R-fold) or 'static' (a fixed placement of
            replicas, set_placement; each expert's entries split evenly over its copies; the same worst-case
            capacity as 'owner').
        pools (flatep.ExpertPools or None): the expert pools whose weights the plans are for, over the same group and
            device. The Buffer takes their layout: num_slots B and view_stride Q. None, or pools with B = epn: the
            training layout (2*epn groups); serving pools (B < epn): the serving layout (R*Q + B groups, one per row of
            the pools' weights view; see flatep.pools). The plans never use more than B slots.
        device: where tensors live: 'cpu' (the CPU backend, default) or a CUDA device (FlatEP built with CUDA; 'cuda'
            means the current device). Processes may share one GPU.
        timeout_s (float): bound on every cross-rank wait of this object, seconds in (0, 86400]; kept from
            construction on, whatever later objects of the group set. None: the group's transport's timeout at
            construction (FLATEP_TIMEOUT_S or 100 s, unless virtual_ranks or an earlier object set one).
        num_sms (int or None): SM budget of this Buffer's kernels: the most thread blocks one launch of an op uses, in
            [0, 1048576] (0: no cap). None: FLATEP_NUM_SMS (default no cap). Each op also takes num_sms for that
            call only (its backward uses the same), passed to the op's launch: the Buffer's own stays as it is. No
            effect on the CPU backend.
        stream_priority (int): priority of the Buffer's own communication stream ``comm_stream``, created at
            construction on a CUDA device (torch.cuda.Stream's priority: lower is higher, e.g. -1; default 0).

    Attributes: rank, num_ranks, num_tokens, hidden, num_experts, topk, experts_per_rank, capacity (C),
    num_recv_rows (NvS), num_slots (B), view_stride (Q), num_groups (len(cu_seqlens)), serving (B < epn), device, num_sms (the Buffer's budget; 0 = no cap), comm_stream (torch.cuda.Stream; None on
    the CPU backend).

    Streams and events (every op: plan, dispatch, combine, entry_values): ``stream`` (None: the current stream, as
    always; a CUDA stream of the device, e.g. ``buffer.comm_stream``: the op is enqueued there), ``previous_event``
    (a torch.cuda.Event or EventHandle the op is ordered after; None: after the current stream's work so far, which
    is what a side stream then waits for), ``async_finish`` (False: the call is complete in the current stream's
    order, i.e. the current stream waits for the side stream; True: nothing waits and the op returns an
    EventHandle as its last result, whose current_stream_wait() the compute stream calls before using the outputs).
    Tensors crossing streams are record_stream'ed. No host synchronisation; all of it works inside CUDA-graph
    capture (then the side stream must rejoin: current_stream_wait() before the capture ends). The CPU backend runs
    every op synchronously on the host: stream must be None (``comm_stream`` is None there) and an EventHandle's
    event is None (done). Under torch.compile: stream None or comm_stream, no previous_event / async_finish.
    """

    def __init__(
        self,
        group=None,
        num_tokens=None,
        hidden=None,
        num_experts=None,
        topk=None,
        align=128,
        capacity_factor=1.0,
        *,
        planner="balanced",
        pools=None,
        device=None,
        timeout_s=None,
        num_sms=None,
        stream_priority=0,
    ):
        for name, value, accepted in (
            ("num_tokens", num_tokens, "in [1, 2147483647]"),
            ("hidden", hidden, "a multiple of 8 in [8, 2147483640]"),
            ("num_experts", num_experts, "in [1, 2147483647]"),
            ("topk", topk, "in [1, 32]"),
            ("align", align, "in [1, 4096]"),
        ):
            check_int("Buffer", name, value, accepted)
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
            raise ValueError(f"Buffer: capacity_factor must be a float, got {capacity_factor!r}")
        if isinstance(capacity_factor, int) and not 1 <= capacity_factor <= 4:  # an int float() cannot hold
            raise ValueError(f"Buffer: capacity_factor must be in [1, 4], got {capacity_factor}")
        timeout_s = check_timeout("Buffer", timeout_s)
        if planner not in _PLANNERS:
            raise ValueError(f"Buffer: planner must be 'balanced', 'greedy', 'owner' or 'static', got {planner!r}")
        cpools = None if pools is None else getattr(pools, "_pools", None)
        if pools is not None and not isinstance(cpools, _C.ExpertPools):
            raise ValueError(f"Buffer: pools must be a flatep.ExpertPools or None, got {type(pools).__name__}")
        check_num_sms("Buffer", num_sms)  # its type; the C++ checks its value
        check_int("Buffer", "stream_priority", stream_priority, "an int (torch.cuda.Stream priority)")
        self.group = group
        self.rank, self.num_ranks = group_rank_size(group)
        self.num_tokens, self.hidden, self.num_experts, self.topk = num_tokens, hidden, num_experts, topk
        self.align, self.capacity_factor, self.planner = align, float(capacity_factor), planner
        transport = transport_for(group, device, timeout_s)  # validates the device first
        self.device = resolve_device(device)
        if pools is not None and pools.device != self.device:
            raise ValueError(f"Buffer: pools are on {pools.device}, the Buffer on {self.device}")
        self.pools = pools
        with device_guard(self.device):
            self._buffer = _C.Buffer(  # no plan slots: device plans live in torch tensors (plan())
                transport, num_tokens, hidden, num_experts, topk, align, float(capacity_factor), planner, 0, cpools
            )
        self.experts_per_rank = self._buffer.experts_per_rank
        self.num_slots = self._buffer.num_slots
        self.view_stride = self._buffer.view_stride
        self.num_groups = self._buffer.num_groups
        self.serving = self._buffer.serving
        self.capacity = self._buffer.capacity
        self.num_recv_rows = self._buffer.num_recv_rows
        self._plan_words = self._buffer.plan_words
        self._symmetric_views = None  # (recv_x, recv_w) over the symmetric receive region: dispatch(zero_copy=True)
        self._plan_offsets = self._buffer.plan_offsets
        if num_sms is not None:
            self._buffer.num_sms = num_sms
        self.comm_stream = None
        if self.device.type == "cuda":
            _load_torch_kernels(self.device, self._plan_words)
            self.comm_stream = torch.cuda.Stream(self.device, priority=stream_priority)
        self._op_id = _ops.register_object(self) if _ops.AVAILABLE else None

    @property
    def num_sms(self):
        """int: this Buffer's SM budget (thread blocks per launch; 0 = no cap), which every op called without num_sms
        uses. Settable."""
        return self._live("num_sms").num_sms

    @num_sms.setter
    def num_sms(self, value):
        self._live("num_sms").num_sms = check_num_sms("Buffer", value, none_ok=False)

    # ---- the static planner's placement ----

    def set_placement(self, slots):
        """The static planner's placement (collective; docs/design.md §4 "The static planner").

        Args:
            slots: [R, B] expert ids (a list of lists, or an int tensor on any device; B = num_slots, epn in the
                training layout): row d the experts rank d's slots hold, -1 for an empty slot; never rank d's own
                expert, no expert twice in a row. Every rank passes the same.
        From the next plan() on, expert e's entries are split evenly over its copies (its home rank, then the ranks
        whose slots hold it, in ascending rank): floor(T_e / n_e) each, one more for the T_e mod n_e copies from copy
        (e mod n_e) on, cyclically; plan.slot_expert is the placement itself, every step. Move the weights with one
        ExpertPools.prefetch of such a plan (ExpertPools.placement_bytes says how many bytes it copies); the slots
        keep them until another prefetch of the pools. A bad placement raises ValueError naming the entry and its
        value, ranks that pass different placements all raise ValueError naming the first difference; the Buffer
        keeps the placement it had. On a CUDA device the placement is copied to device memory on the current stream
        (no host synchronisation of the step); call it outside CUDA-graph capture: a graph captured before reads the
        new placement in its plan op when replayed.
        """
        words, error = placement_words("set_placement", slots, self.num_ranks, self.num_slots)
        with device_guard(self.device):
            try:
                self._live("set_placement").set_placement(words, stream=stream_handle(self.device))
            except ValueError:
                if error is None:
                    raise
        if error is not None:  # the other ranks were refused too (this rank's words never fit)
            raise ValueError(error)

    @property
    def placement(self):
        """[R, B] int32 tensor (CPU): the placement set last (static planner); None before set_placement."""
        if self._buffer is None or self._buffer.placement_epoch == 0:
            return None
        return torch.tensor(self._buffer.placement, dtype=torch.int32).view(self.num_ranks, self.num_slots)

    @property
    def placement_epoch(self):
        """int: how many set_placement calls took effect (what each plan records as plan.placement_epoch)."""
        return self._live("placement_epoch").placement_epoch

    # ---- public ops ----

    def plan(self, topk_idx, *, stream=None, previous_event=None, async_finish=False, num_sms=None):
        """Plans one step (collective).

        Args:
            topk_idx (torch.Tensor): [s, K] int32 or int64, s <= S; expert ids in [0, E).
            stream, previous_event, async_finish, num_sms: see the class docstring (streams and events).
        Returns:
            Plan (with async_finish: (Plan, EventHandle)). An id outside [0, E) raises ValueError naming the first
            bad id (the entry is skipped): the CPU backend at once; a CUDA buffer, without synchronising, at the entry
            of the first op enqueued after the GPU ran this plan (the GPU writes the error into host-mapped memory),
            at check_status(), or at once with FLATEP_DEBUG=1.
        """
        if self._buffer is None:
            raise RuntimeError("plan: this Buffer was destroyed")
        shape = f"[s, K={self.topk}] with s <= S={self.num_tokens}"
        idx = check_tensor(
            "plan", "topk_idx", topk_idx, (torch.int32, torch.int64), (None, self.topk), self.device, shape
        )
        if idx.shape[0] > self.num_tokens:  # the one message of a bad shape, whichever dimension is off
            raise ValueError(f"plan: topk_idx must have shape {shape}, got {shape_text(idx.shape)}")
        if _ops.compiling():
            code = _ops.stream_code("plan", self, stream, previous_event, async_finish)
            handle, storage = _ops.plan_op(self._op_id, idx, code, check_num_sms("plan", num_sms))
            return Plan(self, None, storage, handle, idx.shape[0])
        if stream is None and previous_event is None and num_sms is None and not async_finish:
            return Plan(self, *self._plan_raw(idx))  # today's path
        with self._launch("plan", stream, previous_event, num_sms) as launch:
            cplan, storage = self._plan_raw(idx, num_sms=launch.num_sms)
        handle = launch.finish(async_finish, (idx,), (storage,))
        plan = Plan(self, cplan, storage)
        return (plan, handle) if async_finish else plan

    def _plan_raw(self, idx, *, num_sms=-1):
        """(C++ plan, storage or None) on the current stream with SM budget num_sms (-1: the Buffer's), no checks of
        idx."""
        with device_guard(self.device):
            b = self._live("plan", collective=True)
            # Device plans live in a tensor of torch's caching allocator (no cudaMalloc in steady state; CUDA-graph
            # capture takes it from the graph's pool), kept alive by the Plan.
            storage = None
            if b.on_device:
                storage = torch.empty(self._plan_words, dtype=torch.int32, device=self.device)
            cplan = b.plan(address(idx), idx.element_size(), idx.shape[0], address(storage),
                           stream=stream_handle(self.device), num_sms=num_sms)
            if not b.on_device:
                b.check_status()  # host backend: reporting now costs no device synchronisation
            return cplan, storage

    def _launch(self, op, stream, previous_event, num_sms):
        """The OpLaunch of one op (stream order, SM budget; see flatep.launch.OpLaunch)."""
        return OpLaunch(self.device, stream, previous_event, check_num_sms(op, num_sms), op)

    def dispatch(self, plan, x, topk_weights=None, *, fp8=False, ue8m0=False, stream=None, previous_event=None,
                 async_finish=False, num_sms=None, zero_copy=False, plan_ordered=False):
        """Sends every token row to the rows of its K experts (collective; autograd-aware).

        Args:
            plan (Plan): from this Buffer's plan().
            x (torch.Tensor): [s, H] bf16 token rows (s = plan.num_tokens).
            topk_weights (torch.Tensor or None): [s, K] fp32 routing weights (None: weight 1).
        Returns:
            recv_x: [NvS, H] bf16, this rank's receive rows grouped by cu_seqlens; padding rows inside a group's padded
                range are zero; rows past the last group end (cu_seqlens[-1]) are unspecified (not written: the cost
                follows the rows moved, not the buffer's capacity).
            recv_w: [NvS] fp32, each row's routing weight; 0 on padding rows; unspecified past the last group end.
            cu_seqlens: [num_groups] int32 (= plan.cu_seqlens).
            With async_finish=True a fourth result, the EventHandle (see the class docstring: streams and events;
            backward runs on the same stream with the same num_sms, complete in the current stream's order).
        Backward: grad_x = unweighted combine of grad_recv_x; grad_topk_weights = grad_recv_w read back at each
        entry's row.

        zero_copy=True (forward only, default stream): recv_x and recv_w are views of this rank's symmetric receive
        region instead of new tensors, so the chain-head rows are not copied out (the same work as the kernels alone).
        They stay valid until this rank's next dispatch on this Buffer (any layer sharing it, the backward's dispatch
        of combine's gradient included): consume them first, as a grouped GEMM or combine in the same stream does.
        Do not write into them: the next zero-copy dispatch leaves padding rows it knows to be zero untouched.
        Autograd must not record the call (x or topk_weights requiring grad raises), since a saved view would be
        overwritten before backward.

        FP8 rows (fp8=True; H must be a multiple of 128): each row moves as H e4m3 bytes plus H/128 fp32 scales, about
        half the bytes of bf16. x is either [s, H] bf16, quantised inside the op by the rule of flatep.fp8 (ue8m0=True:
        power-of-two scales), or a tuple (x_q, x_scales) of already-quantised rows: x_q [s, H] e4m3
        (float8_e4m3fn or uint8), x_scales [s, H/128] fp32, moved as given (ue8m0 is then not used). Returns
        ((recv_q, recv_scales), recv_w, cu_seqlens): recv_q [NvS, H] e4m3 (float8_e4m3fn where torch has it, else
        uint8), recv_scales [NvS, H/128] fp32, in the same rows as bf16's (padding rows: zero bytes, zero scales;
        rows past the last group end not written). Both backends give the same bits. Forward only: with autograd
        recording, x or topk_weights requiring grad raises (detach them or use torch.no_grad()); combine stays bf16,
        and its backward (a dispatch of the output gradient) stays bf16.

        plan_ordered=True (eager inference; every rank alike): the op skips its entry barrier, a wait for the slowest
        rank. The plan op that made ``plan`` already met every rank after its earlier reads of the receive region.
        The caller promises that this is the first op on this Buffer since that plan op, and that whatever read the
        region's rows before (an earlier step's expert FFN on zero_copy rows) ran before that plan op in stream
        order on every rank: flatep.nn.MoE's inference forward (plan, dispatch, experts, combine) passes it.
        """
        if not isinstance(fp8, bool) or not isinstance(ue8m0, bool):
            raise ValueError(f"dispatch: fp8 and ue8m0 must be bools, got fp8={fp8!r}, ue8m0={ue8m0!r}")
        ordered = _check_plan_ordered("dispatch", plan_ordered,
                                      (x, topk_weights) if not isinstance(x, tuple) else (*x, topk_weights))
        if zero_copy is not False:
            return self._dispatch_zero_copy(plan, x, topk_weights, zero_copy, fp8, (stream, previous_event, num_sms),
                                            async_finish, ordered)
        if fp8:
            if _ops.compiling():
                raise ValueError("dispatch: fp8=True is not registered as a custom op yet (eager only)")
            if stream is None and previous_event is None and num_sms is None and not async_finish:
                return self._dispatch_fp8(plan, x, topk_weights, ue8m0, plan_ordered=ordered)
            with self._launch("dispatch", stream, previous_event, num_sms) as launch:
                (recv_q, recv_s), recv_w, cu = self._dispatch_fp8(plan, x, topk_weights, ue8m0, num_sms=launch.num_sms,
                                                                  plan_ordered=ordered)
            reads = (x if isinstance(x, torch.Tensor) else None, topk_weights, plan._storage)
            reads += tuple(x) if isinstance(x, tuple) else ()
            handle = launch.finish(async_finish, reads, (recv_q, recv_s, recv_w))
            return ((recv_q, recv_s), recv_w, cu, handle) if async_finish else ((recv_q, recv_s), recv_w, cu)
        if isinstance(x, tuple):
            raise ValueError("dispatch: x is a tuple (pre-quantised FP8 rows, scales); pass fp8=True")
        self._check_plan("dispatch", plan)
        x = check_tensor(
            "dispatch", "x", x, (torch.bfloat16,), (plan.num_tokens, self.hidden), self.device,
        )
        if topk_weights is not None:
            topk_weights = check_tensor(
                "dispatch", "topk_weights", topk_weights, (torch.float32,), (plan.num_tokens, self.topk), self.device
            )
        if _ops.compiling():
            code = _ops.stream_code("dispatch", self, stream, previous_event, async_finish)
            recv_x, recv_w = _ops.dispatch_op(
                self._op_id, plan._handle, plan._storage, x, topk_weights, True, False, code,
                check_num_sms("dispatch", num_sms),
            )
            return recv_x, recv_w, plan.cu_seqlens
        default = stream is None and previous_event is None and num_sms is None and not async_finish
        launch = None if default else self._launch("dispatch", stream, previous_event, num_sms)
        if _records_grad(x, topk_weights):
            recv_x, recv_w = DispatchFunction.apply(self, plan, x, topk_weights, launch)
        elif default:  # nothing to differentiate: skip autograd's bookkeeping (host time per op)
            recv_x, recv_w = self._dispatch_raw(plan, x, topk_weights, plan_ordered=ordered)
        else:
            with launch:
                recv_x, recv_w = self._dispatch_raw(plan, x, topk_weights, num_sms=launch.num_sms, plan_ordered=ordered)
        if default:
            return recv_x, recv_w, plan.cu_seqlens
        handle = launch.finish(async_finish, (x, topk_weights, plan._storage), (recv_x, recv_w))
        return (recv_x, recv_w, plan.cu_seqlens, handle) if async_finish else (recv_x, recv_w, plan.cu_seqlens)

    def _dispatch_zero_copy(self, plan, x, topk_weights, zero_copy, fp8, stream_args, async_finish, plan_ordered):
        """dispatch(..., zero_copy=True): into the symmetric receive region (see dispatch)."""
        if zero_copy is not True:
            raise ValueError(f"dispatch: zero_copy must be a bool, got {zero_copy!r}")
        if fp8 or async_finish or any(a is not None for a in stream_args) or _ops.compiling():
            raise ValueError("dispatch: zero_copy=True takes no fp8, stream, previous_event, async_finish or num_sms "
                             "(and is eager only)")
        self._check_plan("dispatch", plan)
        x = check_tensor("dispatch", "x", x, (torch.bfloat16,), (plan.num_tokens, self.hidden), self.device)
        if topk_weights is not None:
            topk_weights = check_tensor(
                "dispatch", "topk_weights", topk_weights, (torch.float32,), (plan.num_tokens, self.topk), self.device
            )
        for name, t in (("x", x), ("topk_weights", topk_weights)):
            if t is not None and torch.is_grad_enabled() and t.requires_grad:
                raise ValueError(f"dispatch: zero_copy=True is forward-only (its rows are rewritten by the next "
                                 f"dispatch), but {name} requires grad; detach it or run under torch.no_grad()")
        recv_x, recv_w = self._region_views()
        with device_guard(self.device):
            self._live("dispatch", collective=True).dispatch(plan._plan, address(x), address(topk_weights), address(recv_x),
                                            address(recv_w), stream=stream_handle(self.device), num_sms=-1,
                                            plan_ordered=plan_ordered)
        return recv_x, recv_w, plan.cu_seqlens

    def _region_views(self):
        """(recv_x [NvS, H] bf16, recv_w [NvS] fp32): views of this Buffer's symmetric receive region (made once)."""
        if self._symmetric_views is None:
            x_at, w_at = self._live("dispatch").symmetric_recv
            self._symmetric_views = (
                tensor_at(x_at, (self.num_recv_rows, self.hidden), torch.bfloat16, self.device, self),
                tensor_at(w_at, (self.num_recv_rows,), torch.float32, self.device, self),
            )
        return self._symmetric_views

    def _dispatch_fp8(self, plan, x, topk_weights, ue8m0, *, num_sms=-1, plan_ordered=False):
        """dispatch(..., fp8=True): the checks, then _dispatch_fp8_raw."""
        self._check_plan("dispatch", plan)
        s, H = plan.num_tokens, self.hidden
        if H % _fp8.BLOCK != 0:
            raise ValueError(
                f"dispatch: fp8=True needs hidden (H) to be a multiple of {_fp8.BLOCK} (one scale per {_fp8.BLOCK} "
                f"channels), got H={H}"
            )
        x_q = x_scales = x_bf16 = None
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError(f"dispatch: fp8 x must be a bf16 tensor or a tuple (x_q, x_scales), got a tuple of "
                                 f"{len(x)} items")
            x_q = check_tensor("dispatch", "x_q", x[0], _fp8.E4M3_DTYPES, (s, H), self.device)
            x_scales = check_tensor("dispatch", "x_scales", x[1], (torch.float32,), (s, H // _fp8.BLOCK), self.device)
        else:
            x_bf16 = check_tensor("dispatch", "x", x, (torch.bfloat16,), (s, H), self.device)
        if topk_weights is not None:
            topk_weights = check_tensor(
                "dispatch", "topk_weights", topk_weights, (torch.float32,), (s, self.topk), self.device
            )
        if torch.is_grad_enabled():
            for name, t in (("x", x_bf16), ("x_scales", x_scales), ("topk_weights", topk_weights)):
                if t is not None and t.requires_grad:
                    raise ValueError(
                        f"dispatch: fp8=True is forward-only (no autograd), but {name} requires grad; detach it or "
                        "run under torch.no_grad()"
                    )
        return self._dispatch_fp8_raw(plan, x_bf16, x_q, x_scales, topk_weights, ue8m0, num_sms=num_sms,
                                      plan_ordered=plan_ordered)

    def _dispatch_fp8_raw(self, plan, x_bf16, x_q, x_scales, topk_weights, ue8m0=False, *, num_sms=-1,
                          plan_ordered=False):
        """FP8 dispatch without checks beyond the plan (no autograd): exactly one of x_bf16 [s, H] bf16 or (x_q [s, H]
        e4m3, x_scales [s, H/128] fp32), contiguous on this Buffer's device. Returns ((recv_q, recv_scales), recv_w,
        cu_seqlens) as dispatch(..., fp8=True)."""
        recv_q = torch.empty(self.num_recv_rows, self.hidden, dtype=torch.uint8, device=self.device)
        recv_scales = torch.empty(self.num_recv_rows, self.hidden // _fp8.BLOCK, dtype=torch.float32,
                                  device=self.device)
        recv_w = torch.empty(self.num_recv_rows, dtype=torch.float32, device=self.device)
        with device_guard(self.device):
            self._live("dispatch", collective=True).dispatch_fp8(
                plan._plan, address(x_bf16), address(x_q), address(x_scales), address(topk_weights), address(recv_q),
                address(recv_scales), address(recv_w), ue8m0, stream=stream_handle(self.device), num_sms=num_sms,
                plan_ordered=plan_ordered,
            )
        return (_fp8.as_e4m3(recv_q), recv_scales), recv_w, plan.cu_seqlens

    def combine(self, plan, y, weights=None, *, stream=None, previous_event=None, async_finish=False, num_sms=None,
                plan_ordered=False):
        """Sums each token's K expert-output rows back on its source rank (collective; autograd-aware).

        Args:
            plan (Plan): the plan the rows were dispatched with.
            y (torch.Tensor): [NvS, H] bf16 expert outputs (rows past the last group end are ignored).
            weights (torch.Tensor or None): [NvS] fp32 per-row weights (e.g. dispatch's recv_w) or None (unweighted).
        Returns:
            out: [s, H] bf16, out[t] = sum_k weight_row * y_row over token t's K rows (fp32 sums, design §6).
            With async_finish=True: (out, EventHandle) (see the class docstring: streams and events).
        Backward: grad_y = dispatch of grad_out times the row weight; grad_weights = <dispatched grad_out row, y row>.

        plan_ordered=True (eager inference; every rank alike): the op skips its entry barrier. This step's plan op and
        dispatch already met every rank after its previous combine read the partials; the caller promises that no
        other op ran on this Buffer between that dispatch and this combine (flatep.nn.MoE's inference forward).
        """
        ordered = _check_plan_ordered("combine", plan_ordered, (y, weights))
        self._check_plan("combine", plan)
        y = check_tensor("combine", "y", y, (torch.bfloat16,), (self.num_recv_rows, self.hidden), self.device)
        if weights is not None:
            weights = check_tensor("combine", "weights", weights, (torch.float32,), (self.num_recv_rows,), self.device)
        if _ops.compiling():
            code = _ops.stream_code("combine", self, stream, previous_event, async_finish)
            return _ops.combine_op(
                self._op_id, plan._handle, plan._storage, plan.num_tokens, y, weights, code,
                check_num_sms("combine", num_sms),
            )
        default = stream is None and previous_event is None and num_sms is None and not async_finish
        launch = None if default else self._launch("combine", stream, previous_event, num_sms)
        if _records_grad(y, weights):
            out = CombineFunction.apply(self, plan, y, weights, launch)
        elif default:
            return self._combine_raw(plan, y, weights, plan_ordered=ordered)
        else:
            with launch:
                out = self._combine_raw(plan, y, weights, num_sms=launch.num_sms, plan_ordered=ordered)
        if default:
            return out
        handle = launch.finish(async_finish, (y, weights, plan._storage), (out,))
        return (out, handle) if async_finish else out

    def entry_values(self, plan, row_values, *, stream=None, previous_event=None, async_finish=False, num_sms=None):
        """The reverse path of one fp32 per receive row (collective; not differentiable).

        Args:
            row_values (torch.Tensor): [NvS] fp32, one value per receive row of this rank.
        Returns:
            [s, K] fp32: for each of this rank's entries (t, k), the value at its row on its destination rank
            (0 for an invalid expert id). With async_finish=True: (out, EventHandle).
        """
        self._check_plan("entry_values", plan)
        row_values = check_tensor(
            "entry_values", "row_values", row_values, (torch.float32,), (self.num_recv_rows,), self.device
        )
        if _ops.compiling():
            code = _ops.stream_code("entry_values", self, stream, previous_event, async_finish)
            return _ops.entry_values_op(
                self._op_id, plan._handle, plan._storage, plan.num_tokens, row_values, code,
                check_num_sms("entry_values", num_sms),
            )
        if stream is None and previous_event is None and num_sms is None and not async_finish:
            return self._entry_values_raw(plan, row_values)
        with self._launch("entry_values", stream, previous_event, num_sms) as launch:
            out = self._entry_values_raw(plan, row_values, num_sms=launch.num_sms)
        handle = launch.finish(async_finish, (row_values, plan._storage), (out,))
        return (out, handle) if async_finish else out

    def destroy(self):
        """Releases the symmetric buffer (local, never collective). Later calls raise RuntimeError; views returned by
        dispatch(zero_copy=True) must not be used after it."""
        self._buffer = None
        self._symmetric_views = None

    def __repr__(self):
        return (
            f"flatep.Buffer(R={self.num_ranks}, rank={self.rank}, S={self.num_tokens}, H={self.hidden}, "
            f"E={self.num_experts}, K={self.topk}, align={self.align}, capacity_factor={self.capacity_factor}, "
            f"planner={self.planner!r}, num_slots={self.num_slots}, NvS={self.num_recv_rows})"
        )

    # ---- raw ops (no checks beyond the plan, no autograd): used by the autograd functions ----

    def _live(self, op, collective=False):
        """The C++ buffer (RuntimeError naming op once destroyed). Call its ops inside device_guard(self.device), with
        stream=stream_handle(self.device) and the call's num_sms: the kernels launch on the current device.
        collective: the call enqueues a collective op (virtual ranks on their own threads first meet on the host:
        flatep.virtual.arrive)."""
        if self._buffer is None:
            raise RuntimeError(f"{op}: this Buffer was destroyed")
        if collective:
            _virtual_arrive(self.group, op)
        return self._buffer

    def check_status(self):
        """Raises the first error an op recorded since the last check (an invalid expert id: ValueError naming it; a
        timed-out wait: RuntimeError). On a CUDA device this waits for the current stream (a synchronising point)."""
        with device_guard(self.device):
            self._live("check_status").check_status(stream=stream_handle(self.device))

    def _check_plan(self, op, plan):
        if self._buffer is None:
            raise RuntimeError(f"{op}: this Buffer was destroyed")
        if not isinstance(plan, Plan):
            raise ValueError(f"{op}: plan must be a flatep.Plan from Buffer.plan(), got {type(plan).__name__}")
        if plan._buffer is not self:
            raise ValueError(f"{op}: plan was made by another Buffer; use the plan of this Buffer")

    def _dispatch_raw(self, plan, x, topk_weights, want_weights=True, zero_fill=False, *, num_sms=-1,
                      plan_ordered=False):
        """Rows past the last group end stay unspecified (dispatch does not write them) unless zero_fill=True (for a
        gradient, which must be defined on every row). num_sms: the call's SM budget (-1: the Buffer's), as every raw
        op takes it."""
        alloc = torch.zeros if zero_fill else torch.empty
        recv_x = alloc(self.num_recv_rows, self.hidden, dtype=torch.bfloat16, device=self.device)
        recv_w = alloc(self.num_recv_rows, dtype=torch.float32, device=self.device) if want_weights else None
        with device_guard(self.device):
            self._live("dispatch", collective=True).dispatch(
                plan._plan, address(x), address(topk_weights), address(recv_x), address(recv_w),
                stream=stream_handle(self.device), num_sms=num_sms, plan_ordered=plan_ordered,
            )
        return recv_x, recv_w

    def _combine_raw(self, plan, y, weights, *, num_sms=-1, plan_ordered=False):
        out = torch.empty(plan.num_tokens, self.hidden, dtype=torch.bfloat16, device=self.device)
        with device_guard(self.device):
            self._live("combine", collective=True).combine(plan._plan, address(y), address(weights), address(out),
                                          stream=stream_handle(self.device), num_sms=num_sms, plan_ordered=plan_ordered)
        return out

    def _combine_grad_raw(self, plan, rows, y, weights, want_grad_y=True, want_grad_weights=True, *, num_sms=-1):
        """The local rest of a weighted combine's backward (no collective, no autograd). rows: [NvS, H] bf16, the
        output gradient dispatched back to the rows; y: [NvS, H] bf16 and weights: [NvS] fp32, the forward combine's
        inputs (all contiguous, on this Buffer's device). Returns (grad_y [NvS, H] bf16 = bf16(rows * weights) per
        row, grad_weights [NvS] fp32 = <rows, y> per row in a fixed fp32 order, bitwise equal on both backends), None
        for an output not wanted. Rows that hold no entry (padding, past the last group end) get zeros and their y is
        never read."""
        grad_y = torch.empty_like(rows) if want_grad_y else None
        grad_weights = (
            torch.empty(self.num_recv_rows, dtype=torch.float32, device=self.device) if want_grad_weights else None
        )
        with device_guard(self.device):
            self._live("combine_grad").combine_grad(
                plan._plan, address(rows), address(y), address(weights), address(grad_y), address(grad_weights),
                stream=stream_handle(self.device), num_sms=num_sms,
            )
        return grad_y, grad_weights

    def _combine_backward_raw(self, plan, grad_out, y, weights, want_grad_y=True, want_grad_weights=True, *,
                              num_sms=-1):
        """A weighted combine's backward (collective, no autograd): grad_out [s, H] bf16 dispatched back to the rows,
        then combine_grad on them (see _combine_grad_raw) -> (grad_y, grad_weights), the same bits as a dispatch into
        a tensor of its own followed by combine_grad. The rows land in the symmetric receive region (zero copy) and
        combine_grad reads them there, enqueued right after on the same stream, before any later op of this Buffer
        can rewrite the region (every op of a Buffer is ordered after the previous one, design §3). Against a
        dispatch into a tensor of its own, the fan-out copies only the duplicate rows (a token's rows after the first
        on a rank) instead of every row, no [NvS, H] tensor is allocated, and combine_grad reads the rows the push
        wrote."""
        rows = self._dispatch_region_raw(plan, grad_out, num_sms=num_sms)
        return self._combine_grad_raw(plan, rows, y, weights, want_grad_y, want_grad_weights, num_sms=num_sms)

    def _dispatch_region_raw(self, plan, x, *, num_sms=-1):
        """Dispatch of x [s, H] bf16 (no weights) into the symmetric receive region; returns the region's [NvS, H]
        view, valid until the next op of this Buffer rewrites it (rows past the last group end not written)."""
        rows, _ = self._region_views()
        with device_guard(self.device):
            self._live("dispatch", collective=True).dispatch(plan._plan, address(x), address(None), address(rows), address(None),
                                            stream=stream_handle(self.device), num_sms=num_sms)
        return rows

    def _entry_values_raw(self, plan, row_values, *, num_sms=-1):
        out = torch.empty(plan.num_tokens, self.topk, dtype=torch.float32, device=self.device)
        with device_guard(self.device):
            self._live("entry_values", collective=True).entry_values(plan._plan, address(row_values), address(out),
                                                    stream=stream_handle(self.device), num_sms=num_sms)
        return out


_shared = {}  # (group id, construction arguments, device) -> (group, Buffer); the group is kept alive with it


def _same_float(value):
    """capacity_factor as the Buffer keeps it: an int or float as a float (1 and 1.0 are one Buffer); anything else as
    given (the constructor refuses it)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def shared_buffer(group, num_tokens, hidden, num_experts, topk, align=128, capacity_factor=1.0, *,
                  planner="balanced", pools=None, device=None, num_sms=None, stream_priority=0):
    """The process's Buffer for these arguments, created on first use (collective then), like shared_pools: layers of
    one shape share one Buffer, so communication memory does not grow with the number of layers (a Buffer made for
    serving pools is shared by the layers of those pools: the Buffer keeps them alive). Safe because a Plan
    owns its arrays and the symmetric buffer is scratch that every op rewrites (design §8): plans of several layers,
    all made by the one Buffer, stay valid together (backward reuses each layer's saved plan). Arguments that the
    Buffer takes as the same value share it (device None and 'cpu', capacity_factor 1 and 1.0); any other difference
    gets a Buffer of its own, and an argument the Buffer refuses raises its ValueError whatever is cached."""
    key = (id(group),) + cache_key(num_tokens, hidden, num_experts, topk, align, _same_float(capacity_factor), planner,
                                   id(pools), str(resolve_device(device)), num_sms, stream_priority)
    entry = _shared.get(key)
    if entry is None:
        buffer = Buffer(group, num_tokens, hidden, num_experts, topk, align, capacity_factor, planner=planner,
                        pools=pools, device=device, num_sms=num_sms, stream_priority=stream_priority)
        entry = (group, buffer)
        _shared[key] = entry
    return entry[1]


def release_shared_buffers():
    """Drops the process's shared Buffers (their memory is freed once no layer or plan holds them)."""
    _shared.clear()

