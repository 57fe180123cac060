"""Inference over serving pools (issues 43 and 47): the expert FFN on the ExpertPools weights view of a serving step,
and the checks flatep.nn.MoE makes for it.

A serving step (ExpertPools with num_slots B < epn, a Buffer built from them: ``Buffer(..., pools=pools)``) has one row
group per row of the weights view [view_rows, rows, cols] (view_rows = R*Q + B): rows [r*Q, r*Q + epn) are rank r's
own experts, read in place from its memory, rows [R*Q, R*Q + B) this rank's slots, filled by prefetch (a pull from
the owners). So the grouped GEMM runs on the view itself with offs = plan.cu_seqlens: no weight is copied per step,
whatever B is. With the owner planner no slot is used and no prefetch is needed (the plan moves every row to its
expert's home rank).
"""

import torch

from .ffn import grouped_ffn


def serving_experts(pools, layer, plan, recv_x, activation, prefetch=True):
    """The expert FFN of one inference step over the layer's weights views: prefetch (collective; skipped for the
    owner planner, whose plans use no slot, and with prefetch=False, which every rank passes alike: a static
    placement whose replicas the slots already hold), then the grouped FFN of flatep.ffn on
    layer.weights(0) / layer.weights(1) with offs = plan.cu_seqlens. recv_x [NvS, H] bf16 -> y [NvS, H] bf16, for
    the step's combine, which reads only the plan's real rows: rows past the last group end are unspecified (on a GPU
    not zeroed: with the owner planner they are most of the R*S*K receive rows). Works for training pools too
    (B = epn: the 2*epn view), without autograd.

    Serving pools pull with plan_ordered: the caller (flatep.nn.MoE's forward) made `plan` in this call, after every
    write of the weights, and writes none before the step's combine."""
    if prefetch and plan._buffer.planner != "owner":
        pools.prefetch(plan, layer, plan_ordered=pools.serving)
    with torch.no_grad():
        return grouped_ffn(recv_x, layer.weights(0), layer.weights(1), plan.cu_seqlens, activation,
                           zero_past_end=False)


def check_num_slots(op, num_slots, experts_per_rank):
    """num_slots as given (None, or an int >= 0: None is epn); a one-line ValueError naming it otherwise. Its range
    against epn is the pools' to check (the one check of B, in the C++ ExpertPools)."""
    if num_slots is None:
        return None
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
        raise ValueError(f"{op}: num_slots must be None or an int >= 0, got {num_slots!r}")
    return num_slots


def check_inference(moe, tensors):
    """Serving layers (B < epn) have no gradient memory: a forward autograd would record raises a one-line
    ValueError."""
    if not moe.serving or not torch.is_grad_enabled():
        return
    if any(t is not None and t.requires_grad for t in tensors) or any(p.requires_grad for p in moe.parameters()):
        raise ValueError(
            f"MoE: num_slots={moe.num_slots} < epn={moe.experts_per_rank} is inference only (serving pools hold no "
            "gradients); run it under torch.no_grad() or torch.inference_mode(), or build the layer with "
            "num_slots=None to train"
        )
