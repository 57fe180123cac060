"""Serving from Python (issues 43 and 47) on virtual ranks of the CPU backend: nn.MoE with num_slots B in
{0, 1, epn-1, epn} and the owner planner against the dense reference and against each other, with ragged ranks (one
of them empty); the plans' slot use (at most B) and their groups (one per view row); the weights view's shape, rows
and memory (the layer's own weights, written through one and read through the other); FP8 weights with their scales
in the pools, prefetched bytewise; s = 0 on every op, forward and backward; the one-line errors.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_serving.py
"""

import pytest
import torch

import flatep
from flatep import fp8, testing, virtual

BF16 = torch.bfloat16
R, EPN, S, H, F, K = 3, 4, 12, 16, 8, 2
E = R * EPN
COUNTS = [S, 0, 7]  # ragged ranks, one empty
TOL = 2.0**-7  # one bf16 ulp at the largest magnitude: the CPU GEMM's rows may round differently per group size


@pytest.fixture(autouse=True)
def _release():
    testing.release_all()
    yield
    testing.release_all()


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def skewed(counts, sigma=1.5, seed=4):
    """Per-rank topk_idx [s_r, K] with hot experts on a few ranks (so the balanced plans want replicas)."""
    return [testing.sample_topk(E, S, K, r, sigma=sigma, seed=seed)[:s].long() for r, s in enumerate(counts)]


def run_layers(num_slots, planner, counts=COUNTS, seed=3):
    """(outputs per rank, plans per rank, layers) of one inference step of nn.MoE on R virtual ranks."""
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=4, seed=seed,
                                                          num_slots=num_slots, planner=planner))
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(s, H, generator=g) for s in counts]
    idx = skewed(counts)

    def step(r):
        with torch.no_grad():
            return moes[r](xs[r], idx[r])

    outs = virtual.run_threads(R, step)
    return outs, [m.last_plan for m in moes], moes, xs, idx


MODES = [(0, "balanced"), (1, "balanced"), (EPN - 1, "greedy"), (EPN, "balanced"), (None, "owner"), (1, "owner")]


