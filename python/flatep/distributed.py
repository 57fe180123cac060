"""Bootstraps and transports: how a torch.distributed group becomes FlatEP's multi-process `ipc` transport.

FlatEP runs one process per EP rank. Its `ipc` transport shares symmetric memory between the processes (memfds for
host memory; CUDA VMM handles for device memory) and needs only a small all-gather to start, which
:class:`TorchBootstrap` provides through ``torch.distributed.all_gather_object`` on the caller's group (any backend;
gloo on CPU). Every process of the group must create its FlatEP objects in the same order (they are collective).
"""

import contextlib
import threading

import torch
import torch.distributed as dist

from . import _C


class TorchBootstrap(_C.Bootstrap):
    """flatep._C.Bootstrap over a torch.distributed process group (None: the default group)."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def all_gather(self, blob):
        out = [None] * self._size
        dist.all_gather_object(out, bytes(blob), group=self.group)
        return out


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


def device_guard(device):
    """Context manager making `device` the current CUDA device (a no-op for the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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
    from .virtual import VirtualRank

    return isinstance(group, VirtualRank)


def transport_for(group=None, device=None, timeout_s=None):
    """The process's ipc transport for `group` and memory kind of `device` (created on first use, collectively,
    then cached: every FlatEP object of the group shares it). A flatep.virtual.VirtualRank brings its own."""
    if _is_virtual(group):
        wanted = resolve_device(torch.device("cpu") if device is None else torch.device(device))
        if wanted != group.device:
            raise ValueError(f"device {wanted} differs from the virtual rank's device {group.device}")
        if timeout_s is not None:
            group.transport.timeout_s = float(timeout_s)
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
            bootstrap = SingleProcessBootstrap() if single else TorchBootstrap(group)
            with device_guard(device):  # device regions live on the current device
                if memory == "device":
                    # The transport adopts the thread's current CUDA context: make it torch's (the primary context of
                    # `device`), which a device guard alone does not create.
                    torch.empty(1, device=device)
                transport = _C.make_ipc_transport(bootstrap, memory, 0.0)
            entry = (group, bootstrap, transport)  # keep the group object alive: its id is the key
            _transports[key] = entry
    transport = entry[2]
    if timeout_s is not None:
        transport.timeout_s = float(timeout_s)
    return transport


def release_transports():
    """Drops the cached transports (objects still using one keep it alive). Call before destroy_process_group."""
    with _lock:
        _transports.clear()
