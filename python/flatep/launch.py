"""Where one op runs: the device, the stream, the events it is ordered by and the SM budget of the call (design §3
"Streams and events").

Every op of Buffer and ExpertPools hands the C++ call its stream and SM budget as arguments (``stream=``: the
cudaStream_t, an int, 0 on the CPU backend; ``num_sms=``: -1 for the object's own budget), read at the time of the
call: the current stream (inside an :class:`OpLaunch` on a side stream: that stream) and the call's ``num_sms``. No op
changes the object's state to pass them.
"""

import contextlib

import torch

from ._tensors import INT32_MAX

#: The largest SM budget the C++ runtime accepts (flatep::kMaxNumSms), for messages only: the C++ checks the value.
MAX_NUM_SMS = 1 << 20

_NULL_GUARD = contextlib.nullcontext()


def device_guard(device):
    """Context manager making `device` the current CUDA device (a no-op for the CPU, and when it is current already:
    the common case, kept cheap because every op of a step passes here)."""
    if device.type != "cuda" or torch.cuda.current_device() == device.index:
        return _NULL_GUARD
    return torch.cuda.device(device)


if hasattr(torch._C, "_cuda_getCurrentRawStream"):

    def current_stream_handle(device):
        """The cudaStream_t (an int) of torch's current stream on `device`, without building a torch Stream."""
        return torch._C._cuda_getCurrentRawStream(device.index)

else:  # older torch: through the Stream object

    def current_stream_handle(device):
        return torch.cuda.current_stream(device).cuda_stream


def stream_handle(device):
    """The `stream` argument of a C++ op on `device` now: torch's current stream there (a cudaStream_t as an int); 0 on
    the CPU backend, whose ops run synchronously on the calling thread."""
    return current_stream_handle(device) if device.type == "cuda" else 0


def check_num_sms(op, num_sms, none_ok=True):
    """The int the C++ call takes as `num_sms`: -1 (the object's num_sms) for None when none_ok, else `num_sms` itself
    when it is an int that a C int holds. Its value is the C++ runtime's to check (-1 or [0, MAX_NUM_SMS] for a call,
    [0, MAX_NUM_SMS] for an object's budget; a one-line ValueError naming op). Anything else: a one-line ValueError
    here (pybind11's would be a multi-line TypeError)."""
    if num_sms is None and none_ok:
        return -1
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or not -INT32_MAX - 1 <= num_sms <= INT32_MAX:
        raise ValueError(
            f"{op}: num_sms must be an int in [0, {MAX_NUM_SMS}] (the most thread blocks one launch uses; 0 = no cap)"
            f"{' or None' if none_ok else ''}, got {num_sms!r}"
        )
    return num_sms


def check_stream(op, stream, device):
    """`stream` when it is None or a CUDA stream of `device`; a one-line ValueError otherwise (the CPU backend takes
    only None: its ops run on the host, synchronously)."""
    if stream is None:
        return None
    if device.type != "cuda":
        raise ValueError(
            f"{op}: stream must be None on the CPU backend (its ops run synchronously on the host), got "
            f"{type(stream).__name__}"
        )
    is_stream = isinstance(stream, torch.cuda.Stream) or (hasattr(torch, "Stream") and isinstance(stream, torch.Stream))
    if not is_stream or getattr(stream, "device", device) != device:
        where = getattr(stream, "device", None)
        raise ValueError(f"{op}: stream must be a CUDA stream of {device}, got {type(stream).__name__} on {where}")
    return stream


