"""Virtual ranks: R FlatEP ranks in one process (for benchmarks and tests on one GPU or on the CPU).

Production runs one process per rank (torch.distributed). Here the R ranks are threads of one process that share an
``ipc`` transport world built through an in-process all-gather, so every Buffer / ExpertPools op is the real one:

    ranks = flatep.virtual.virtual_ranks(8, device="cuda")       # collective set-up, done on R threads
    buffers = flatep.virtual.run_threads(8, lambda r: flatep.Buffer(ranks[r], S, H, E, K, device="cuda"))
    plans = flatep.virtual.run_threads(8, lambda r: buffers[r].plan(idx[r]))

A :class:`VirtualRank` stands where a torch.distributed group goes (``Buffer(group=...)``,
``ExpertPools(group, ...)``), and has the host-side collectives a model needs besides FlatEP's ops (all_reduce,
all_to_all_single, all_gather, broadcast, all_gather_object, barrier: data-parallel gradients, an all-to-all
baseline). Constructors and collectives run on the R ranks at once: ``run_threads(R, fn)`` runs fn(r) on rank r's
thread. That thread is the same on every call for the life of the process and has the rank's CUDA device current,
so whatever a rank did on it before (a stream made current with torch.cuda.set_stream, cuBLAS's handle, a warm-up)
is there at its next step and when it captures a CUDA graph; a backward it calls runs on it too, not on torch's one
autograd thread of the device. On a CUDA device the ops never block the host, so one
thread may also enqueue every rank's op, each on its own stream. Two settings of CUDA, read when CUDA starts, make
that safe, and importing this module before CUDA starts sets both unless they are set:

* CUDA_DEVICE_MAX_CONNECTIONS=32 (CUDA's default is 8): the ranks' streams must not share a hardware queue, since a
  rank's kernel may spin for a peer's.
* CUDA_MODULE_LOADING=EAGER (torch's default is LAZY): under lazy loading the first launch of any kernel (your
  model's norm, say, between two ranks' ops) may wait for the kernels running in the context, among them a rank's
  kernel spinning for a peer this thread has yet to enqueue: the first step hangs until the timeout. FlatEP loads its
  own kernels, and the torch kernels its ops launch, when a Buffer is built; eager loading covers yours. Its cost,
  measured once per process on an H200 with torch 2.11 (benchmarks/probes/module_loading_cost.py, 2026-12-03): against
  lazy loading, CUDA's start-up takes 1.90 s more and the first step 1.19 s more; device memory is 644 MiB more
  after start-up and 1054 MiB more after the first step.

When CUDA started before this import (lazily), virtual_ranks(device='cuda') says so once, in one line with the fix
(a RuntimeWarning), before anything can hang: import flatep.virtual first, set CUDA_MODULE_LOADING=EAGER in the
environment, or run each of your kernels once before the first step. FLATEP_NUM_SMS (thread blocks per launch,
e.g. SMs / R) lets the ranks' kernels run side by side.
"""

import concurrent.futures
import contextlib
import ctypes
import functools
import os
import queue
import threading
import warnings
import weakref

import torch

from . import _C

if not torch.cuda.is_initialized():  # read when CUDA starts; see the module docstring
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
from ._bootstrap import OwnTransportGroup, PeerTimeout, arrive, rank_threads  # noqa: F401 (arrive: re-exported)
from ._tensors import check_int, check_timeout, number_text

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


class PeerFailed(PeerTimeout):
    """A virtual rank's collective gave up because a peer's call raised (the peer's error names the cause)."""


class _Barrier:
    """threading.Barrier without its race: a party released by the last arrival returns normally even when the
    barrier is broken right after (threading.Barrier raises BrokenBarrierError in a released thread that had not yet
    woken up when abort() came)."""

    def __init__(self, size):
        self.size = size
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self.broken = False

    def wait(self, timeout_s):
        with self._cond:
            if self.broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return
            self._cond.wait_for(lambda: self._generation != generation or self.broken, timeout_s)
            if self._generation != generation:
                return
            self.broken = True  # a timeout breaks it for every party, as threading.Barrier's does
            self._cond.notify_all()
            raise threading.BrokenBarrierError

    def abort(self):
        with self._cond:
            self.broken = True
            self._cond.notify_all()

    def reset(self):
        with self._cond:
            self.broken = False
            self._arrived = 0


