"""flatep.integrations: each framework adapter driven through exactly the call sequence its framework makes (written
out below, per framework), on R = 2..4 virtual ranks of the CPU backend, against a dense single-process reference
(an explicit loop over every expert with the full weights): forward outputs and, for the training frameworks
(Megatron-Core, torchtitan), the gradients of the tokens, the router and every expert weight.

Routing is skewed (sigma 1.5) so that the plans use replica slots: the expert GEMMs run over 2*epn groups whose
weights come from ReplicatedExperts, and the replicas' gradients must come back to their owners.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_integrations.py
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import flatep
from flatep import fp8, testing, virtual
from flatep.integrations import (
    ReplicatedExperts,
    ServingExperts,
    group_expert_ids,
    group_sizes,
    megatron,
    row_group_ids,
    torchtitan,
    vllm,
)

S, E, K, FFN = 16, 12, 2, 16  # tokens per rank, experts, top-k, expert FFN size; E divisible by R = 2, 3, 4
BF16 = torch.bfloat16


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def bf16_exact(shape, gen, scale):
    """fp32 values that bf16 holds exactly (so the bf16 compute views hold the reference's weights)."""
    return (torch.randn(*shape, generator=gen) * scale).to(BF16).float()


@pytest.fixture(autouse=True)
def _release():
    testing.release_all()
    yield
    testing.release_all()


def make_world(R, H, align=8, topk=K):
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    buffers = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, H, E, topk, align=align))
    return ranks, buffers


def routing(R, topk=K, seed=5):
    return [testing.sample_topk(E, S, topk, r, sigma=1.5, seed=seed).long() for r in range(R)]


def router_probs(x, router_weight, idx):
    """Softmax router probabilities of the chosen experts, renormalised: [T, K] fp32 (differentiable)."""
    probs = torch.softmax(x.float() @ router_weight.t(), dim=-1).gather(1, idx)
    return probs / probs.sum(dim=-1, keepdim=True)


def dense_moe(x, router_weight, idx, expert_fn, weights, score_before_experts=False):
    """The reference: out[t] = sum_k p[t, k] * expert_{idx[t, k]}(x[t]) in fp32 with every expert's full weights
    (weights: a list of [E, ...] tensors); the token rows are rounded to bf16, as dispatch moves them.
    score_before_experts: sum_k expert_{idx[t, k]}(bf16(p[t, k] * x[t])) instead."""
    p = router_probs(x, router_weight, idx)
    rows = x.to(BF16).float()
    out = torch.zeros(x.shape[0], x.shape[1])
    for e in range(E):
        t, k = (idx == e).nonzero(as_tuple=True)
        if not t.numel():
            continue
        if score_before_experts:
            scaled = (rows[t] * p[t, k].unsqueeze(1)).to(BF16).float()
            out = out.index_add(0, t, expert_fn(scaled, *[w[e] for w in weights]))
        else:
            out = out.index_add(0, t, p[t, k].unsqueeze(1) * expert_fn(rows[t], *[w[e] for w in weights]))
    return out


def replicas_used(plans):
    return plans[0].stats["replicas"]


# ---------------------------------------------------------------- helpers


def test_group_helpers_describe_the_plan():
    R, H = 3, 32
    _, buffers = make_world(R, H)
    idx = routing(R)
    plans = virtual.run_threads(R, lambda r: buffers[r].plan(idx[r]))
    epn = E // R
    assert replicas_used(plans) > 0
    for r, plan in enumerate(plans):
        ids = group_expert_ids(plan)
        assert ids.tolist() == list(range(r * epn, (r + 1) * epn)) + plan.slot_expert.tolist()
        sizes = group_sizes(plan)
        ends = plan.cu_seqlens.long()
        assert sizes.shape == (2 * epn,) and torch.equal(sizes.cumsum(0), ends)
        rows = row_group_ids(plan)
        assert rows.shape == (buffers[r].num_recv_rows,)
        assert torch.equal(torch.bincount(rows[rows >= 0], minlength=2 * epn), sizes)
        assert bool((rows[ends[-1]:] == -1).all()) and bool((rows[:ends[-1]] >= 0).all())
        assert bool((sizes[epn:][plan.slot_expert < 0] == 0).all())  # unused slots have no rows
        # every real row is in a group of one of its token's experts
        real = plan.real_rows
        assert bool((rows[real] >= 0).all())


