"""Bootstraps and transports: how a torch.distributed group becomes FlatEP's multi-process `ipc` transport.

FlatEP runs one process per EP rank. Its `ipc` transport shares symmetric memory between the processes (memfds for
host memory; CUDA VMM handles for device memory) and needs only a small all-gather to start, which
:class:`TorchBootstrap` provides through ``torch.distributed.all_gather_object`` on the caller's group (any backend;
gloo on CPU). Every process of the group must create its FlatEP objects in the same order (they are collective).
"""

import contextlib
import datetime
import threading
import time

import torch
import torch.distributed as dist

from . import _C
from ._bootstrap import OwnTransportGroup, PeerTimeout
from ._tensors import check_timeout, number_text

_ARRIVAL_TAG = 0x464C  # "FL": the tag of TorchBootstrap's arrival messages


def _first_line(error):
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _rank_list(ranks):
    return ", ".join(f"rank {r}" for r in sorted(ranks))


def _global_rank(group, rank):
    """The default group's rank of `group`'s rank `rank` (what torch.distributed's point-to-point calls take)."""
    if group is None or group is dist.group.WORLD:
        return rank
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank  # torch < 2.0
    return get(group, rank)


class TorchBootstrap(_C.Bootstrap):
    """flatep._C.Bootstrap over a torch.distributed process group (None: the default group).

    On a gloo group every all_gather first checks that each peer arrived: one tagged point-to-point message to and
    from every peer, each waited for until `timeout_s` (default FLATEP_TIMEOUT_S) has passed. A peer that left the job
    or stalls is then named on one line (a PeerTimeout, which flatep._C turns into the library's timeout error)
    within the timeout, instead of a gloo stack from deep inside all_gather_object or a wait as long as the group's
    own timeout (30 min by default). Other backends go straight to all_gather_object; its errors are one line too."""

    def __init__(self, group=None, timeout_s=None):
        super().__init__()
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._check_peers = dist.get_backend(group) == "gloo"
        self.timeout_s = _C.env_timeout_s() if timeout_s is None else timeout_s
        self._num_calls = 0

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def all_gather(self, blob):
        what = f"torch.distributed bootstrap all_gather #{self._num_calls} on rank {self._rank}"
        self._num_calls += 1
        if self._check_peers and self._size > 1:
            self._wait_for_peers(what)
        out = [None] * self._size
        try:
            dist.all_gather_object(out, bytes(blob), group=self.group)
        except RuntimeError as e:
            raise PeerTimeout(f"{what}: all_gather_object failed: {_first_line(e)}") from None
        return out

    def _wait_for_peers(self, what):
        """Raises PeerTimeout naming every peer that did not arrive within timeout_s or left the job."""
        token = torch.zeros(1, dtype=torch.uint8)
        timed_out, left = [], []

        def failed(peer, error):  # gloo: "Timed out waiting ..." or the connection closed / reset by the peer
            (timed_out if "timed out" in str(error).lower() else left).append(peer)

        works = []
        for peer in range(self._size):
            if peer == self._rank:
                continue
            dst = _global_rank(self.group, peer)
            try:  # posting fails at once when gloo already saw the peer's connection close
                works.append((peer, dist.irecv(torch.zeros(1, dtype=torch.uint8), dst, self.group, _ARRIVAL_TAG)))
                works.append((peer, dist.isend(token, dst, self.group, _ARRIVAL_TAG)))  # done once the peer receives
            except RuntimeError as e:
                failed(peer, e)
        deadline = time.monotonic() + self.timeout_s
        for peer, work in works:
            if peer in timed_out or peer in left:
                continue
            try:
                if not work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))):
                    failed(peer, "timed out")  # a backend that reports a timeout by returning False
            except RuntimeError as e:
                failed(peer, e)
        if not timed_out and not left:
            return
        problems = []  # worded as the C++ socket mesh's (src/transport/ipc_socket.cpp)
        if timed_out:
            problems.append(f"{_rank_list(timed_out)} did not arrive within {number_text(self.timeout_s)} s")
        if left:
            problems.append(f"{_rank_list(left)} left the job (connection closed) without arriving")
        raise PeerTimeout(f"{what}: {'; '.join(problems)}")


class SingleProcessBootstrap(_C.Bootstrap):
    """A world of one rank (torch.distributed not initialised and no group given)."""

    def rank(self):
        return 0

    def size(self):
        return 1

    def all_gather(self, blob):
        return [bytes(blob)]