class _Meeting:
    """Where the R threads of one world meet for a host-side collective (VirtualRank.all_reduce and friends): each
    call posts this rank's part in its slot and waits for all R at a barrier. A rank that does not arrive within the
    timeout, or that failed in between (run_threads breaks the barrier when a rank's call raises), makes every other
    rank fail naming it; ranks that call different collectives fail on every rank naming both."""

    def __init__(self, size, timeout_s):
        self.size = size
        self.timeout_s = timeout_s
        self.barrier = _Barrier(size)
        self.slots = [None] * size
        self.calls = [0] * size  # collectives each rank has entered
        self.failed = [None] * size  # the first line of a rank's error, once its run_threads call raised

    def exchange(self, rank, what, part):
        """Every rank's `part` (a list indexed by rank) of this collective, once all R posted theirs."""
        self.calls[rank] += 1
        self._wait(rank, what, "posting")
        self.slots[rank] = (what, self.calls[rank], part)
        self._wait(rank, what, "exchanging")
        posted = list(self.slots)
        for peer, (peer_what, peer_call, _) in enumerate(posted):
            if (peer_what, peer_call) != (what, self.calls[rank]):
                raise RuntimeError(
                    f"virtual rank {rank}: {what} #{self.calls[rank]} met rank {peer}'s {peer_what} #{peer_call}: "
                    f"every rank must call the same collectives in the same order"
                )
        return [p for _, _, p in posted]

    def arrive(self, rank, what):
        """Returns once every rank arrived here (a host barrier, no exchange, no check of `what`)."""
        self.calls[rank] += 1
        self._wait(rank, what, "arriving")

    def done(self, rank, what):
        """Waits until every rank has finished reading the others' parts (their tensors may be freed after)."""
        self._wait(rank, what, "finishing")

    def _wait(self, rank, what, stage):
        try:
            self.barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            gone = [f"rank {r} ({self.failed[r]})" for r in range(self.size) if self.failed[r] is not None]
            if gone:
                raise PeerFailed(f"virtual rank {rank}: {what}: {', '.join(gone)} failed") from None
            behind = [r for r in range(self.size) if self.calls[r] < self.calls[rank]]
            named = ", ".join(f"rank {r}" for r in behind) or "a peer"
            raise PeerTimeout(
                f"virtual rank {rank}: {what} ({stage}): {named} did not arrive within {number_text(self.timeout_s)} s"
            ) from None

    def fail(self, rank, error):
        """Rank `rank`'s call raised `error`: every rank waiting here (or arriving later) fails naming it."""
        if not isinstance(error, PeerFailed):  # a consequence names the cause, not itself
            text = str(error).splitlines()
            self.failed[rank] = f"{type(error).__name__}: {text[0] if text else ''}"
        self.barrier.abort()

    def reset(self):
        """A fresh start after a failed call, when no rank is inside a collective (run_threads, before a call)."""
        if self.barrier.broken:
            self.barrier.reset()
            self.slots = [None] * self.size
            self.calls = [0] * self.size
            self.failed = [None] * self.size


