"""A torchtitan-shaped token dispatcher over a flatep.Buffer.

In recent torchtitan (torchtitan/models/common/moe/moe.py, GroupedExperts.forward) the experts module calls its
``token_dispatcher`` as:

    routed_input, num_tokens_per_expert, metadata = dispatcher.dispatch(
        x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
    routed_output = self._experts_forward(routed_input, num_tokens_per_expert)
    out_TD = dispatcher.combine(routed_output, metadata, x_TD, num_local_tokens_after_padding=...)

with ``_experts_forward`` a SwiGLU grouped GEMM (``offsets = cumsum(num_tokens_per_expert)``,
``torch._grouped_mm`` over w1 [e, F, D], w3 [e, F, D], w2 [e, D, F], each transposed) whose output is unweighted: the
routing scores are applied in ``combine``. Meshes are handed over by ``wire_meshes(ep_mesh=..., tp_mesh=...)``.

This class has those methods. What differs, and what the experts module must do:

* ``num_tokens_per_expert`` has **2*epn** entries (the own experts, then the replica slots: see
  ``flatep.integrations.group_expert_ids(metadata.plan)``), padded to the Buffer's ``align`` (padding rows are zero
  and weigh 0), on the device (no host synchronisation). ``routed_input`` is all NvS receive rows; rows past
  sum(num_tokens_per_expert) are not written and combine ignores them (torch._grouped_mm ignores rows past the last
  offset; a for-loop over the counts never reads them).
* The GEMM runs over 2*epn weight matrices: ``w1, w2, w3 = replicated(metadata.plan, w1_local, w2_local, w3_local)``
  with ``replicated = flatep.integrations.ReplicatedExperts(group, epn, [(F, D), (D, F), (F, D)])``; the own
  (local, ``to_local()``) weights then get the whole gradient, replicas' included. torchtitan's ``_experts_forward``
  takes no metadata, so a FlatEP GroupedExperts overrides ``forward`` to fetch the weights between dispatch and the
  GEMM.
* ``combine`` weights each row by its routing score inside FlatEP's combine (fp32 sums, like torchtitan's own
  ``to(float32) * score`` then scatter-add); ``score_before_experts=True`` multiplies the rows by their scores after
  dispatch instead and combines unweighted (torchtitan's older option of that name).
* ``wire_meshes`` only checks the EP mesh's size against the Buffer's group (the Buffer was built for it);
  sequence-parallel shards (``tp_mesh`` of size > 1) are not supported.

Backward is FlatEP's (collective, the same graph on every rank): the scores' gradient returns to each token's rank.
"""

from dataclasses import dataclass

import torch

from ..buffer import Plan
from ._common import group_sizes

__all__ = ["FlatEPDispatchMetadata", "FlatEPTokenDispatcher"]

_BF16 = torch.bfloat16


@dataclass(frozen=True)
class FlatEPDispatchMetadata:
    """What combine needs: the step's plan and each receive row's routing score ([NvS] fp32, on the autograd graph;
    None when the scores were applied before the experts)."""

    plan: Plan
    row_scores: object = None


class FlatEPTokenDispatcher:
    """torchtitan token-dispatcher methods over ``buffer`` (a flatep.Buffer of the EP group; S >= the tokens of a
    rank's shard, H = dim, E = num_experts, K = top_k).

    Stateless between calls (all state is in the returned metadata), so micro-batches may overlap."""

    def __init__(self, buffer, *, score_before_experts=False):
        self.buffer = buffer
        self.num_experts, self.top_k = buffer.num_experts, buffer.topk
        self.score_before_experts = bool(score_before_experts)

    def wire_meshes(self, *, ep_mesh=None, tp_mesh=None):
        if tp_mesh is not None and tp_mesh.size() > 1:
            raise NotImplementedError("FlatEPTokenDispatcher: sequence-parallel shards (tp_mesh) are not supported")
        if ep_mesh is not None and ep_mesh.size() != self.buffer.num_ranks:
            raise ValueError(
                f"FlatEPTokenDispatcher: ep_mesh has {ep_mesh.size()} ranks, the Buffer's group "
                f"{self.buffer.num_ranks}"
            )
        self.ep_mesh = ep_mesh

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E=None):
        """-> (routed_input [NvS, D] bf16, num_tokens_per_expert [2*epn] int64, FlatEPDispatchMetadata). Plans from
        the expert ids (collective); num_local_tokens_per_expert_E is not needed and not read."""
        del num_local_tokens_per_expert_E
        plan = self.buffer.plan(topk_expert_ids_TK)
        recv_x, recv_w, _ = self.buffer.dispatch(plan, x_TD.to(_BF16), topk_scores_TK.float())
        if self.score_before_experts:
            recv_x = (recv_x.float() * recv_w.unsqueeze(1)).to(_BF16)
            recv_w = None
        return recv_x, group_sizes(plan), FlatEPDispatchMetadata(plan=plan, row_scores=recv_w)

    def combine(self, routed_output_RD, metadata, x_TD, *, num_local_tokens_after_padding=None,
                local_seq_len_after_padding=None):
        """routed_output [NvS, D] (unweighted expert outputs, rows as dispatch gave them) -> out [T, D] in x_TD's
        dtype: sum over each token's K rows of score * row (collective)."""
        if num_local_tokens_after_padding not in (None, x_TD.shape[0]):
            raise NotImplementedError("FlatEPTokenDispatcher: padded sequence-parallel shards are not supported")
        del local_seq_len_after_padding
        y = routed_output_RD.to(_BF16)
        rows = self.buffer.num_recv_rows
        if y.shape[0] < rows:  # an experts module that returned only the rows of its groups
            y = torch.cat([y, y.new_zeros(rows - y.shape[0], y.shape[1])])
        out = self.buffer.combine(metadata.plan, y.contiguous(), metadata.row_scores)
        return out.to(x_TD.dtype)