@pytest.mark.parametrize("R,num_slots", [(2, 1), (3, 0), (4, 2)])
def test_group_expert_ids_name_every_row_of_the_serving_view(R, num_slots):
    """Serving (B < epn): group_expert_ids names each of the R*Q + B view rows by the expert whose weights it holds,
    empty groups included: expert e at its row pools.view_row(e), -1 on every pad row between a rank's experts and the
    next rank's (Q > epn: 1 KiB experts on 4 KiB pages; R = 3 fills its pages, no pad row), then the B slots'
    plan.slot_expert. Every expert once, so an id is never one a row does not hold."""
    H = 32
    epn = E // R
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    serving = virtual.run_threads(R, lambda r: ServingExperts(ranks[r], epn, [(16, H)], num_slots))
    buffers = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, H, E, K, align=8,
                                                             pools=serving[r].pools))
    idx = routing(R)
    plans = virtual.run_threads(R, lambda r: buffers[r].plan(idx[r]))
    pools, Q = serving[0].pools, serving[0].view_stride
    assert (Q > epn) == (R != 3), Q
    own = [-1] * (R * Q)
    for e in range(E):
        own[pools.view_row(e)] = e
    assert sorted(own)[R * Q - E:] == list(range(E))
    for r, plan in enumerate(plans):
        ids = group_expert_ids(plan)
        assert ids.tolist() == own + plan.slot_expert[:num_slots].tolist(), r
        assert ids.numel() == serving[r].view_rows == group_sizes(plan).numel()


# ---------------------------------------------------------------- Megatron-Core