def test_moe_serving_modes_match_the_dense_reference_and_each_other():
    dense = testing.DenseMoE(H, F, E, K, seed=3)
    results = {}
    for num_slots, planner in MODES:
        testing.release_all()
        outs, plans, moes, xs, idx = run_layers(num_slots, planner)
        ref = dense(torch.cat(xs), torch.cat(idx), chunks=COUNTS)
        out = torch.cat(outs)
        assert out.shape == (sum(COUNTS), H) and outs[1].shape == (0, H)
        assert rel_err(out, ref) < TOL, f"B={num_slots} {planner}: output against the dense reference"
        results[(num_slots, planner)] = out
        B = EPN if num_slots is None else num_slots
        pools = moes[0].pools
        for r, plan in enumerate(plans):
            slots = plan.slot_expert.tolist()
            assert len(slots) == EPN and all(e == -1 for e in slots[B:]), f"rank {r}: slots past B={B} used"
            used = sum(e >= 0 for e in slots)
            assert used <= B, f"rank {r}: {used} slots used, B={B}"
            if planner == "owner":
                assert used == 0, f"rank {r}: the owner planner placed a replica"
            groups = pools.view_rows
            assert plan.cu_seqlens.shape == (groups,) and moes[r].buffer.num_groups == groups
            assert groups == (R * pools.view_stride + B if B < EPN else 2 * EPN)
        loads = plans[0].stats["loads"]
        if planner == "owner":  # every entry on its expert's home rank
            assert loads == plans[0].stats["loads_before"]
        else:  # balanced whatever B
            assert max(loads) - min(loads) <= 1 or loads == [sum(COUNTS) * K // R] * R
        if num_slots is not None and 0 < num_slots < EPN and planner == "balanced":
            assert plans[0].stats["replicas"] > 0, "the skewed routing should use slots"
    base = results[(EPN, "balanced")]
    for mode, out in results.items():
        assert rel_err(out, base) < TOL, f"{mode} against B=epn"


def test_remote_rows_are_computed_from_the_owners_memory():
    """B = 0: every row of a remote expert is computed on a rank that holds no copy of it, through the view's row
    of its home rank (the plan's group there has rows); the output still equals the dense reference."""
    outs, plans, moes, xs, idx = run_layers(0, "balanced")
    pools = moes[0].pools
    remote_rows = 0
    for r, plan in enumerate(plans):
        cu = plan.cu_seqlens.tolist()
        sizes = [cu[0]] + [max(0, b - a) for a, b in zip(cu, cu[1:])]
        for e in range(E):
            if e // EPN != r:
                remote_rows += sizes[pools.view_row(e)]
    assert remote_rows > 0, "no rank computed a remote expert in place"
    ref = testing.DenseMoE(H, F, E, K, seed=3)(torch.cat(xs), torch.cat(idx), chunks=COUNTS)
    assert rel_err(torch.cat(outs), ref) < TOL


def test_weights_view_shape_rows_and_shared_memory():
    B = 1
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    shapes = [(H, 2 * F), (F, H)]

    def make(r):
        pools = flatep.ExpertPools(ranks[r], EPN, shapes, num_slots=B)
        return pools, pools.register_layer()

    made = virtual.run_threads(R, make)
    pools, _ = made[0]
    Q = pools.view_stride
    assert pools.serving and not pools.trains and pools.num_slots == B and Q >= EPN
    assert pools.view_rows == R * Q + B
    assert [pools.view_row(e) for e in range(E)] == [(e // EPN) * Q + e % EPN for e in range(E)]
    for r, (p, layer) in enumerate(made):
        for q, (rows, cols) in enumerate(shapes):
            assert layer.weights(q).shape == (R * Q + B, rows, cols) and layer.weights(q).dtype == BF16
            assert layer.own_weights(q).shape == (EPN, rows, cols)
            assert layer.grads(q) is None and layer.own_grads(q) is None and p.reduce_pool(q) is None
            assert p.slot_pool(q).shape == (B, rows, cols)
    # Write the own weights through own_weights, read them through every rank's view (no copy, no op between).
    for r, (_, layer) in enumerate(made):
        for q in range(2):
            own = layer.own_weights(q)
            for local in range(EPN):
                own[local].fill_(float(100 * r + 10 * q + local))
    for r, (p, layer) in enumerate(made):
        for q in range(2):
            view = layer.weights(q)
            for e in range(E):
                want = float(100 * (e // EPN) + 10 * q + e % EPN)
                assert torch.all(view[p.view_row(e)] == want), f"rank {r} reads expert {e} wrong"
    # And the other way: a write into a rank's view row of an expert shows in its owner's own_weights.
    # (own_weights is the owner's own mapping of that memory, the view another: same bytes, other addresses.)
    made[1][1].weights(0)[pools.view_row(0)][0, 0] = 7.0
    assert made[0][1].own_weights(0)[0, 0, 0].item() == 7.0
    made[2][1].weights(1)[pools.view_row(2 * EPN + 1)][1, 2] = -3.0
    assert made[2][1].own_weights(1)[1, 1, 2].item() == -3.0


def e4m3_dtype():
    return fp8.E4M3_DTYPE if fp8.E4M3_DTYPE is not None else torch.uint8


@pytest.mark.parametrize("num_slots", [1, EPN - 1, None])
def test_fp8_weights_and_scales_prefetched_bytewise(num_slots):
    """An e4m3 projection with its fp32 block scales (and a bf16 one) in the pools: after prefetch every slot holds
    the bytes of its expert's owner, and every view row of an expert the owner's own bytes."""
    shapes = [(H, 32, e4m3_dtype()), (2, 4, torch.float32), (F, H)]  # e4m3 weights, their block scales, bf16
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)

    def make(r):
        pools = flatep.ExpertPools(ranks[r], EPN, shapes, num_slots=num_slots)
        buffer = flatep.Buffer(ranks[r], S, H, E, K, align=4, pools=pools)  # training pools: the training layout
        layer = pools.register_layer()
        g = torch.Generator().manual_seed(100 + r)
        for q in range(len(shapes)):
            own = fp8.as_bytes(layer.own_weights(q)) if q == 0 else layer.own_weights(q).view(torch.uint8)
            own.copy_(torch.randint(0, 256, own.shape, generator=g, dtype=torch.uint8))
        return pools, buffer, layer

    made = virtual.run_threads(R, make)
    pools = made[0][0]
    assert not pools.trains and pools.dtypes == [e4m3_dtype(), torch.float32, BF16]
    assert made[0][2].weights(0).dtype == e4m3_dtype() and made[0][2].weights(1).dtype == torch.float32
    idx = skewed([S] * R)

    def step(r):
        pools, buffer, layer = made[r]
        plan = buffer.plan(idx[r])
        pools.prefetch(plan, layer, plan_ordered=pools.serving)  # serving: the pull ordered by the plan op's barrier
        with pytest.raises(ValueError, match=r"reduce_grad: these pools are forward-only"):
            pools.reduce_grad(plan, layer)
        return plan

    plans = virtual.run_threads(R, step)
    assert plans[0].stats["replicas"] > 0

    def raw(t):
        return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t

    owners = [[raw(made[r][2].own_weights(q)) for q in range(len(shapes))] for r in range(R)]
    for r, (p, _, layer) in enumerate(made):
        first_slot = R * p.view_stride if p.serving else EPN
        for q in range(len(shapes)):
            view = raw(layer.weights(q))
            for j, e in enumerate(plans[r].slot_expert.tolist()):
                if e >= 0:
                    assert torch.equal(view[first_slot + j], owners[e // EPN][q][e % EPN]), (r, q, j, e)
            if p.serving:
                for e in range(E):
                    assert torch.equal(view[p.view_row(e)], owners[e // EPN][q][e % EPN]), (r, q, e)


def test_empty_ranks_every_op_forward_and_backward():
    """s = 0 on a rank (and on every rank at once) through every op of a Buffer and nn.MoE forward and backward,
    training pools, the CPU backend."""
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    H8 = 128  # FP8 rows need H % 128 == 0
    bufs = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, H8, E, K, align=4))
    for counts in (COUNTS, [0] * R):
        idx = skewed(counts)

        def ops(r):
            s, b = counts[r], bufs[r]
            x = torch.randn(s, H8).to(BF16).requires_grad_()
            w = torch.rand(s, K, requires_grad=True)
            plan = b.plan(idx[r])
            recv_x, recv_w, _ = b.dispatch(plan, x, w)
            out = b.combine(plan, recv_x, recv_w)
            out.float().sum().backward()
            values = b.entry_values(plan, torch.ones(b.num_recv_rows))
            with torch.no_grad():
                (q, scales), _, _ = b.dispatch(plan, x.detach(), w.detach(), fp8=True)
                b.dispatch(plan, x.detach(), w.detach(), zero_copy=True)
            return out.shape, x.grad.shape, w.grad.shape, values.shape, q.shape

        for r, shapes in enumerate(virtual.run_threads(R, ops)):
            s = counts[r]
            assert shapes[:4] == ((s, H8), (s, H8), (s, K), (s, K)), (counts, r, shapes)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=4, seed=3,
                                                          shared_ffn=8))
    dense = testing.DenseMoE(H, F, E, K, seed=3, shared_ffn=8)
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(sum(COUNTS), H, generator=g)
    idx = skewed(COUNTS)
    xs = [x.clone().requires_grad_() for x in x_all.split(COUNTS)]

    def train(r):
        out = moes[r](xs[r], idx[r])
        (out.float() ** 2).sum().backward()
        empty = moes[r].forward_microbatches([xs[r], xs[r][:0]], [idx[r], idx[r][:0]])
        assert empty[1].shape == (0, H)
        (empty[0].float() ** 2).sum().backward()
        return out

    outs = virtual.run_threads(R, train)
    xr = x_all.clone().requires_grad_()
    ref = dense(xr, torch.cat(idx), chunks=COUNTS)
    (ref.float() ** 2).sum().backward()
    assert rel_err(torch.cat(outs), ref) < TOL
    assert xs[1].grad.shape == (0, H)
    # Gradients after two backwards (the step and the micro-batches): x's grad doubled against one dense backward.
    assert rel_err(torch.cat([x.grad for x in xs]), 2 * xr.grad) < 2.0**-6


def test_use_planner_switches_buffers_over_the_same_weights():
    """Prefill with the balanced planner and B slots, decode with the owner planner, one layer and one set of
    weights: the two Buffers share the pools (num_slots, view_stride) and each step matches the dense reference."""
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=4, seed=3,
                                                          num_slots=1))
    dense = testing.DenseMoE(H, F, E, K, seed=3)
    prefill = [m.buffer for m in moes]
    for planner, counts in (("balanced", COUNTS), ("owner", [2, 0, 1]), ("balanced", [3, 5, 0])):
        g = torch.Generator().manual_seed(len(counts) + sum(counts))
        xs = [torch.randn(s, H, generator=g) for s in counts]
        decode_s = None if planner == "balanced" else 4
        buffers = virtual.run_threads(R, lambda r: moes[r].use_planner(planner, decode_s if decode_s else S))
        assert all(b.planner == planner and b.num_slots == 1 for b in buffers)
        if planner == "balanced":
            assert buffers[0] is prefill[0], "switching back must reuse the prefill Buffer"
        else:
            assert buffers[0].num_recv_rows >= R * 4 * K  # the owner planner's worst case R*S*K

        def step(r):
            with torch.inference_mode():
                return moes[r](xs[r])

        outs = virtual.run_threads(R, step)
        assert rel_err(torch.cat(outs), dense(torch.cat(xs), chunks=counts)) < TOL, planner


def test_errors_name_the_argument_and_the_value():
    ranks = virtual.virtual_ranks(1, "cpu", timeout_s=10)
    with pytest.raises(ValueError, match=r"^ExpertPools: num_slots \(B\) must be -1 \(= epn\) or in \[0, epn=4\], "
                                         r"got 5$"):
        flatep.ExpertPools(ranks[0], 4, [(8, 8)], num_slots=5)
    with pytest.raises(ValueError, match=r"^ExpertPools: num_slots must be None or an int >= 0, got -1$"):
        flatep.ExpertPools(ranks[0], 4, [(8, 8)], num_slots=-1)
    with pytest.raises(ValueError, match=r"^ExpertPools: num_slots must be an int, got 1.5$"):
        flatep.ExpertPools(ranks[0], 4, [(8, 8)], num_slots=1.5)
    with pytest.raises(ValueError, match=r"projection 0 dtype must be one of"):
        flatep.ExpertPools(ranks[0], 4, [(8, 8, torch.float16)])
    with pytest.raises(ValueError, match=r"^ExpertPools: projection 0 of \[4\]\[3\] has 12 bytes per expert \(e4m3\)"):
        flatep.ExpertPools(ranks[0], 4, [(4, 3, torch.uint8)])
    with pytest.raises(ValueError, match=r"^Buffer: pools must be a flatep.ExpertPools or None, got int$"):
        flatep.Buffer(ranks[0], S, H, 4, 1, pools=6)
    with pytest.raises(ValueError, match=r"^Buffer: planner must be 'balanced', 'greedy', 'owner' or 'static', got 'fast'$"):
        flatep.Buffer(ranks[0], S, H, 4, 1, planner="fast")
    with pytest.raises(ValueError, match=r"^MoE: num_slots must be None or an int >= 0, got -1$"):
        flatep.nn.MoE(H, F, 4, 1, ranks[0], num_slots=-1)
    with pytest.raises(ValueError, match=r"^ExpertPools: num_slots \(B\) must be -1 \(= epn\) or in \[0, epn=4\], "
                                         r"got 5$"):
        flatep.nn.MoE(H, F, 4, 1, ranks[0], num_slots=5)  # the one check of B: the pools
    # Training with B < epn.
    moe = flatep.nn.MoE(H, F, 4, 1, ranks[0], num_tokens=S, num_slots=2)
    with pytest.raises(ValueError, match=r"^MoE: num_slots=2 < epn=4 is inference only \(serving pools hold no "
                                         r"gradients\); run it under torch.no_grad\(\)"):
        moe(torch.randn(3, H))
    assert moe.w1.main_grad is None and not moe.w1.requires_grad
    # A plan of a Buffer not made from these pools: its groups differ.
    pools = moe.pools
    layer = moe.expert_layer
    assert (moe.buffer.num_slots, moe.buffer.view_stride) == (pools.num_slots, pools.view_stride)  # taken from them
    training = flatep.Buffer(ranks[0], S, H, 4, 1)
    plan = training.plan(torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^prefetch: plan has num_slots=4 view_stride=4 but the pools have "
                                         r"num_slots=2 view_stride=\d+; build the Buffer from these pools"):
        pools.prefetch(plan, layer)
    other_pools = flatep.ExpertPools(ranks[0], 4, [(8, 8)], num_slots=3)
    other = flatep.Buffer(ranks[0], S, H, 4, 1, pools=other_pools)
    with pytest.raises(ValueError, match=r"^prefetch: plan has num_slots=3 view_stride=\d+ but the pools have"):
        pools.prefetch(other.plan(torch.zeros(3, 1, dtype=torch.long)), layer)
    serving_plan = moe.buffer.plan(torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^prefetch: plan_ordered must be a bool, got 1$"):
        pools.prefetch(serving_plan, layer, plan_ordered=1)
    training_pools = flatep.ExpertPools(ranks[0], 4, [(8, 8)])
    with pytest.raises(ValueError, match=r"^prefetch: plan_ordered=True needs serving pools \(num_slots < epn\): "
                                         r"training's push needs its two barriers; these pools have num_slots=4$"):
        training_pools.prefetch(plan, training_pools.register_layer(), plan_ordered=True)
    with pytest.raises(ValueError, match=r"^write_grads: these pools are forward-only \(serving: num_slots=2 < epn=4\)"):
        pools.write_grads(serving_plan, layer, 0, torch.zeros(2 * 4, H, 2 * F))
    with pytest.raises(ValueError, match=r"^view_row: the serving view's rows"):
        flatep.ExpertPools(ranks[0], 4, [(8, 8)]).view_row(0)
    with pytest.raises(ValueError, match=r"^MoE: num_slots=1 but the pools have num_slots=2$"):
        flatep.nn.MoE(H, F, 4, 1, ranks[0], num_slots=1, pools=pools)
