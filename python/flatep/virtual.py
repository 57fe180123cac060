"""Virtual ranks: R FlatEP ranks in one process (for benchmarks and tests on one GPU or on the CPU).

Production runs one process per rank (torch.distributed). Here the R ranks are threads of one process that share an
``ipc`` transport world built through an in-process all-gather, so every Buffer / ExpertPools op is the real one:

    ranks = flatep.virtual.virtual_ranks(8, device="cuda")       # collective set-up, done on R threads
    buffers = flatep.virtual.run_threads(8, lambda r: flatep.Buffer(ranks[r], S, H, E, K, device="cuda"))
    plans = [buffers[r].plan(idx[r]) for r in range(8)]          # CUDA: each call only enqueues (use one stream
                                                                 # per rank); CPU: use run_threads, ops block

A :class:`VirtualRank` stands where a torch.distributed group goes (``Buffer(group=...)``,
``ExpertPools(group, ...)``). Constructors are collective, so they must run on R threads at once (run_threads), any
threads: each transport binds its GPU's context itself. On a CUDA device the ops never block the host, so one thread
may enqueue every rank's op, each on its own stream. Two settings of CUDA, read when CUDA starts, make that safe, and
importing this module before CUDA starts sets both unless they are set:

* CUDA_DEVICE_MAX_CONNECTIONS=32 (CUDA's default is 8): the ranks' streams must not share a hardware queue, since a
  rank's kernel may spin for a peer's.
* CUDA_MODULE_LOADING=EAGER (torch's default is LAZY): under lazy loading the first launch of any kernel (your
  model's norm, say, between two ranks' ops) may wait for the kernels running in the context, among them a rank's
  kernel spinning for a peer this thread has yet to enqueue: the first step hangs until the timeout. FlatEP loads its
  own kernels, and the torch kernels its ops launch, when a Buffer is built; eager loading covers yours. Its cost,
  measured once per process on an H200 with torch 2.11 (benchmarks/module_loading_cost.py, 2026-12-03): against
  lazy loading, CUDA's start-up takes 1.90 s more and the first step 1.19 s more; device memory is 644 MiB more
  after start-up and 1054 MiB more after the first step.

When CUDA started before this import (lazily), virtual_ranks(device='cuda') says so once, in one line with the fix
(a RuntimeWarning), before anything can hang: import flatep.virtual first, set CUDA_MODULE_LOADING=EAGER in the
environment, or run each of your kernels once before the first step. FLATEP_NUM_SMS (thread blocks per launch,
e.g. SMs / R) lets the ranks' kernels run side by side.
"""

import ctypes
import os
import threading
import warnings

import torch

from . import _C

if not torch.cuda.is_initialized():  # read when CUDA starts; see the module docstring
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
from ._bootstrap import OwnTransportGroup, PeerTimeout
from ._tensors import check_timeout, number_text

_MAX_RANKS = 64  # flatep::kMaxRanks


class _Rendezvous:
    """Shared state of R ThreadBootstraps: one slot per rank and a barrier."""

    def __init__(self, size, timeout_s):
        self.size = size
        self.timeout_s = timeout_s
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size


class ThreadBootstrap(_C.Bootstrap):
    """flatep._C.Bootstrap for rank `rank` of R threads sharing `rendezvous`."""

    def __init__(self, rendezvous, rank):
        super().__init__()
        self._rv = rendezvous
        self._rank = rank

    def rank(self):
        return self._rank

    def size(self):
        return self._rv.size

    def all_gather(self, blob):
        rv = self._rv
        try:
            rv.barrier.wait(rv.timeout_s)  # every rank has read the previous round
            rv.slots[self._rank] = bytes(blob)
            rv.barrier.wait(rv.timeout_s)  # every rank has written this round
            return list(rv.slots)
        except threading.BrokenBarrierError:
            raise PeerTimeout(
                f"virtual rank {self._rank}: all_gather: not every one of {rv.size} ranks arrived within "
                f"{number_text(rv.timeout_s)} s"
            ) from None


class VirtualRank(OwnTransportGroup):
    """Rank `rank` of `size` virtual ranks; pass it as the `group` of Buffer / ExpertPools (attributes rank, size,
    transport, device)."""

    def __repr__(self):
        return f"VirtualRank({self.rank}/{self.size}, {self.transport.name}, {self.device})"