def resolve_device(device):
    """torch.device of `device` (None: the CPU); a CUDA device without an index becomes the current CUDA device, so
    that 'cuda' and 'cuda:<current>' name the same transport and pools."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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


def group_rank_size(group):
    """(rank, size) of `group`; (0, 1) when group is None and torch.distributed is not initialised."""
    if _is_virtual(group):
        return group.rank, group.size
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


_lock = threading.Lock()
_transports = {}


def _is_virtual(group):
    """True for a group that brings its own transport (a flatep.virtual.VirtualRank)."""
    return isinstance(group, OwnTransportGroup)


def transport_for(group=None, device=None, timeout_s=None):
    """The process's ipc transport for `group` and memory kind of `device` (created on first use, collectively,
    then cached: every FlatEP object of the group shares it). A flatep.virtual.VirtualRank brings its own. timeout_s:
    seconds in (0, 86400] (None: keep the transport's, at first FLATEP_TIMEOUT_S)."""
    timeout_s = check_timeout("transport_for", timeout_s)
    if _is_virtual(group):
        wanted = resolve_device(torch.device("cpu") if device is None else torch.device(device))
        if wanted != group.device:
            raise ValueError(f"device {wanted} differs from the virtual rank's device {group.device}")
        if timeout_s is not None:
            group.transport.timeout_s = timeout_s
        return group.transport
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device}")
    memory = "host" if device.type == "cpu" else "device"
    if memory == "device" and not _C.has_cuda:
        raise ValueError(
            f"device {device} needs FlatEP built with CUDA; this build has the CPU backend only (use device='cpu')"
        )
    if memory == "device" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: no CUDA device is usable here (torch.cuda.is_available() is False)")
    device = resolve_device(device)
    single = group is None and not (dist.is_available() and dist.is_initialized())
    key = ("single" if single else id(group if group is not None else dist.group.WORLD), str(device))
    with _lock:
        entry = _transports.get(key)
        if entry is None:
            bootstrap = SingleProcessBootstrap() if single else TorchBootstrap(group, timeout_s)
            index = device.index if memory == "device" else -1  # the transport binds that GPU's context itself
            transport = _C.make_ipc_transport(
                bootstrap, memory, 0.0 if timeout_s is None else timeout_s, device=index
            )
            entry = (group, bootstrap, transport)  # keep the group object alive: its id is the key
            _transports[key] = entry
    bootstrap, transport = entry[1], entry[2]
    if timeout_s is not None:
        transport.timeout_s = timeout_s
        bootstrap.timeout_s = timeout_s  # the bootstrap's waits (every later constructor's agreement) follow it
    return transport


def release_transports():
    """Drops the cached transports (objects still using one keep it alive). Call before destroy_process_group."""
    with _lock:
        _transports.clear()


# ---- streams and events (design §3 "Streams and events") ----


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


def check_num_sms(op, num_sms, none_ok=True):
    """`num_sms` (an SM budget: the most thread blocks one kernel launch uses; 0 = no cap) when valid; None when
    none_ok. A one-line ValueError otherwise."""
    if num_sms is None and none_ok:
        return None
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or not 0 <= num_sms <= _MAX_SM_BUDGET:
        raise ValueError(
            f"{op}: num_sms must be an int in [0, {_MAX_SM_BUDGET}] (thread blocks per launch; 0 = no cap)"
            f"{' or None' if none_ok else ''}, got {num_sms!r}"
        )
    return num_sms


_MAX_SM_BUDGET = 1 << 20  # flatep::env::kMaxSmBudget


class OpLaunch:
    """Where one op runs and with which SM budget: a context manager around the op's body, then finish().

    stream None (or the current stream): the op runs on the current stream, after previous_event when given. Another
    stream: that stream first waits for previous_event when given, else for the current stream (so inputs made on it
    are ready), and the body runs inside ``torch.cuda.stream(stream)`` (its allocations belong to that stream).
    finish(async_finish, reads, writes): on a side stream, record_stream on the tensors the op read (op stream) and
    wrote (current stream); then with async_finish an EventHandle (event recorded on the op stream); without it the
    current stream waits for the side stream (so the call is complete in the current stream's order, as today).
    blocks: the SM budget set on `target` (a C++ Buffer / ExpertPools) for the body, restored after."""

    __slots__ = ("device", "side", "caller", "target", "blocks", "_saved", "_scope")

    def __init__(self, device, target, stream=None, previous_event=None, blocks=None, op="op"):
        self.device, self.target, self.blocks = device, target, blocks
        self.side = self.caller = self._scope = None
        self._saved = None
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
        if self.blocks is not None:
            self._saved = self.target.max_blocks
            if self._saved != self.blocks:
                self.target.max_blocks = self.blocks
        if self.side is not None:
            self._scope = torch.cuda.stream(self.side)
            self._scope.__enter__()
        return self

    def __exit__(self, *exc):
        if self._scope is not None:
            self._scope.__exit__(*exc)
            self._scope = None
        if self._saved is not None and self._saved != self.blocks:
            self.target.max_blocks = self._saved
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
