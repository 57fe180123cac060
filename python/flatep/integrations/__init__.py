"""Adapters shaped like the token-dispatcher interfaces MoE frameworks call, each over one flatep.Buffer:

* :class:`flatep.integrations.megatron.FlatEPTokenDispatcher` -- Megatron-Core's ``MoETokenDispatcher`` methods
  (dispatch_preprocess / token_dispatch / dispatch_postprocess, combine_preprocess / token_combine /
  combine_postprocess); autograd-aware (training).
* :class:`flatep.integrations.torchtitan.FlatEPTokenDispatcher` -- torchtitan's ``dispatch(x, topk_scores,
  topk_expert_ids, ...) -> (routed_input, num_tokens_per_expert, metadata)`` and ``combine(routed_output, metadata,
  x)``; autograd-aware (training).
* :class:`flatep.integrations.vllm.FlatEPPrepareAndFinalize` -- vLLM's ``FusedMoEPrepareAndFinalize`` prepare /
  finalize (inference).

None of them imports its framework (vLLM's own types are used when vLLM is importable). All of them hand the experts
**2*epn row groups** per rank -- the rank's own epn experts, then epn replica slots that the plan fills with copies of
hot experts -- so the framework's grouped GEMM runs over 2*epn weight matrices:

* :func:`group_sizes` (tokens per group), :func:`group_expert_ids` (the expert of each group: own ``rank*epn + g``,
  then ``plan.slot_expert``, -1 for an unused slot) and :func:`row_group_ids` (the group of each receive row), all
  on the device without a host synchronisation;
* :class:`ReplicatedExperts` -- ``weights = replicated(plan, *own_weights)``: the [2*epn, ...] compute weights of the
  step (own experts from the framework's parameters, replicas fetched from their owners), differentiable: the own
  parameters' gradient includes what their replicas computed on other ranks.

* :class:`ServingExperts` -- serving (a Buffer built from pools with num_slots B < epn): ``weights = serving(plan)`` is the pools'
  [R*Q + B, ...] weights view itself (every rank's own experts read in place, then this rank's B prefetched slots),
  one group per view row; inference only, no copy.

Every call is collective over the Buffer's group, forward and backward, as for Buffer itself.
"""

from ._common import ReplicatedExperts, ServingExperts, group_expert_ids, group_sizes, row_group_ids
from . import megatron, torchtitan, vllm  # noqa: E402

__all__ = ["ReplicatedExperts", "ServingExperts", "group_expert_ids", "group_sizes", "row_group_ids", "megatron", "torchtitan", "vllm"]