def megatron_router(hidden_states, router_weight, idx):
    """Megatron's TopKRouter returns (probs [T, E] with the top-k probabilities in place, routing_map [T, E] bool)."""
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    top = router_probs(tokens, router_weight, idx)
    probs = torch.zeros(tokens.shape[0], E).scatter(1, idx, top)
    routing_map = torch.zeros(tokens.shape[0], E, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing_map


def megatron_expert(x, fc1, fc2, probs=None):
    """GroupedMLP-style SwiGLU expert: fc1 [H, 2F] (gate and up), fc2 [F, H]; Megatron weights the activation by the
    row's probability (its weighted SwiGLU)."""
    gate, up = (x @ fc1).chunk(2, dim=-1)
    act = F.silu(gate) * up
    if probs is not None:
        act = act * probs.unsqueeze(-1)
    return act @ fc2


class MegatronExperts:
    """Stands where Megatron's experts module goes: forward(dispatched_input, tokens_per_expert, permuted_probs) ->
    (output, bias); a loop over tokens_per_expert.tolist() like Megatron's SequentialMLP / TE GroupedLinear m_splits,
    over the 2*epn compute weights of the step."""

    def __init__(self, dispatcher, replicated, fc1, fc2):
        self.dispatcher, self.replicated, self.fc1, self.fc2 = dispatcher, replicated, fc1, fc2

    def __call__(self, dispatched_input, tokens_per_expert, permuted_probs):
        fc1, fc2 = self.replicated(self.dispatcher.plan, self.fc1, self.fc2)
        assert fc1.shape[0] == len(tokens_per_expert) == self.dispatcher.num_groups
        counts = tokens_per_expert.tolist()
        pieces, start = [], 0
        for g, n in enumerate(counts):
            x = dispatched_input[start:start + n].float()
            pieces.append(megatron_expert(x, fc1[g].float(), fc2[g].float(), permuted_probs[start:start + n]).to(BF16))
            start += n
        out = torch.cat(pieces)
        if start < dispatched_input.shape[0]:  # trim=False: rows past the groups
            out = torch.cat([out, out.new_zeros(dispatched_input.shape[0] - start, out.shape[1])])
        return out, None


def megatron_moe_layer(dispatcher, experts, router_weight, hidden_states, idx):
    """The call sequence of Megatron-Core's MoELayer.forward (router_and_preprocess, dispatch,
    routed_experts_compute, combine) with the router's choice fixed to idx."""
    probs, routing_map = megatron_router(hidden_states, router_weight, idx)
    hidden, probs = dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
    dispatched_input, probs = dispatcher.token_dispatch(hidden, probs)
    dispatched_input, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(dispatched_input, probs)
    expert_output, mlp_bias = experts(dispatched_input, tokens_per_expert, permuted_probs)
    assert mlp_bias is None
    output = dispatcher.combine_preprocess(expert_output)
    output = dispatcher.token_combine(output)
    output = dispatcher.combine_postprocess(output)
    return output


@pytest.mark.parametrize(
    "R,trim,probs_in_combine",
    [(2, True, False), (3, True, False), (4, True, False), (2, False, False), (3, True, True)],
)
def test_megatron_dispatcher_matches_the_dense_reference(R, trim, probs_in_combine):
    H = 32
    ranks, buffers = make_world(R, H)
    epn = E // R
    g = torch.Generator().manual_seed(11)
    fc1 = bf16_exact((E, H, 2 * FFN), g, H ** -0.5)
    fc2 = bf16_exact((E, FFN, H), g, FFN ** -0.5)
    router_weight = torch.randn(E, H, generator=g) / H ** 0.5
    x = torch.randn(R * S, H, generator=g)
    gout = torch.randn(R * S, H, generator=g)
    idx = routing(R)

    config = SimpleNamespace(num_moe_experts=E, moe_router_topk=K, hidden_size=H)
    dispatchers = [megatron.FlatEPTokenDispatcher(buffers[r], config, trim=trim, probs_in_combine=probs_in_combine)
                   for r in range(R)]
    replicated = virtual.run_threads(R, lambda r: ReplicatedExperts(ranks[r], epn, [(H, 2 * FFN), (FFN, H)]))
    own1 = [fc1[r * epn:(r + 1) * epn].clone().requires_grad_() for r in range(R)]
    own2 = [fc2[r * epn:(r + 1) * epn].clone().requires_grad_() for r in range(R)]
    experts = [MegatronExperts(dispatchers[r], replicated[r], own1[r], own2[r]) for r in range(R)]
    routers = [router_weight.clone().requires_grad_() for _ in range(R)]  # replicated (data-parallel) parameter
    # Megatron's hidden states are [S/TP, B, H]: one micro-batch of 2 sequences of S/2 tokens per rank
    xs = [x[r * S:(r + 1) * S].clone().view(S // 2, 2, H).requires_grad_() for r in range(R)]

    def step(r):
        out = megatron_moe_layer(dispatchers[r], experts[r], routers[r], xs[r], idx[r])
        assert out.shape == xs[r].shape and out.dtype == xs[r].dtype
        (out.reshape(S, H).float() * gout[r * S:(r + 1) * S]).sum().backward()
        return out.reshape(S, H)

    outs = virtual.run_threads(R, step)
    assert replicas_used([d.plan for d in dispatchers]) > 0

    xr = x.clone().requires_grad_()
    rw = router_weight.clone().requires_grad_()
    w1 = fc1.clone().requires_grad_()
    w2 = fc2.clone().requires_grad_()
    ref = dense_moe(xr, rw, torch.cat(idx), megatron_expert, [w1, w2])
    (ref * gout).sum().backward()
    for r in range(R):
        lo, hi = r * epn, (r + 1) * epn
        assert rel_err(outs[r], ref[r * S:(r + 1) * S]) < 2e-2, f"rank {r}: output"
        assert rel_err(xs[r].grad.reshape(S, H), xr.grad[r * S:(r + 1) * S]) < 3e-2, f"rank {r}: grad x"
        assert rel_err(own1[r].grad, w1.grad[lo:hi]) < 3e-2, f"rank {r}: grad fc1"
        assert rel_err(own2[r].grad, w2.grad[lo:hi]) < 3e-2, f"rank {r}: grad fc2"
    assert rel_err(sum(w.grad for w in routers), rw.grad) < 3e-2, "router gradient (all-reduced over ranks)"


def test_megatron_dispatcher_refuses_dropped_tokens_and_a_mismatched_config():
    _, buffers = make_world(1, 32)
    with pytest.raises(ValueError, match=r"config.moe_router_topk=3 but the Buffer has 2"):
        megatron.FlatEPTokenDispatcher(buffers[0], SimpleNamespace(num_moe_experts=E, moe_router_topk=3))
    d = megatron.FlatEPTokenDispatcher(buffers[0])
    tokens = torch.randn(S, 32)
    routing_map = torch.zeros(S, E, dtype=torch.bool)
    routing_map[:, 0] = True  # one expert per token where topk is 2
    with pytest.raises(ValueError, match=r"exactly topk=2 experts \(no token dropping\), got counts \[1\]"):
        d.dispatch_preprocess(tokens, routing_map, torch.rand(S, E))


# ---------------------------------------------------------------- torchtitan


def titan_expert(x, w1, w2, w3):
    """torchtitan's SwiGLU expert: w1 [F, D], w2 [D, F], w3 [F, D] (each used transposed)."""
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def titan_run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert, bf16_math=False):
    """torchtitan's _run_experts_for_loop: split x[:sum(counts)] by the counts, one expert per split, zero rows for
    the rest (bf16 rows in, fp32 math, bf16 out). bf16_math: the matmuls on the bf16 weights themselves, so autograd
    saves the compute weights as returned (not fp32 copies) for backward."""
    counts = num_tokens_per_expert.tolist()
    total = sum(counts)
    if bf16_math:
        pieces = [titan_expert(xs, w1[e], w2[e], w3[e]) for e, xs in enumerate(torch.split(x[:total], counts, dim=0))]
    else:
        pieces = [titan_expert(xs.float(), w1[e].float(), w2[e].float(), w3[e].float()).to(BF16)
                  for e, xs in enumerate(torch.split(x[:total], counts, dim=0))]
    out = torch.cat(pieces)
    return torch.vstack((out, out.new_zeros((x.shape[0] - total, out.shape[-1]))))


class TitanGroupedExperts:
    """torchtitan's GroupedExperts.forward with a FlatEP dispatcher: dispatch, the step's 2*epn weights from the own
    (to_local) weights, the expert computation, combine."""

    def __init__(self, dispatcher, replicated, w1, w2, w3, bf16_math=False):
        self.token_dispatcher, self.replicated, self.bf16_math = dispatcher, replicated, bf16_math
        self.w1_EFD, self.w2_EDF, self.w3_EFD = w1, w2, w3

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E, *,
                num_local_tokens_after_padding):
        B, L, D = x_BLD.shape
        T, Kk = B * L, topk_scores_BLK.size(-1)
        x_TD = x_BLD.view(T, D)
        routed_input_RD, num_tokens_per_expert, metadata = self.token_dispatcher.dispatch(
            x_TD, topk_scores_BLK.view(T, Kk), topk_expert_ids_BLK.view(T, Kk), num_local_tokens_per_expert_E
        )
        self.last_plan = metadata.plan
        w1, w2, w3 = self.replicated(metadata.plan, self.w1_EFD, self.w2_EDF, self.w3_EFD)
        routed_output_RD = titan_run_experts_for_loop(w1, w2, w3, routed_input_RD, num_tokens_per_expert,
                                                      self.bf16_math)
        out_TD = self.token_dispatcher.combine(
            routed_output_RD, metadata, x_TD, num_local_tokens_after_padding=num_local_tokens_after_padding
        )
        return out_TD.view(B, -1, D)


def titan_moe(experts, router_weight, x_BLD, idx):
    """torchtitan's MoE.forward: the router gives (topk_scores, topk_expert_ids, scores) [B, L, *], the
    per-expert counts are a histogram of the ids, then GroupedExperts.forward."""
    B, L, D = x_BLD.shape
    ids = idx.view(B, L, K)
    scores = router_probs(x_BLD.reshape(-1, D), router_weight, idx).view(B, L, K)
    counts = torch.histc(ids.view(-1).float(), bins=E, min=0, max=E)
    return experts.forward(x_BLD, scores, ids, counts, num_local_tokens_after_padding=B * L)


def titan_world(R, H, seed, copy=True, score_before_experts=False, layers=1, bf16_math=False):
    ranks, buffers = make_world(R, H)
    epn = E // R
    g = torch.Generator().manual_seed(seed)
    shapes = [(FFN, H), (H, FFN), (FFN, H)]
    full = [[bf16_exact((E,) + s, g, s[1] ** -0.5) for s in shapes] for _ in range(layers)]
    router_weight = torch.randn(E, H, generator=g) / H ** 0.5
    dispatchers = [torchtitan.FlatEPTokenDispatcher(buffers[r], score_before_experts=score_before_experts)
                   for r in range(R)]
    for d in dispatchers:
        d.wire_meshes(ep_mesh=None)
    own = [[[w[r * epn:(r + 1) * epn].clone().requires_grad_() for w in full[l]] for r in range(R)]
           for l in range(layers)]
    experts = []
    for l in range(layers):
        replicated = virtual.run_threads(R, lambda r: ReplicatedExperts(ranks[r], epn, shapes, copy=copy))
        experts.append([TitanGroupedExperts(dispatchers[r], replicated[r], *own[l][r], bf16_math) for r in range(R)])
    return SimpleNamespace(ranks=ranks, buffers=buffers, epn=epn, full=full, own=own, experts=experts,
                           router_weight=router_weight, dispatchers=dispatchers, gen=g)


@pytest.mark.parametrize("R,copy,score_before_experts", [(2, True, False), (3, True, False), (4, True, False),
                                                         (2, False, False), (3, True, True)])
def test_torchtitan_dispatcher_matches_the_dense_reference(R, copy, score_before_experts):
    H = 32
    w = titan_world(R, H, seed=21, copy=copy, score_before_experts=score_before_experts)
    x = torch.randn(R * S, H, generator=w.gen)
    gout = torch.randn(R * S, H, generator=w.gen)
    idx = routing(R, seed=7)
    routers = [w.router_weight.clone().requires_grad_() for _ in range(R)]
    xs = [x[r * S:(r + 1) * S].clone().view(2, S // 2, H).requires_grad_() for r in range(R)]  # [B, L, D]

    def step(r):
        out = titan_moe(w.experts[0][r], routers[r], xs[r], idx[r])
        assert out.shape == xs[r].shape and out.dtype == xs[r].dtype
        (out.reshape(S, H).float() * gout[r * S:(r + 1) * S]).sum().backward()
        return out.reshape(S, H)

    outs = virtual.run_threads(R, step)
    assert replicas_used([e.last_plan for e in w.experts[0]]) > 0
    xr = x.clone().requires_grad_()
    rw = w.router_weight.clone().requires_grad_()
    ws = [t.clone().requires_grad_() for t in w.full[0]]
    ref = dense_moe(xr, rw, torch.cat(idx), titan_expert, ws, score_before_experts)
    (ref * gout).sum().backward()
    for r in range(R):
        lo, hi = r * w.epn, (r + 1) * w.epn
        assert rel_err(outs[r], ref[r * S:(r + 1) * S]) < 2e-2, f"rank {r}: output"
        assert rel_err(xs[r].grad.reshape(S, H), xr.grad[r * S:(r + 1) * S]) < 3e-2, f"rank {r}: grad x"
        for name, own, full in zip(("w1", "w2", "w3"), w.own[0][r], ws):
            assert rel_err(own.grad, full.grad[lo:hi]) < 3e-2, f"rank {r}: grad {name}"
    assert rel_err(sum(t.grad for t in routers), rw.grad) < 3e-2, "router gradient (all-reduced over ranks)"


def test_torchtitan_two_layers_share_one_buffer_and_the_slot_pool():
    """Two MoE layers, one Buffer and one shared ExpertPools per rank: both forwards run before either backward (the
    second layer's prefetch rewrites the slot pool the first one used), as in a model's step. The experts compute on
    the bf16 weights ReplicatedExperts returned, so backward reads them as forward saw them."""
    R, H = 2, 32
    w = titan_world(R, H, seed=33, layers=2, bf16_math=True)
    x = torch.randn(R * S, H, generator=w.gen)
    gout = torch.randn(R * S, H, generator=w.gen)
    idx = [routing(R, seed=8), routing(R, seed=9)]
    xs = [x[r * S:(r + 1) * S].clone().view(1, S, H).requires_grad_() for r in range(R)]
    routers = [w.router_weight.clone().requires_grad_() for _ in range(R)]

    def step(r):
        h = xs[r]
        for layer in range(2):
            h = h + titan_moe(w.experts[layer][r], routers[r], h, idx[layer][r])
        (h.reshape(S, H).float() * gout[r * S:(r + 1) * S]).sum().backward()
        return h.reshape(S, H)

    outs = virtual.run_threads(R, step)
    xr = x.clone().requires_grad_()
    rw = w.router_weight.clone().requires_grad_()
    ws = [[t.clone().requires_grad_() for t in w.full[layer]] for layer in range(2)]
    h = xr
    for layer in range(2):
        h = h + dense_moe(h, rw, torch.cat(idx[layer]), titan_expert, ws[layer])
    (h * gout).sum().backward()
    for r in range(R):
        lo, hi = r * w.epn, (r + 1) * w.epn
        assert rel_err(outs[r], h[r * S:(r + 1) * S]) < 2e-2, f"rank {r}: output"
        assert rel_err(xs[r].grad.reshape(S, H), xr.grad[r * S:(r + 1) * S]) < 3e-2, f"rank {r}: grad x"
        for layer in range(2):
            for own, full in zip(w.own[layer][r], ws[layer]):
                assert rel_err(own.grad, full.grad[lo:hi]) < 3e-2, f"rank {r}: layer {layer} expert grads"
    assert rel_err(sum(t.grad for t in routers), rw.grad) < 3e-2


# ---------------------------------------------------------------- vLLM


def vllm_expert(x, w13, w2):
    """vLLM's layout: w13 [2I, H] (gate then up), w2 [H, I]; silu_and_mul between them."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


class TopKWeightAndReduceDelegate:  # stand-ins, named as vLLM's (finalize reads the class name)
    pass


class TopKWeightAndReduceNoOP:
    pass


class VllmFusedExperts:
    """A Standard-format fused-experts stand-in: apply(output, hidden_states, w1, w2, topk_weights, topk_ids, ...)
    computes each row with its topk expert (ids in [0, local_num_experts), -1: skipped), weighting the rows itself
    only when it finalizes with TopKWeightAndReduceNoOP."""

    def __init__(self, quant_config, weights_in_experts):
        self.quant_config = quant_config
        self.expects_unquantized_inputs = False
        self.weights_in_experts = weights_in_experts

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP() if self.weights_in_experts else TopKWeightAndReduceDelegate()

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts, expert_map,
              a1q_scale, expert_tokens_meta, apply_router_weight_on_input):
        assert expert_map is None and w1.shape[0] == global_num_experts
        rows = fp8.dequantize(hidden_states, a1q_scale) if a1q_scale is not None else hidden_states.float()
        ids = topk_ids[:, 0].long()
        assert torch.equal(torch.bincount(ids[ids >= 0], minlength=w1.shape[0]),
                           expert_tokens_meta.expert_num_tokens.long())
        out = torch.zeros(rows.shape[0], w2.shape[1])
        for e in range(w1.shape[0]):
            sel = (ids == e).nonzero(as_tuple=True)[0]
            if sel.numel():
                out[sel] = vllm_expert(rows[sel], w1[e].float(), w2[e].float())
        if self.weights_in_experts:
            out = out * topk_weights.float()
        output.copy_(out.to(output.dtype))


def vllm_modular_kernel_apply(prepare_finalize, fused_experts, replicated, w13_own, w2_own, hidden_states,
                              topk_weights, topk_ids, global_num_experts, apply_router_weight_on_input=False):
    """The call sequence of vLLM's FusedMoEModularKernel.apply without async: prepare, the fused experts on the
    prepared rows (over the step's 2*epn compute weights), finalize into output."""
    output = torch.empty_like(hidden_states)
    a1q, a1q_scale, expert_tokens_meta, ids, weights = prepare_finalize.prepare(
        hidden_states, topk_weights, topk_ids, global_num_experts, None, apply_router_weight_on_input,
        fused_experts.quant_config, defer_input_quant=fused_experts.expects_unquantized_inputs,
    )
    topk_ids = topk_ids if ids is None else ids
    topk_weights = topk_weights if weights is None else weights
    w1, w2 = replicated(prepare_finalize.plan, w13_own, w2_own)
    local_num_experts = w1.shape[0]
    fused_out = torch.empty(a1q.shape[0], hidden_states.shape[1], dtype=hidden_states.dtype)
    fused_experts.apply(fused_out, a1q, w1, w2, topk_weights, topk_ids, local_num_experts, None, a1q_scale,
                        expert_tokens_meta, apply_router_weight_on_input)
    prepare_finalize.finalize(output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input,
                              fused_experts.finalize_weight_and_reduce_impl())
    return output


@pytest.mark.parametrize("R,mode", [(2, "delegate"), (3, "noop"), (4, "delegate"), (2, "fp8"), (3, "router_on_input")])
def test_vllm_prepare_finalize_matches_the_dense_reference(R, mode):
    H = 128  # a multiple of 128: FP8 rows carry one scale per 128 channels
    topk = 1 if mode == "router_on_input" else K  # vLLM applies the weights on the input only for top-1
    ranks, buffers = make_world(R, H, topk=topk)
    epn = E // R
    g = torch.Generator().manual_seed(41)
    w13 = bf16_exact((E, 2 * FFN, H), g, H ** -0.5)
    w2 = bf16_exact((E, H, FFN), g, FFN ** -0.5)
    router_weight = torch.randn(E, H, generator=g) / H ** 0.5
    x = torch.randn(R * S, H, generator=g).to(BF16)
    idx = [i.to(torch.int32) for i in routing(R, topk=topk, seed=3)]  # vLLM's topk_ids are int32
    quant = SimpleNamespace(quant_dtype=vllm.E4M3, block_shape=[128, 128]) if mode == "fp8" else None
    pfs = [vllm.FlatEPPrepareAndFinalize(buffers[r]) for r in range(R)]
    assert pfs[0].num_dispatchers() == R and pfs[0].max_num_tokens_per_rank() == S
    assert pfs[0].activation_format == "standard" and not pfs[0].output_is_reduced()
    experts = VllmFusedExperts(quant, weights_in_experts=(mode == "noop"))
    replicated = virtual.run_threads(R, lambda r: ReplicatedExperts(ranks[r], epn, [(2 * FFN, H), (H, FFN)]))
    xs = [x[r * S:(r + 1) * S] for r in range(R)]
    weights = [router_probs(xs[r], router_weight, idx[r].long()) for r in range(R)]

    def step(r):
        with torch.no_grad():
            return vllm_modular_kernel_apply(
                pfs[r], experts, replicated[r], w13[r * epn:(r + 1) * epn], w2[r * epn:(r + 1) * epn], xs[r],
                weights[r], idx[r], E, apply_router_weight_on_input=(mode == "router_on_input"),
            )

    outs = virtual.run_threads(R, step)
    assert replicas_used([p.plan for p in pfs]) > 0
    rows = x.float()
    if mode == "fp8":  # the same quantisation rule FlatEP applies inside dispatch
        rows = fp8.dequantize(*fp8.quantize(x))
    elif mode == "router_on_input":  # prepare scales the bf16 tokens by their top-1 weight before dispatch
        rows = (rows * torch.cat(weights)).to(BF16).float()
    p = torch.cat(weights)
    ref = torch.zeros(R * S, H)
    cat_idx = torch.cat(idx).long()
    for e in range(E):
        t, k = (cat_idx == e).nonzero(as_tuple=True)
        if t.numel():
            scale = torch.ones_like(p[t, k]) if mode == "router_on_input" else p[t, k]
            ref = ref.index_add(0, t, scale.unsqueeze(1) * vllm_expert(rows[t], w13[e], w2[e]))
    for r in range(R):
        assert outs[r].dtype == BF16 and outs[r].shape == (S, H)
        assert rel_err(outs[r], ref[r * S:(r + 1) * S]) < 2e-2, f"rank {r}: output"


@pytest.mark.parametrize("R,num_slots,planner", [(2, 0, "balanced"), (3, 1, "balanced"), (4, 2, "owner")])
def test_vllm_serving_view_matches_the_dense_reference(R, num_slots, planner):
    """B < epn: the same call sequence, the fused experts over ServingExperts' [R*Q + B] weights view (own weights
    written once, replicas beyond the B slots read in place), groups named by group_expert_ids."""
    H = 128
    epn = E // R
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    g = torch.Generator().manual_seed(43)
    w13 = bf16_exact((E, 2 * FFN, H), g, H ** -0.5)
    w2 = bf16_exact((E, H, FFN), g, FFN ** -0.5)
    router_weight = torch.randn(E, H, generator=g) / H ** 0.5
    x = torch.randn(R * S, H, generator=g).to(BF16)
    idx = [i.to(torch.int32) for i in routing(R, seed=3)]
    serving = virtual.run_threads(R, lambda r: ServingExperts(ranks[r], epn, [(2 * FFN, H), (H, FFN)], num_slots))
    buffers = virtual.run_threads(R, lambda r: flatep.Buffer(
        ranks[r], S, H, E, K, align=8, planner=planner, pools=serving[r].pools))
    for r in range(R):  # once, at load time: the memory every rank's view reads
        serving[r].layer.own_weights(0).copy_(w13[r * epn:(r + 1) * epn])
        serving[r].layer.own_weights(1).copy_(w2[r * epn:(r + 1) * epn])
    pfs = [vllm.FlatEPPrepareAndFinalize(buffers[r]) for r in range(R)]
    assert pfs[0].num_groups == R * serving[0].view_stride + num_slots == serving[0].view_rows
    experts = VllmFusedExperts(None, weights_in_experts=False)
    xs = [x[r * S:(r + 1) * S] for r in range(R)]
    weights = [router_probs(xs[r], router_weight, idx[r].long()) for r in range(R)]

    def step(r):
        with torch.no_grad():
            return vllm_modular_kernel_apply(pfs[r], experts, lambda plan, *_: serving[r](plan), None, None, xs[r],
                                             weights[r], idx[r], E)

    outs = virtual.run_threads(R, step)
    for r in range(R):
        plan = pfs[r].plan
        used = int((plan.slot_expert >= 0).sum())
        assert used <= num_slots and (planner != "owner" or used == 0)
        ids = group_expert_ids(plan)
        view = serving[r].layer.weights(0)
        for grp in range(ids.numel()):  # every group's view row holds its expert's weights
            if group_sizes(plan)[grp] > 0:
                assert torch.equal(view[grp].float(), w13[int(ids[grp])]), (r, grp)
    if planner == "balanced" and num_slots > 0:
        assert replicas_used([p.plan for p in pfs]) > 0
    ref = dense_moe(x.float(), router_weight, torch.cat(idx).long(), vllm_expert, [w13, w2])
    for r in range(R):
        assert rel_err(outs[r], ref[r * S:(r + 1) * S]) < 2e-2, f"rank {r}: output"


def test_vllm_prepare_refuses_a_quantisation_flatep_does_not_move():
    _, buffers = make_world(1, 128)
    pf = vllm.FlatEPPrepareAndFinalize(buffers[0])
    quant = SimpleNamespace(quant_dtype=torch.int8, block_shape=None)
    x = torch.randn(S, 128).to(BF16)
    ids = torch.zeros(S, K, dtype=torch.int32)
    ids[:, 1] = 1
    with pytest.raises(NotImplementedError, match=r"bf16 rows or e4m3 rows"):
        pf.prepare(x, torch.rand(S, K), ids, E, None, False, quant)
    with pytest.raises(ValueError, match=r"num_experts=8 but the Buffer has E=12"):
        pf.prepare(x, torch.rand(S, K), ids, 8, None, False, None)
