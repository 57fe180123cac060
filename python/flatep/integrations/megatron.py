"""A Megatron-Core-shaped token dispatcher over a flatep.Buffer.

Megatron-Core's MoELayer drives its ``token_dispatcher`` (a ``MoETokenDispatcher``) through six methods; in recent
megatron/core/transformer/moe/moe_layer.py the forward is, per layer and micro-batch:

    probs, routing_map = router(hidden_states)                        # [T, E] each: probs, bool map
    hidden_states, probs = dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
    dispatched_input, probs = dispatcher.token_dispatch(hidden_states, probs)
    dispatched_input, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(dispatched_input, probs)
    expert_output, mlp_bias = experts(dispatched_input, tokens_per_expert, permuted_probs)
    output = dispatcher.combine_preprocess(expert_output)
    output = dispatcher.token_combine(output)
    output = dispatcher.combine_postprocess(output)                   # back to hidden_states' shape
    output = output + shared_expert_output                            # when the layer has a shared expert

Megatron's experts multiply their activation by ``permuted_probs`` (one per dispatched row) and the combine is an
unweighted sum; this class keeps that contract (``probs_in_combine=True`` moves the weighting into FlatEP's combine,
which sums weight * row in fp32, and hands the experts probs of 1).

What differs from Megatron's own dispatchers, and what the experts module must do:

* ``tokens_per_expert`` has **2*epn** entries, not num_local_experts = epn: the epn own experts of this rank, then
  the epn replica slots (``flatep.integrations.group_expert_ids(dispatcher.plan)`` names each group's expert; -1
  for an unused slot, whose count is 0). Counts are padded to the Buffer's ``align`` (padding rows are zero with
  probability 0). The experts' grouped GEMM runs over 2*epn weight matrices: build them per step with
  ``flatep.integrations.ReplicatedExperts`` from the module's own epn weights, e.g. for GroupedMLP-style weights
  ``fc1, fc2 = replicated(dispatcher.plan, w1.view(epn, H, -1), w2.view(epn, -1, H))``; the gradient of the own
  weights then includes what this rank's replicas contributed on other ranks.
* No token dropping: every row of routing_map has exactly topk True entries (``moe_expert_capacity_factor`` None).
* trim=True (default): ``dispatch_postprocess`` returns the first sum(tokens_per_expert) rows and tokens_per_expert
  as a CPU int64 tensor, as Megatron's grouped GEMMs (``tokens_per_expert.tolist()``) expect: one host read of the
  plan's group ends on a CUDA device. trim=False: all NvS receive rows and tokens_per_expert on the device (no host
  synchronisation; rows past the last group end are not written, and are ignored by combine), for a GEMM that takes
  device offsets (``torch._grouped_mm`` with ``offs=cumsum(tokens_per_expert)``).

State (the plan, shapes) lives on the dispatcher between dispatch_preprocess and combine_postprocess, as in Megatron's
dispatchers: one micro-batch at a time per dispatcher; autograd keeps what backward needs. Backward is FlatEP's:
combine's backward is a dispatch of the output gradient, dispatch's an unweighted combine, and the probabilities'
gradient returns to each token's rank (so the router trains).
"""

import torch

from ._common import group_sizes

__all__ = ["FlatEPTokenDispatcher"]

_BF16 = torch.bfloat16


def topk_ids_from_routing_map(routing_map, topk):
    """[T, K] int64 expert ids of a [T, E] bool routing map with K True entries per row, in ascending expert order
    (no host synchronisation: a topk over distinct keys)."""
    num_experts = routing_map.shape[-1]
    keys = routing_map.to(torch.int64) * (num_experts - torch.arange(num_experts, device=routing_map.device))
    return keys.topk(topk, dim=-1).indices


