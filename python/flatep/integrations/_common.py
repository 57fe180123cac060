"""What every adapter shares: the row groups of a plan as a framework's expert GEMM sees them, and the compute-view
weights of those groups (own experts, then this step's replicas) as a differentiable function of the own weights.

A FlatEP plan gives each rank 2*epn row groups, in receive-row order (design §3):

    group g < epn        own expert rank*epn + g
    group epn + j        replica slot j, holding expert plan.slot_expert[j] this step (-1: slot unused, no rows)

A framework's grouped GEMM must therefore run over 2*epn weight matrices, not epn: group_expert_ids(plan) names the
expert of each group, and ReplicatedExperts gives the [2*epn, ...] weights (own experts from the caller's parameters,
replicas fetched from their owners by ExpertPools.prefetch), with a backward that sends the replicas' gradients back
to their owners (ExpertPools.write_grads + reduce_grad), so the caller's own parameters get the whole gradient.

Serving (a Buffer built from pools with num_slots B < epn; flatep.pools "Serving"): the plan has one group per row of the ExpertPools
weights view, R*Q + B of them (group r*Q + l: expert r*epn + l, read in place from rank r; R*Q + j: slot j; pad rows
are empty groups), and ServingExperts gives that view itself (inference: no copy, no autograd).
"""

import torch

from ..buffer import Plan
from ..pools import ExpertPools, shared_pools

__all__ = ["group_sizes", "group_expert_ids", "row_group_ids", "ReplicatedExperts", "ServingExperts"]


def _check_plan(op, plan):
    if not isinstance(plan, Plan):
        raise ValueError(f"{op}: plan must be a flatep.Plan, got {type(plan).__name__}")
    return plan


def group_sizes(plan):
    """[num_groups] int64, on the plan's device: the padded row count of each group (cu_seqlens as sizes; what frameworks
    call tokens_per_expert). Computed on the device: no host synchronisation."""
    ends = _check_plan("group_sizes", plan).cu_seqlens.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return (ends - starts).clamp_(min=0)


def group_expert_ids(plan):
    """[num_groups] int64, on the plan's device: the global expert id of each group. Training layout: own experts
    rank*epn + g first, then plan.slot_expert (-1 for an unused slot, whose group has no rows). Serving layout: group
    r*Q + l is expert r*epn + l (-1 on the pad rows l >= epn), group R*Q + j slot j's plan.slot_expert[j]. No host
    synchronisation."""
    plan = _check_plan("group_expert_ids", plan)
    buffer = plan._buffer
    epn = buffer.experts_per_rank
    slots = plan.slot_expert.to(torch.int64)
    if buffer.serving:
        stride = buffer.view_stride
        rows = torch.arange(buffer.num_ranks * stride, dtype=torch.int64, device=slots.device)
        home, local = rows // stride, rows % stride
        own = torch.where(local < epn, home * epn + local, torch.full_like(rows, -1))
        return torch.cat([own, slots[: buffer.num_slots]])
    own = torch.arange(epn, dtype=torch.int64, device=slots.device) + buffer.rank * epn
    return torch.cat([own, slots])


def row_group_ids(plan):
    """[NvS] int64, on the plan's device: the group of each receive row (padding rows inside a group: that group;
    rows past the last group end: -1). No host synchronisation."""
    plan = _check_plan("row_group_ids", plan)
    ends = plan.cu_seqlens.to(torch.int64)
    rows = torch.arange(plan._buffer.num_recv_rows, dtype=torch.int64, device=ends.device)
    group = torch.searchsorted(ends, rows, right=True)  # groups whose (inclusive) end is <= row come before it
    return torch.where(group < ends.numel(), group, torch.full_like(group, -1))


class _Replicate(torch.autograd.Function):
    """own weights (one [epn, rows, cols] tensor per projection) -> compute weights ([2*epn, rows, cols] bf16 each).

    Forward: the own weights are written into the layer's own memory (skipped when they are that memory), prefetch
    (collective) fills the replica slots; returns the compute views (cloned unless copy=False).
    Backward: each projection's [2*epn] gradient goes through write_grads (own groups overwritten, used slots with rows
    written), then reduce_grad (collective) adds the replicas' gradients into their owners' own gradients; the own
    gradients are the gradients of the own weights. Every rank runs it (the collective needs them all), which holds
    when every rank's GEMM uses the returned weights."""

    @staticmethod
    def forward(ctx, experts, plan, *own):
        pools, layer = experts.pools, experts.layer
        with torch.no_grad():
            for p, w in enumerate(own):
                dst = layer.own_weights(p)
                if tuple(w.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"ReplicatedExperts: own weights of projection {p} must have shape {list(dst.shape)} "
                        f"([epn, rows, cols]), got {list(w.shape)}"
                    )
                if w.data_ptr() != dst.data_ptr() or w.dtype != dst.dtype:
                    dst.copy_(w)
        pools.prefetch(plan, layer)
        ctx.experts, ctx.plan = experts, plan
        ctx.dtypes = [w.dtype for w in own]
        views = [layer.weights(p) for p in range(len(own))]
        return tuple(v.clone() if experts.copy else v.detach() for v in views)

    @staticmethod
    def backward(ctx, *grads):
        experts, plan = ctx.experts, ctx.plan
        pools, layer = experts.pools, experts.layer
        for p, g in enumerate(grads):
            if g is None:
                g = torch.zeros_like(layer.grads(p))
            elif g.dtype not in (torch.bfloat16, torch.float32):
                g = g.float()
            pools.write_grads(plan, layer, p, g.contiguous(), accumulate=False)
        pools.reduce_grad(plan, layer)
        own = [layer.own_grads(p).to(dtype, copy=True) for p, dtype in enumerate(ctx.dtypes)]
        return (None, None, *own)