class VirtualRank(OwnTransportGroup):
    """Rank `rank` of `size` virtual ranks; pass it as the `group` of Buffer / ExpertPools (attributes rank, size,
    transport, device).

    It also has the few host-side collectives a model needs besides FlatEP's ops (data-parallel gradients, an
    all-to-all baseline), with torch.distributed's meaning; like every collective they run on the R rank threads at
    once (run_threads). On a CUDA device the work is enqueued on the calling thread's current stream, ordered after
    each rank's earlier work on its own current stream (events), never synchronising with the host; every rank's
    stream then also waits for the peers' reads of its tensors, so a tensor passed in may be reused at once."""

    def __init__(self, rank, size, transport, device, meeting=None):
        super().__init__(rank, size, transport, device)
        self._meeting = meeting if meeting is not None else _Meeting(size, _C.env_timeout_s())

    def __repr__(self):
        return f"VirtualRank({self.rank}/{self.size}, {self.transport.name}, {self.device})"

    def _cuda(self):
        return self.device.type == "cuda"

    def _ready_event(self):
        if not self._cuda():
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _read_all(self, what, tensors, read):
        """Posts `tensors` (this rank's inputs), then read(parts) with parts[p] = rank p's inputs, ordered after
        every rank's writes of its inputs; returns what read returns once every rank is done reading."""
        meeting, stream = self._meeting, None
        parts = meeting.exchange(self.rank, what, (tensors, self._ready_event()))
        if self._cuda():
            stream = torch.cuda.current_stream(self.device)
            for _, event in parts:
                stream.wait_event(event)
        out = read([t for t, _ in parts])
        read_done = self._ready_event()
        if self._cuda():
            for peer_tensors, _ in parts:  # the caching allocator must not reuse them before this stream read them
                for t in peer_tensors:
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(stream)
        done = meeting.exchange(self.rank, what + " (done)", read_done)
        if self._cuda():
            for event in done:  # this rank's inputs are read by every peer before its stream goes on
                stream.wait_event(event)
        return out

    def all_reduce(self, tensor):
        """In place: tensor = the sum over ranks of every rank's tensor (same shape and dtype), added in rank order,
        so every rank gets the same bits. Returns tensor."""
        def read(parts):
            self._check_same("all_reduce", tensor, [p[0] for p in parts])
            total = parts[0][0].clone()
            for p in parts[1:]:
                total += p[0]
            return total

        tensor.copy_(self._read_all("all_reduce", [tensor], read))
        return tensor

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes):
        """torch.distributed.all_to_all_single over the first dimension: rows [sum(input_split_sizes[:p]), ...) of
        this rank's input go to rank p, whose output receives them at rows [sum(output_split_sizes[:r]), ...)
        (r this rank). The sizes are lists of R ints that must match the peers' (rank p's input_split_sizes[r] ==
        this rank's output_split_sizes[p]). Returns output."""
        rank, size = self.rank, self.size
        sizes_in, sizes_out = _splits(input_split_sizes, size, "input"), _splits(output_split_sizes, size, "output")
        if sum(sizes_in) != input.shape[0] or sum(sizes_out) != output.shape[0]:
            raise ValueError(
                f"all_to_all_single: split sizes sum to {sum(sizes_in)} (input) and {sum(sizes_out)} (output), "
                f"the tensors have {input.shape[0]} and {output.shape[0]} rows"
            )
        def read(parts):
            at = 0
            for p, (peer_input, peer_sizes) in enumerate(parts):
                if peer_sizes[rank] != sizes_out[p]:
                    raise ValueError(
                        f"virtual rank {rank}: all_to_all_single: rank {p} sends {peer_sizes[rank]} rows here, "
                        f"output_split_sizes[{p}] is {sizes_out[p]}"
                    )
                lo = sum(peer_sizes[:rank])
                output[at:at + sizes_out[p]].copy_(peer_input[lo:lo + sizes_out[p]])
                at += sizes_out[p]
            return output

        return self._read_all("all_to_all_single", [input, sizes_in], read)

    def all_gather(self, tensor):
        """[rank 0's tensor, ..., rank R-1's] as copies on this rank (any shapes)."""
        return self._read_all("all_gather", [tensor], lambda parts: [p[0].clone() for p in parts])

    def broadcast(self, tensor, src):
        """In place: tensor = rank src's tensor (same shape and dtype). Returns tensor."""
        check_int("broadcast", "src", src, f"in [0, {self.size - 1}]", low=0, high=self.size - 1)

        def read(parts):
            self._check_same("broadcast", tensor, [p[0] for p in parts])
            return parts[src][0].clone()

        value = self._read_all("broadcast", [tensor], read)
        tensor.copy_(value)
        return tensor

    def all_gather_object(self, obj):
        """[every rank's obj] (host objects, no device work)."""
        return self._meeting.exchange(self.rank, "all_gather_object", obj)

    def barrier(self):
        """Returns once every rank called it (host only: device work is not waited for)."""
        self._meeting.exchange(self.rank, "barrier", None)

    def _check_same(self, what, mine, theirs):
        for p, t in enumerate(theirs):
            if t.shape != mine.shape or t.dtype != mine.dtype:
                raise ValueError(
                    f"virtual rank {self.rank}: {what}: rank {p}'s tensor is {str(t.dtype)[6:]} {list(t.shape)}, "
                    f"this rank's {str(mine.dtype)[6:]} {list(mine.shape)}"
                )


def _splits(sizes, size, what):
    sizes = [int(v) for v in sizes]
    if len(sizes) != size or min(sizes) < 0:
        raise ValueError(f"all_to_all_single: {what}_split_sizes must be {size} non-negative ints, got {sizes}")
    return sizes