class FlatEPTokenDispatcher:
    """Megatron-Core ``MoETokenDispatcher`` methods over ``buffer`` (a flatep.Buffer of the EP group).

    Args:
        buffer (flatep.Buffer): S >= tokens per micro-batch and rank, H = hidden_size, E = num_moe_experts,
            K = moe_router_topk.
        config: Megatron's TransformerConfig or None (kept as ``self.config``; only checked for E and K).
        trim (bool): see the module docstring.
        probs_in_combine (bool): weight the rows in FlatEP's combine and give the experts probs of 1.

    Attributes: ``plan`` (this micro-batch's flatep.Plan, set by dispatch_preprocess), ``buffer``, ``config``,
    ``num_local_experts`` (= epn, what Megatron builds its experts with) and ``num_groups`` (= 2*epn).
    """

    def __init__(self, buffer, config=None, *, trim=True, probs_in_combine=False):
        if config is not None:
            for name, want in (("num_moe_experts", buffer.num_experts), ("moe_router_topk", buffer.topk)):
                got = getattr(config, name, want)
                if got != want:
                    raise ValueError(f"FlatEPTokenDispatcher: config.{name}={got} but the Buffer has {want}")
        self.buffer, self.config = buffer, config
        self.trim, self.probs_in_combine = bool(trim), bool(probs_in_combine)
        self.num_local_experts = buffer.experts_per_rank
        self.num_groups = 2 * buffer.experts_per_rank
        self.shared_experts = None
        self.cudagraph_attrs = []  # MoELayer reads these when it captures the preprocess in a CUDA graph
        self.valid_cudagraph_attrs = None
        self.plan = None
        self._hidden_shape = self._dtype = self._recv_w = None

    def set_shared_experts(self, shared_experts):
        """Megatron calls this with moe_shared_expert_overlap; the shared expert is the caller's to run."""
        self.shared_experts = shared_experts

    # ---- dispatch ----

    def dispatch_preprocess(self, tokens, routing_map, probs):
        """tokens [..., H], routing_map [T, E] bool, probs [T, E] -> (tokens [T, H], probs [T, K] fp32). Plans the
        step (collective)."""
        buffer = self.buffer
        if tokens.shape[-1] != buffer.hidden:
            raise ValueError(f"dispatch_preprocess: tokens must end in H={buffer.hidden}, got {list(tokens.shape)}")
        self._hidden_shape, self._dtype = tokens.shape, tokens.dtype
        hidden = tokens.reshape(-1, buffer.hidden)
        num_tokens = hidden.shape[0]
        if tuple(routing_map.shape) != (num_tokens, buffer.num_experts) or routing_map.dtype != torch.bool:
            raise ValueError(
                f"dispatch_preprocess: routing_map must be a [T={num_tokens}, E={buffer.num_experts}] bool tensor, "
                f"got {list(routing_map.shape)} {routing_map.dtype}"
            )
        if routing_map.device.type == "cpu":  # checked where it costs no device synchronisation
            counts = routing_map.sum(dim=-1)
            if not bool((counts == buffer.topk).all()):
                raise ValueError(
                    f"dispatch_preprocess: every token must be routed to exactly topk={buffer.topk} experts (no token "
                    f"dropping), got counts {sorted(set(counts.tolist()))}"
                )
        idx = topk_ids_from_routing_map(routing_map, buffer.topk)
        self.plan = buffer.plan(idx)
        return hidden, probs.reshape(num_tokens, -1).gather(1, idx).float()

    def token_dispatch(self, hidden_states, probs):
        """(tokens [T, H], probs [T, K]) -> (rows [NvS, H] bf16, row probs [NvS] fp32) (collective)."""
        recv_x, recv_w, _ = self.buffer.dispatch(self.plan, hidden_states.to(_BF16), probs.float())
        self._recv_w = recv_w
        return recv_x, recv_w

    def dispatch_postprocess(self, hidden_states, probs):
        """-> (rows, tokens_per_expert [2*epn] int64, permuted_probs): see trim in the module docstring."""
        sizes = group_sizes(self.plan)
        if self.trim:
            sizes = sizes.cpu()
            total = int(sizes.sum())
            hidden_states, probs = hidden_states[:total], probs[:total]
        if self.probs_in_combine:
            probs = torch.ones_like(probs)
        return hidden_states, sizes, probs

    # ---- combine ----

    def combine_preprocess(self, hidden_states):
        """Expert outputs [rows, H] (rows as dispatch_postprocess gave them) -> [NvS, H] bf16."""
        rows = self.buffer.num_recv_rows
        y = hidden_states.to(_BF16)
        if y.shape[0] < rows:
            y = torch.cat([y, y.new_zeros(rows - y.shape[0], y.shape[1])])
        return y

    def token_combine(self, hidden_states):
        """[NvS, H] -> [T, H] bf16: each token's K rows summed (weighted by the row probs with probs_in_combine)
        (collective)."""
        weights = self._recv_w if self.probs_in_combine else None
        return self.buffer.combine(self.plan, hidden_states.contiguous(), weights)

    def combine_postprocess(self, hidden_states):
        """[T, H] -> the shape and dtype of dispatch_preprocess's tokens."""
        out = hidden_states.view(self._hidden_shape).to(self._dtype)
        self._recv_w = None
        return out
