"""What flatep.distributed and flatep.virtual share, below both: the bootstraps' timeout error and the base class of a
group that brings its own transport (so that flatep.distributed knows a virtual rank without importing
flatep.virtual)."""


class PeerTimeout(TimeoutError, RuntimeError):
    """A bootstrap's peer did not arrive in time or left the job. flatep._C passes a TimeoutError's message on as the
    library's one-line timeout error (RuntimeError); a direct caller of all_gather can catch either base."""


class OwnTransportGroup:
    """Stands where a torch.distributed group goes (``Buffer(group=...)``, ``ExpertPools(group, ...)``) and brings its
    own transport: rank `rank` of `size` ranks whose FlatEP objects use `transport`, on `device` (a torch.device).
    flatep.virtual.VirtualRank is one."""

    def __init__(self, rank, size, transport, device):
        self.rank, self.size, self.transport, self.device = rank, size, transport, device