class _RankThread:
    """One persistent thread of a virtual rank: runs the calls handed to it in order, with its rank's CUDA device
    current (bound once when the world is made), so that what the rank did before (cuBLAS handles, streams made
    current, warm-up, graph pools) is still its own when it captures a CUDA graph."""

    def __init__(self, index):
        self.index = index
        self.device = None  # a CUDA torch.device bound at the next call, or None
        self.stream = None  # the rank's CUDA stream on its bound device, current on its thread
        self._bound = None
        self.meetings = weakref.WeakSet()  # the _Meetings of the worlds this thread is a rank of
        self._calls = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"flatep-virtual-{index}", daemon=True)
        self.thread.start()

    def _loop(self):
        _local.rank_thread = self
        while True:
            call = self._calls.get()
            if call is None:
                return
            fn, done = call
            try:
                if self.device is not None and self._bound != self.device:
                    torch.cuda.set_device(self.device)  # torch's current device (it skips CUDA when it is already)
                    _C.make_device_current(self.device.index)  # and the GPU's context, bound to this thread
                    _make_blas_handles(self.device)
                    # The rank's own stream, current on its thread: torch's default stream is CUDA's legacy stream,
                    # one queue for every thread, where a rank's collective kernel waiting for a peer would hold the
                    # peer's kernel back behind it (a hang until the timeout). run_threads orders it with the caller.
                    self.stream = torch.cuda.Stream(self.device)
                    torch.cuda.set_stream(self.stream)
                    _own_backward()
                    self._bound = self.device
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                for meeting in list(self.meetings):  # peers waiting in a collective fail now, naming this rank
                    if meeting.size > self.index:
                        meeting.fail(self.index, e)
                done.set_exception(e)

    def submit(self, fn):
        done = concurrent.futures.Future()
        self._calls.put((fn, done))
        return done


def _make_blas_handles(device):
    """This thread's cuBLAS handles (and, once a process and device, those of autograd's backward thread) made now,
    while no rank's kernel can be waiting: making one waits for every kernel running on the GPU (3.4 s behind a 1 s
    kernel on an H100, benchmarks/probes/host_block_probe.py), and a rank's first GEMM would otherwise make it while a
    peer's collective kernel waits for this rank (issue 59)."""
    torch.cuda.current_blas_handle()
    if device.index not in _autograd_warm:
        _autograd_warm.add(device.index)
        a = torch.ones(2, 2, device=device, dtype=torch.bfloat16, requires_grad=True)
        (a @ a).float().sum().backward()  # runs on the device's autograd thread: its handle too
        torch.cuda.synchronize(device)  # nothing of FlatEP's can run yet: the world is being made


def _own_backward():
    """The rank's backward runs on its own thread (a thread-local switch of torch's), as its forward does. By default torch
    runs a CUDA graph's backward on one autograd thread per device, and that one thread would enqueue every rank's
    backward with no host meeting: a GEMM of a kind it has not run before waits there until the GPU's running kernels
    end (benchmarks/probes/host_block_probe.py), among them a rank's collective kernel waiting for a peer whose
    backward that thread has yet to enqueue, and the first step hung until the timeout (test_moe_overlap's GPU case,
    H100). On the rank's own thread the backward's FlatEP ops meet their peers on the host first (arrive), as the
    forward's do. (A CUDA build of FlatEP needs torch 2.x, which has the switch.)"""
    torch.autograd.set_multithreading_enabled(False)


_autograd_warm = set()
_local = rank_threads  # .rank_thread: the _RankThread running on this thread, if any
_threads_lock = threading.Lock()
_rank_threads = []  # _RankThread i runs rank i's calls of every run_threads, for the life of the process


def _threads(num_ranks):
    with _threads_lock:
        while len(_rank_threads) < num_ranks:
            _rank_threads.append(_RankThread(len(_rank_threads)))
        return _rank_threads[:num_ranks]