class ReplicatedExperts:
    """The weights a framework's grouped GEMM needs over a FlatEP step's 2*epn row groups (collective constructor).

    Args:
        group: the Buffer's group (a torch.distributed process group or a flatep.virtual.VirtualRank).
        experts_per_rank (int): epn (= Buffer.experts_per_rank).
        projections (list of (rows, cols)): the shape of one expert's matrix per projection, in the layout the
            framework keeps (e.g. torchtitan's w1 [F, D], w2 [D, F], w3 [F, D]; Megatron's fc1 [H, 2F], fc2 [F, H]).
        device: 'cpu' or a CUDA device, as the Buffer's.
        copy (bool): True (default): the compute weights returned are copies, so any number of layers and
            micro-batches may be in flight (the process's shared ExpertPools for this shape is used, and the slot
            pool is rewritten by every prefetch). False: the returned tensors are the compute views themselves (no
            copy); then this object gets ExpertPools of its own, and each forward must be followed by its backward
            before the next forward (the next prefetch rewrites the replicas that backward reads).
        pools (ExpertPools or None): pools to register with (their shape must match).

    ``experts(plan, *own_weights)`` -> tuple of [2*epn, rows, cols] bf16 tensors, one per projection: own_weights
    are this rank's [epn, rows, cols] parameters (any float dtype: rounded to bf16; zero copy when they are
    ``experts.layer.own_weights(p)``). Differentiable in the own weights (their gradient includes what replicas on
    other ranks computed), collective in forward and backward.
    """

    def __init__(self, group, experts_per_rank, projections, *, device=None, copy=True, pools=None):
        shapes = [tuple(int(d) for d in p) for p in projections]
        if pools is None:
            if copy:
                pools = shared_pools(group, experts_per_rank, shapes, device)
            else:
                pools = ExpertPools(group, experts_per_rank, shapes, device=device)
        if pools.experts_per_rank != experts_per_rank or [tuple(p) for p in pools.projections] != shapes:
            raise ValueError(f"ReplicatedExperts: pools must have epn={experts_per_rank} and projections {shapes}")
        self.pools, self.copy = pools, bool(copy)
        self.experts_per_rank = experts_per_rank
        self.layer = pools.register_layer()

    def __call__(self, plan, *own_weights):
        _check_plan("ReplicatedExperts", plan)
        if len(own_weights) != len(self.pools.projections):
            raise ValueError(
                f"ReplicatedExperts: expected {len(self.pools.projections)} own weight tensors, got {len(own_weights)}"
            )
        return _Replicate.apply(self, plan, *own_weights)


class ServingExperts:
    """The weights a framework's grouped GEMM needs over a serving step (inference; collective constructor): the
    ExpertPools weights view [R*Q + B, rows, cols] per projection, with B = num_slots < epn replica slots per rank.

    Args:
        group, experts_per_rank, projections, device: as ReplicatedExperts (projections may carry a dtype,
            (rows, cols, dtype), as flatep.ExpertPools takes them: e.g. e4m3 weights and their fp32 scales).
        num_slots (int): B in [0, epn).
        pools (ExpertPools or None): serving pools to register with (None: pools of its own).

    Build the step's Buffer from the pools, ``flatep.Buffer(..., pools=experts.pools)``. Write the own
    weights once into ``experts.layer.own_weights(p)`` (they are the memory every rank reads in place).
    ``experts(plan, *own_weights)`` -> tuple of the [R*Q + B, rows, cols] views (no copy): prefetch (collective)
    fills this rank's B slots from their owners; own_weights, when given, are written into the own memory first
    (skipped when they are that memory). The views are valid until the next prefetch of these pools.
    """

    def __init__(self, group, experts_per_rank, projections, num_slots, *, device=None, pools=None):
        if pools is None:
            pools = ExpertPools(group, experts_per_rank, projections, num_slots=num_slots, device=device)
        if not pools.serving or pools.num_slots != num_slots or pools.experts_per_rank != experts_per_rank:
            raise ValueError(f"ServingExperts: pools must be serving pools with epn={experts_per_rank} and "
                             f"num_slots={num_slots} < epn, got epn={pools.experts_per_rank} "
                             f"num_slots={pools.num_slots}")
        self.pools, self.experts_per_rank, self.num_slots = pools, experts_per_rank, num_slots
        self.view_stride, self.view_rows = pools.view_stride, pools.view_rows
        self.layer = pools.register_layer()  # collective

    @torch.no_grad()
    def __call__(self, plan, *own_weights):
        _check_plan("ServingExperts", plan)
        layer = self.layer
        if own_weights and len(own_weights) != len(self.pools.projections):
            raise ValueError(f"ServingExperts: expected {len(self.pools.projections)} own weight tensors (or none), "
                             f"got {len(own_weights)}")
        for p, w in enumerate(own_weights):
            dst = layer.own_weights(p)
            if tuple(w.shape) != tuple(dst.shape):
                raise ValueError(f"ServingExperts: own weights of projection {p} must have shape {list(dst.shape)} "
                                 f"([epn, rows, cols]), got {list(w.shape)}")
            if w.data_ptr() != dst.data_ptr() or w.dtype != dst.dtype:
                dst.copy_(w)
        if plan._buffer.planner != "owner":  # owner plans use no slot (on every rank alike)
            self.pools.prefetch(plan, layer)
        return tuple(layer.weights(p) for p in range(len(self.pools.projections)))
