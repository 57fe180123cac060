"""What flatep.distributed and flatep.virtual share, below both: the bootstraps' timeout error, the base class of a
group that brings its own transport (so that flatep.distributed knows a virtual rank without importing
flatep.virtual), and the host meeting every collective op of a virtual rank's own thread starts with (flatep.buffer
and flatep.pools call it without importing flatep.virtual, whose import sets CUDA's loading mode)."""

import threading

#: .rank_thread: the flatep.virtual rank thread running on this thread (None elsewhere)
rank_threads = threading.local()


class PeerTimeout(TimeoutError, RuntimeError):
    """A bootstrap's peer did not arrive in time or left the job. flatep._C passes a TimeoutError's message on as the
    library's one-line timeout error (RuntimeError); a direct caller of all_gather can catch either base."""


class OwnTransportGroup:
    """Stands where a torch.distributed group goes (``Buffer(group=...)``, ``ExpertPools(group, ...)``) and brings its
    own transport: rank `rank` of `size` ranks whose FlatEP objects use `transport`, on `device` (a torch.device).
    flatep.virtual.VirtualRank is one."""

    def __init__(self, rank, size, transport, device):
        self.rank, self.size, self.transport, self.device = rank, size, transport, device


def arrive(group, op):
    """Called by every collective FlatEP op (flatep.Buffer, flatep.ExpertPools) before it enqueues its kernels. On a
    CUDA device, when the op runs on a virtual rank's own thread (flatep.virtual.run_threads), it first waits on the
    host until every rank of the world reached its own call of an op: no rank's kernel then waits on the device for
    a peer whose thread is still in work before the op. That work may block the host until the GPU's running kernels
    end (measured on an H100 by benchmarks/probes/host_block_probe.py: making a thread's cuBLAS handle, a GEMM
    kernel's first load), and with a rank's collective kernel waiting for that very thread the first step would hang until the
    timeout (issue 59). A rank thread runs its backward itself (flatep.virtual binds it so), so the backward's ops
    meet too. Ops on other threads (one thread enqueueing every rank's op; autograd's backward thread, when a
    non-rank thread calls backward) do not wait: one thread enqueues every rank's part there; nor do ops being
    captured into a CUDA graph, which run nothing (flatep.virtual.graph captures the ranks one at a time)."""
    meeting = getattr(group, "_meeting", None)
    if meeting is None or group.device.type != "cuda" or getattr(rank_threads, "rank_thread", None) is None:
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # a capture runs nothing
        return
    meeting.arrive(group.rank, op)