def run_threads(num_ranks, fn):
    """[fn(0), ..., fn(num_ranks - 1)], each call on its own thread, all at once; re-raises the first error (by rank)
    after every thread ended, with every other rank's error (its type and first line) added as a note (Python >=
    3.11): the rank that failed first is often not rank 0."""
    results, errors = [None] * num_ranks, [None] * num_ranks

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), name=f"flatep-virtual-{r}") for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in range(num_ranks) if errors[r] is not None]
    if failed:
        first = errors[failed[0]]
        if hasattr(first, "add_note"):
            for r in failed[1:]:
                text = str(errors[r]).splitlines()
                first.add_note(f"virtual rank {r}: {type(errors[r]).__name__}: {text[0] if text else ''}")
        raise first
    return results


def _resolve(device):
    device = torch.device(device)
    if device.type == "cuda":
        if not _C.has_cuda:
            raise ValueError(f"virtual_ranks: device {device} needs FlatEP built with CUDA")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"virtual_ranks: device must be 'cpu' or a CUDA device, got {device}")
    return device


def virtual_ranks(num_ranks, device="cpu", timeout_s=None):
    """R VirtualRanks sharing one ipc transport world on `device` ('cpu': host memory, the CPU backend; a CUDA device:
    device memory on that GPU; a list of CUDA devices: the ranks in equal consecutive blocks, rank r on
    devices[r * len(devices) // R], peers on other GPUs reached through peer mappings). timeout_s bounds every
    cross-rank wait: seconds in (0, 86400] (default: FLATEP_TIMEOUT_S or 100 s)."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or not 1 <= num_ranks <= _MAX_RANKS:
        raise ValueError(f"virtual_ranks: num_ranks must be an int in [1, {_MAX_RANKS}], got {num_ranks!r}")
    timeout_s = check_timeout("virtual_ranks", timeout_s)
    devices = [_resolve(d) for d in (device if isinstance(device, (list, tuple)) else [device])]
    if not devices or len(devices) > num_ranks or num_ranks % len(devices):
        raise ValueError(f"virtual_ranks: {num_ranks} ranks cannot be split evenly over devices {devices}")
    if len({d.type for d in devices}) != 1 or (devices[0].type == "cpu" and len(devices) != 1):
        raise ValueError(f"virtual_ranks: devices must be one 'cpu' or CUDA devices only, got {devices}")
    rank_device = [devices[r * len(devices) // num_ranks] for r in range(num_ranks)]
    memory = "device" if devices[0].type == "cuda" else "host"
    rv = _Rendezvous(num_ranks, 60.0 if timeout_s is None else timeout_s)

    def make(r):
        index = rank_device[r].index if rank_device[r].type == "cuda" else -1
        timeout = 0.0 if timeout_s is None else timeout_s
        return _C.make_ipc_transport(ThreadBootstrap(rv, r), memory, timeout, same_process=True, device=index)

    transports = run_threads(num_ranks, make)
    if memory == "device":
        _warn_if_lazy()
    return [VirtualRank(r, num_ranks, transports[r], rank_device[r]) for r in range(num_ranks)]


_warned_lazy = False


def cuda_module_loading():
    """'EAGER' or 'LAZY': how this process's CUDA driver loads modules (cuModuleGetLoadingMode, CUDA >= 12.0), or None
    when it cannot tell (no driver, an older one, or CUDA not started yet)."""
    try:
        get = ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode
    except (OSError, AttributeError):
        return None
    mode = ctypes.c_int(0)
    if get(ctypes.byref(mode)) != 0:  # CUDA_ERROR_NOT_INITIALIZED before cuInit
        return None
    return {1: "EAGER", 2: "LAZY"}.get(mode.value)  # CU_MODULE_EAGER_LOADING, CU_MODULE_LAZY_LOADING


def _warn_if_lazy():
    """The one-line warning of the module docstring, once per process, when CUDA loads modules lazily."""
    global _warned_lazy
    if _warned_lazy or cuda_module_loading() != "LAZY":
        return
    _warned_lazy = True
    warnings.warn(
        "flatep.virtual: CUDA loads modules lazily in this process (CUDA started with CUDA_MODULE_LOADING unset or "
        "LAZY; importing flatep.virtual sets EAGER only before CUDA starts): the first launch of one of your kernels "
        "between two ranks' ops can wait for a rank spinning on its peer and hang until the timeout; fix: import "
        "flatep.virtual before anything starts CUDA, or set CUDA_MODULE_LOADING=EAGER in the environment (or run each "
        "of your kernels once before the first step)",
        RuntimeWarning,
        stacklevel=3,
    )