class EventHandle:
    """Completion of one FlatEP op that was enqueued with ``async_finish=True`` (DeepEP's EventOverlap, in spirit).

    Attributes:
        event (torch.cuda.Event or None): recorded on the op's stream right after the op (inside CUDA-graph capture
            too: then it is a node of the graph). None on the CPU backend, whose ops have finished when they return.
        stream (torch.cuda.Stream or None): the stream the op was enqueued on.

    current_stream_wait() makes the caller's current stream wait for the op (no host synchronisation): call it before
    the compute stream uses the op's outputs, and before a CUDA-graph capture ends (a side stream must rejoin the
    capturing stream). wait() blocks the host until the op finished: diagnostics only (a host synchronisation; not
    allowed while capturing). Tensors the op reads or writes on the other stream are kept alive by the caching
    allocator (Tensor.record_stream), so dropping them, or the handle, before the op finishes is safe.
    """

    __slots__ = ("event", "stream", "device")

    def __init__(self, event=None, stream=None, device=None):
        self.event, self.stream, self.device = event, stream, device

    def current_stream_wait(self):
        """The current stream (of the op's device) waits for the op; a no-op on the CPU backend."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def wait(self):
        """Blocks the host until the op finished (diagnostics; a host synchronisation). A no-op on the CPU backend."""
        if self.event is not None:
            self.event.synchronize()

    def query(self):
        """True when the op finished (no synchronisation)."""
        return True if self.event is None else self.event.query()

    def __repr__(self):
        return f"flatep.EventHandle({'done (CPU backend)' if self.event is None else self.event})"


def _event_of(op, previous_event, device):
    if previous_event is None:
        return None
    if isinstance(previous_event, EventHandle):
        return previous_event.event
    if device.type == "cuda" and isinstance(previous_event, torch.cuda.Event):
        return previous_event
    raise ValueError(
        f"{op}: previous_event must be None, a flatep EventHandle or a torch.cuda.Event, got "
        f"{type(previous_event).__name__}"
    )


class OpLaunch:
    """Where one op runs: a context manager around the op's body, then finish().

    stream None (or the current stream): the op runs on the current stream, after previous_event when given. Another
    stream: that stream first waits for previous_event when given, else for the current stream (so inputs made on it
    are ready), and the body runs inside ``torch.cuda.stream(stream)`` (its allocations belong to that stream, and
    stream_handle() names it to the C++ calls).
    finish(async_finish, reads, writes): on a side stream, record_stream on the tensors the op read (op stream) and
    wrote (current stream); then with async_finish an EventHandle (event recorded on the op stream); without it the
    current stream waits for the side stream (so the call is complete in the current stream's order, as today).
    num_sms: the call's SM budget, as check_num_sms returns it (-1: the object's); the body passes it to every C++
    call it makes (the object's own budget is never changed)."""

    __slots__ = ("device", "side", "caller", "num_sms", "_scope")

    def __init__(self, device, stream=None, previous_event=None, num_sms=-1, op="op"):
        self.device, self.num_sms = device, num_sms
        self.side = self.caller = self._scope = None
        event = _event_of(op, previous_event, device)
        stream = check_stream(op, stream, device)
        if device.type != "cuda":
            return
        caller = torch.cuda.current_stream(device)
        self.caller = caller
        if stream is None or stream == caller:
            if event is not None:
                caller.wait_event(event)
            return
        if event is not None:
            stream.wait_event(event)
        else:
            stream.wait_stream(caller)
        self.side = stream

    def __enter__(self):
        if self.side is not None:
            self._scope = torch.cuda.stream(self.side)
            self._scope.__enter__()
        return self

    def __exit__(self, *exc):
        if self._scope is not None:
            self._scope.__exit__(*exc)
            self._scope = None
        return False

    def finish(self, async_finish=False, reads=(), writes=()):
        side = self.side
        if side is not None:
            for t in reads:
                if t is not None and t.is_cuda:
                    t.record_stream(side)
            for t in writes:
                if t is not None and t.is_cuda:
                    t.record_stream(self.caller)
        if async_finish:
            if self.device.type != "cuda":
                return EventHandle(None, None, self.device)
            stream = side if side is not None else self.caller
            event = torch.cuda.Event()
            event.record(stream)
            return EventHandle(event, stream, self.device)
        if side is not None:
            self.caller.wait_stream(side)
        return None


def num_sms_of(launch):
    """The SM budget a raw op inside `launch` (an OpLaunch or None: the default path) passes to C++."""
    return -1 if launch is None else launch.num_sms
