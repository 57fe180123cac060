"""A vLLM-shaped prepare/finalize pair over a flatep.Buffer (inference: no autograd).

vLLM's modular fused-MoE kernel (vllm/model_executor/layers/fused_moe/modular_kernel.py, FusedMoEModularKernel)
splits a layer into [Router] -> [Quantize-Dispatch] -> [Permute-Experts-Unpermute] -> [Combine], the first and last
owned by a ``FusedMoEPrepareAndFinalize``. Without async, one layer call is:

    a1q, a1q_scale, expert_tokens_meta, ids, weights = prepare_finalize.prepare(
        hidden_states, topk_weights, topk_ids, global_num_experts, expert_map, apply_router_weight_on_input,
        fused_experts.quant_config, defer_input_quant=fused_experts.expects_unquantized_inputs)
    topk_ids = topk_ids if ids is None else ids                # likewise topk_weights
    fused_experts.apply(output=fused_out, hidden_states=a1q, w1=w1, w2=w2, topk_weights=topk_weights,
        topk_ids=topk_ids, ..., global_num_experts=..., expert_map=..., a1q_scale=a1q_scale, ...,
        expert_tokens_meta=expert_tokens_meta, apply_router_weight_on_input=...)
    prepare_finalize.finalize(output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input,
        fused_experts.finalize_weight_and_reduce_impl())

This class has those methods and the properties vLLM asks of one (activation_format, topk_indices_dtype,
max_num_tokens_per_rank, num_dispatchers, output_is_reduced, supports_async). Its format is vLLM's Standard one,
with each receive row a "token" of top-1:

* prepare returns the NvS receive rows (bf16, or e4m3 rows and [NvS, H/128] fp32 scales when the quant config asks
  for fp8 with 128-wide activation blocks: FlatEP quantises inside dispatch), ``ids`` [NvS, 1] = the row's group in
  [0, num_groups) (-1 for rows past the last group end, which are zeroed) and ``weights`` [NvS, 1] fp32 = the row's
  routing weight (0 on padding and past the end), and expert_tokens_meta.expert_num_tokens = [num_groups] int32 group
  sizes (on the device; expert_num_tokens_cpu None: no host synchronisation).
* The fused experts therefore run with **num_groups local experts and expert_map None**: w1 / w2 are the compute
  views ``flatep.integrations.ReplicatedExperts(...)(prepare_finalize.plan, w13_own, w2_own)`` ([2*epn, 2I, H] and
  [2*epn, H, I] in vLLM's layout), group g's expert is ``flatep.integrations.group_expert_ids(plan)[g]``.
* Serving with B < epn slots (a Buffer built from the serving pools, ``pools=experts.pools``): the groups are
  the R*Q + B rows of the pools' weights view, and w1 / w2 are that view itself,
  ``flatep.integrations.ServingExperts(group, epn, [(2I, H), (H, I)], B)(prepare_finalize.plan)`` (the own
  weights written once into ``experts.layer.own_weights(p)``; no per-step copy, replicas beyond the B slots read
  in place from their owners).
* finalize sums each token's K rows back on its rank into ``output`` [M, H] (in place): weighted by the row weights
  unless the experts already applied them (``weight_and_reduce_impl`` a TopKWeightAndReduceNoOP) or
  apply_router_weight_on_input was set (then prepare scaled the tokens before dispatch; vLLM allows it for top-1).
  fused_expert_output may be [NvS, H] or [NvS, 1, H].

State between prepare and finalize (the plan, the row weights) lives on the object: one call in flight at a time
(vLLM's dual-batch overlap needs one object per micro-batch).
"""

from dataclasses import dataclass

import torch

from .. import fp8 as _fp8
from ._common import group_sizes, row_group_ids

__all__ = ["FlatEPPrepareAndFinalize", "ExpertTokensMetadata", "E4M3"]

_BF16 = torch.bfloat16

#: The quant_dtype meaning e4m3 rows: torch.float8_e4m3fn, or on a torch without it (< 2.1) the string
#: "float8_e4m3fn" (a stand-in there; vLLM itself needs a newer torch).
E4M3 = _fp8.E4M3_DTYPE if _fp8.E4M3_DTYPE is not None else "float8_e4m3fn"

try:  # vLLM's own types where vLLM is installed
    from vllm.model_executor.layers.fused_moe.modular_kernel import (  # noqa: F401
        ExpertTokensMetadata,
        FusedMoEActivationFormat as _ActivationFormat,
    )
except Exception:  # noqa: BLE001 - any import failure means "no vLLM here"
    _ActivationFormat = None

    @dataclass
    class ExpertTokensMetadata:
        """Stand-in for vLLM's ExpertTokensMetadata (same fields) where vLLM is not installed."""

        expert_num_tokens: object
        expert_num_tokens_cpu: object = None