def run_threads(num_ranks, fn):
    """[fn(0), ..., fn(num_ranks - 1)], all at once, fn(r) on rank r's thread; re-raises the first error (by rank,
    a rank's own failure before a PeerFailed that only names it) after every call ended, with every other rank's
    error (its type and first line) added as a note (Python >= 3.11): the rank that failed first is often not rank 0.

    Rank r's thread is the same on every call, for the life of the process (what a rank made current or created on
    it, a stream, cuBLAS's handle, a warm-up, stays there for its next step and its graph capture), and it has its
    rank's CUDA device current (the device of rank r of the latest virtual_ranks of that size) and a CUDA stream of its
    own as torch's current stream there (never the default stream, which CUDA shares between threads: one rank's
    collective kernel would hold its peers' back). On CUDA, rank r's stream first waits for the work the caller had
    enqueued on its current stream, and the caller's current stream then waits for rank r's (events, no host
    synchronisation): tensors passed in and results handed back are ready in stream order. Calls of run_threads
    may come from any thread, one at a time; fn must not call run_threads itself (that would wait for its own
    thread: a RuntimeError says so)."""
    check_int("run_threads", "num_ranks", num_ranks, f"in [1, {_MAX_RANKS}]", low=1, high=_MAX_RANKS)
    if getattr(_local, "rank_thread", None) is not None:
        raise RuntimeError(
            f"run_threads: called on virtual rank thread {_local.rank_thread.index}, inside another run_threads "
            f"call; call it from the thread that runs the step instead"
        )
    threads = _threads(num_ranks)
    for t in threads:  # a failure of an earlier call broke its worlds' meetings: nobody waits in them now
        for meeting in list(t.meetings):
            meeting.reset()
    futures = [t.submit(functools.partial(_ordered, fn, r, _caller_event(t.device))) for r, t in enumerate(threads)]
    results, errors = [None] * num_ranks, [None] * num_ranks
    for r, future in enumerate(futures):
        error = future.exception()
        if error is None:
            results[r], done = future.result()
            if done is not None:  # the caller's stream goes on after rank r's work, without a host sync
                torch.cuda.current_stream(threads[r].device).wait_event(done)
        else:
            errors[r] = error
    failed = [r for r in range(num_ranks) if errors[r] is not None]
    causes = [r for r in failed if not isinstance(errors[r], PeerFailed)]  # not "a peer failed": the cause first
    if failed:
        failed = causes + [r for r in failed if r not in causes]
        first = errors[failed[0]]
        if hasattr(first, "add_note"):
            for r in failed[1:]:
                text = str(errors[r]).splitlines()
                first.add_note(f"virtual rank {r}: {type(errors[r]).__name__}: {text[0] if text else ''}")
        raise first
    return results


def _caller_event(device):
    """An event on the calling thread's current stream of `device` (a CUDA rank's), recorded now; None on the CPU."""
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _ordered(fn, r, start):
    """fn(r) on rank r's thread, its stream first waiting for what the caller enqueued before run_threads (start);
    (result, an event recorded on the rank's stream after fn, or None on the CPU) so that the caller's stream waits
    for it. Tensors passed in and results handed back are then ready in stream order, as in single-stream code."""
    if start is None:
        return fn(r), None
    device = _local.rank_thread.device
    torch.cuda.current_stream(device).wait_event(start)
    result = fn(r)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return result, done


_capture_lock = threading.Lock()


@contextlib.contextmanager
def graph(cuda_graph, **kwargs):
    """torch.cuda.graph(cuda_graph, **kwargs) for a virtual rank's thread: the ranks of one process capture one at a
    time. torch.cuda.graph synchronises the whole device when it starts (and empties the allocator's cache), which
    CUDA refuses while another thread's stream captures ("operation not permitted when stream is capturing"), and
    that refusal breaks the other rank's capture too; so R threads entering torch.cuda.graph at once fail. Under this
    lock every rank's capture is whole. A capture runs nothing, so the FlatEP ops captured need no peer to be there
    (flatep._bootstrap.arrive lets them through), and the replays, one per rank on its own thread, run together:

        def capture(r):                       # on rank r's thread: virtual.run_threads(R, capture)
            with torch.inference_mode(), virtual.graph(graphs[r], stream=streams[r]):
                outs[r] = moes[r](static_x[r], static_idx[r])
    """
    with _capture_lock:
        with torch.cuda.graph(cuda_graph, **kwargs):
            yield


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

    threads = _threads(num_ranks)
    for r, t in enumerate(threads):  # rank r's thread has its GPU current from its next call on
        t.device = rank_device[r] if memory == "device" else None
    transports = run_threads(num_ranks, make)
    if memory == "device":
        _warn_if_lazy()
    meeting = _Meeting(num_ranks, _C.env_timeout_s() if timeout_s is None else timeout_s)
    for t in threads:
        t.meetings.add(meeting)
    return [VirtualRank(r, num_ranks, transports[r], rank_device[r], meeting) for r in range(num_ranks)]


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
