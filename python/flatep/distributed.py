"""Bootstraps and transports: how a torch.distributed group becomes FlatEP's multi-process `ipc` transport.

FlatEP runs one process per EP rank. Its `ipc` transport shares symmetric memory between the processes (memfds for
host memory; CUDA VMM handles for device memory) and needs only a small all-gather to start, which
:class:`TorchBootstrap` provides through ``torch.distributed.all_gather_object`` on the caller's group (any backend;
gloo on CPU). Every process of the group must create its FlatEP objects in the same order (they are collective).
"""

import datetime
import threading
import time

import torch
import torch.distributed as dist

from . import _C
from ._bootstrap import OwnTransportGroup, PeerTimeout
from ._tensors import check_timeout, number_text

# Stream and launch plumbing lives in flatep.launch; its names stay importable from here.
from .launch import (  # noqa: F401
    EventHandle, OpLaunch, check_num_sms, check_stream, current_stream_handle, device_guard,
)

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