def _wants_fp8(quant_config, hidden):
    """True for fp8 activations in 128-wide blocks, False for unquantised ones; NotImplementedError otherwise."""
    quant_dtype = getattr(quant_config, "quant_dtype", None) if quant_config is not None else None
    if quant_dtype is None:
        return False
    block = getattr(quant_config, "block_shape", None)
    if quant_dtype == E4M3 and block is not None and int(block[-1]) == _fp8.BLOCK and hidden % _fp8.BLOCK == 0:
        return True
    raise NotImplementedError(
        f"FlatEPPrepareAndFinalize: FlatEP moves bf16 rows or e4m3 rows with one fp32 scale per 128 channels "
        f"(quant_dtype float8_e4m3fn, block_shape [*, 128]); got quant_dtype={quant_dtype!r}, block_shape={block!r} "
        f"(pass defer_input_quant=True to quantise in the experts)"
    )


class FlatEPPrepareAndFinalize:
    """vLLM ``FusedMoEPrepareAndFinalize`` (modular) methods over ``buffer`` (a flatep.Buffer of the EP group; S >=
    the tokens of a rank per forward, H = hidden size, E = global_num_experts, K = top_k).

    Attributes: ``plan`` (the last prepare's flatep.Plan), ``buffer``, ``num_groups`` (local experts of the fused
    experts: 2*epn, or R*Q + B for a serving Buffer)."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.num_groups = buffer.num_groups
        self.plan = None
        self._row_weights = None
        self._weights_applied = False

    # ---- the properties vLLM reads ----

    @property
    def activation_format(self):
        """vLLM's FusedMoEActivationFormat.Standard (the string 'standard' where vLLM is not installed)."""
        return _ActivationFormat.Standard if _ActivationFormat is not None else "standard"

    def topk_indices_dtype(self):
        return None  # int32 and int64 ids are both taken

    def max_num_tokens_per_rank(self):
        return self.buffer.num_tokens

    def num_dispatchers(self):
        return self.buffer.num_ranks

    def output_is_reduced(self):
        return False  # each rank gets its own tokens' outputs

    def supports_async(self):
        return False

    def supports_deferred_moe_finalize(self):
        return False

    def post_init_setup(self, fused_experts):
        del fused_experts

    # ---- prepare / finalize ----

    @torch.no_grad()
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        """Plans and dispatches (collective). Returns (rows, scales or None, ExpertTokensMetadata, ids [NvS, 1],
        weights [NvS, 1]); see the module docstring."""
        buffer = self.buffer
        if num_experts != buffer.num_experts:
            raise ValueError(f"prepare: num_experts={num_experts} but the Buffer has E={buffer.num_experts}")
        del expert_map  # groups are FlatEP's local numbering; the experts run with expert_map None
        fp8 = not defer_input_quant and _wants_fp8(quant_config, buffer.hidden)
        weights = topk_weights.float()
        x = a1
        if apply_router_weight_on_input:
            if topk_ids.shape[-1] != 1:
                raise ValueError("prepare: apply_router_weight_on_input needs top-1 routing")
            x = (a1.float() * weights).to(a1.dtype)
            weights = torch.ones_like(weights)
        plan = buffer.plan(topk_ids)
        groups = row_group_ids(plan)
        past_end = groups < 0
        if fp8:
            (rows, scales), recv_w, _ = buffer.dispatch(plan, x.to(_BF16), weights, fp8=True)
            _fp8.as_bytes(rows).masked_fill_(past_end.unsqueeze(1), 0)
            scales.masked_fill_(past_end.unsqueeze(1), 0)
        else:
            rows, recv_w, _ = buffer.dispatch(plan, x.to(_BF16), weights)
            scales = None
            rows.masked_fill_(past_end.unsqueeze(1), 0)
        recv_w = recv_w.masked_fill(past_end, 0)
        self.plan, self._row_weights, self._weights_applied = plan, recv_w, bool(apply_router_weight_on_input)
        meta = ExpertTokensMetadata(expert_num_tokens=group_sizes(plan).to(torch.int32), expert_num_tokens_cpu=None)
        return rows, scales, meta, groups.to(topk_ids.dtype).unsqueeze(1), recv_w.unsqueeze(1)

    @torch.no_grad()
    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        """Combines (collective) into ``output`` [M, H], in place."""
        del topk_weights, topk_ids  # the rows' weights and groups were kept by prepare
        buffer = self.buffer
        y = fused_expert_output.reshape(buffer.num_recv_rows, buffer.hidden).to(_BF16).contiguous()
        reduced = type(weight_and_reduce_impl).__name__ == "TopKWeightAndReduceNoOP"
        weighted = not (reduced or apply_router_weight_on_input or self._weights_applied)
        out = buffer.combine(self.plan, y, self._row_weights if weighted else None)
        output.copy_(out)
        self._row_weights = None
        return output
