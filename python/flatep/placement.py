"""The static planner's placement on the Python side (docs/design.md §4 "The static planner"): reading a placement a
user passes (Buffer.set_placement) and the state flatep.nn.MoE keeps for a layer with planner="static" (its own
Buffers, the placement, and whether the shared slot pool still holds the layer's placed replicas).

A placement is [R, B] expert ids: row d the experts rank d's B slots hold, -1 for an empty slot (B: the Buffer's
num_slots, epn in the training layout). flatep.eplb.place computes one from a window of loads.
"""

import torch

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def placement_words(op, slots, num_ranks, num_slots):
    """(words, error): the placement flattened to R*B Python ints for the C++ call, and None; or, when `slots` cannot
    be read as an [R, B] int table, a list that the C++ call refuses on every rank (R*B + 1 entries, so that the ranks
    still meet and nobody waits for this one) and this rank's one-line message."""
    want = f"[R={num_ranks}, B={num_slots}]"
    refused = [INT32_MIN] * (num_ranks * num_slots + 1)
    try:
        table = slots.detach().cpu() if isinstance(slots, torch.Tensor) else torch.as_tensor(slots)
    except (TypeError, ValueError, RuntimeError):
        text = repr(slots)
        text = text if len(text) <= 60 else text[:57] + "..."
        return refused, f"{op}: slots must be an {want} table of int expert ids (-1: an empty slot), got {text}"
    if table.numel() != 0 and (table.dtype == torch.bool or table.is_floating_point() or table.is_complex()):
        return refused, f"{op}: slots must hold int expert ids (-1: an empty slot), got {table.dtype}"
    if tuple(table.shape) != (num_ranks, num_slots):
        shape = "[" + ", ".join(str(n) for n in table.shape) + "]"
        return refused, f"{op}: slots must have shape {want} (one row of B slot experts per rank), got {shape}"
    table = table.to(torch.int64)
    outside = ((table < INT32_MIN) | (table > INT32_MAX)).nonzero()
    if len(outside):
        d, j = (int(v) for v in outside[0])
        return refused, (f"{op}: placement[{d}][{j}] = {int(table[d, j])} is not an expert id (int32) or -1 "
                         "(empty)")
    return table.reshape(-1).tolist(), None


class LayerPlacement:
    """What flatep.nn.MoE keeps for planner="static": the placement set last (applied to every Buffer the layer
    plans with), the layer's own Buffers (a placement belongs to one layer, so its Buffers are not the process's
    shared ones), and the key of the move that filled the pools' slot pool (the pools remember the last one:
    ExpertPools._slots_hold, cleared by every prefetch)."""

    def __init__(self):
        self.slots = None  # the placement set last (an [R, B] int32 tensor), applied to new Buffers
        self.buffers = {}  # num_tokens -> this layer's static Buffer
        self.weights_version = 0  # bumped when the layer's own weights are rewritten (load_dense, load_state_dict)

    def key(self, layer, plan):
        """What the slots hold after this layer's move of plan's placement."""
        return (layer._index, plan._buffer._buffer.id, plan.placement_epoch, self.weights_version)

    def needs_move(self, pools, layer, plan):
        """Whether the slot pool does not hold this layer's placed replicas of plan's placement now."""
        return getattr(pools, "_slots_hold", None) != self.key(layer, plan)

    def moved(self, pools, layer, plan):
        """Records that the last prefetch of the pools moved this layer's replicas of plan's placement."""
        pools._slots_hold = self.key(layer, plan)
