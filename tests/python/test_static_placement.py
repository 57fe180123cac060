"""The static planner from Python (issue 60; docs/design.md §4 "The static planner") on virtual ranks of the CPU
backend: Buffer.set_placement's one-line errors (each kind of bad placement on every rank, ranks that disagree,
unreadable input) leaving the Buffer usable with the placement it had; nn.MoE(planner="static") against the dense
reference in serving (B < epn) and training (B = epn, forward and backward), its plans' split and slot table, the
placed weights moved once (and again after another layer used the slot pool, a new placement or new weights); and
R processes joined by gloo against the dense reference.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_static_placement.py
"""

import json

import pytest
import torch

import flatep
import mp_cases
import static_mp_cases
from flatep import testing, virtual

R, EPN, S, H, F, K = 3, 4, 12, 16, 8, 2
E = R * EPN
B = 2
COUNTS = [S, 0, 7]  # ragged ranks, one empty
TOL = 2.0**-7  # as test_serving.py: one bf16 ulp at the largest magnitude
BF16_TOL = 2.0**-6  # as test_moe_activation.py (gradients)
EXPERT_BYTES = (H * 2 * F + F * H) * 2  # swiglu: W1 [H, 2F] and W2 [F, H], bf16
PLACEMENT = [[5, -1], [0, 9], [1, 4]]  # rank 0 holds 5 then an empty slot, rank 1 holds 0 and 9, rank 2 1 and 4
CUDA_SKIP = mp_cases.cuda_unavailable_reason()


@pytest.fixture(autouse=True)
def _release():
    testing.release_all()
    yield
    testing.release_all()


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def messages(fn):
    """fn(r) on every virtual rank; each rank's ValueError text (None where it raised none)."""
    def body(r):
        try:
            fn(r)
        except ValueError as e:
            return str(e)
        return None

    return virtual.run_threads(R, body)


def split_loads(tpe_all, placement):
    """Rows each rank computes under the static split rule, written out: expert e's copies are its home and the ranks
    whose slots hold it (ascending); T_e goes round-robin over them from copy e mod n."""
    loads = [0] * R
    for e in range(E):
        copies = [d for d in range(R) if d == e // EPN or e in placement[d]]
        n = len(copies)
        for i in range(int(tpe_all[:, e].sum())):
            loads[copies[(e % n + i) % n]] += 1
    return loads


def static_buffers():
    """Every rank's static Buffer for serving pools of B slots (the Buffer takes B from them)."""
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)

    def make(r):
        pools = flatep.ExpertPools(ranks[r], EPN, [(H, 2 * F), (F, H)], num_slots=B)
        return flatep.Buffer(ranks[r], S, H, E, K, align=1, planner="static", pools=pools)

    return virtual.run_threads(R, make)


def test_bad_placements_fail_on_every_rank_and_keep_the_placement():
    bufs = static_buffers()
    idx = [testing.sample_topk(E, S, K, r, seed=1).long() for r in range(R)]
    assert messages(lambda r: bufs[r].plan(idx[r])) == [
        "plan: the static planner has no placement yet: call set_placement (collective) first"] * R
    bad = [
        ([[5, 12], [-1, 0], [1, 4]], "set_placement: placement[0][1] = 12 is not an expert id in [0, E=12) or -1 "
                                     "(empty)"),
        ([[5, 9], [-1, 4], [1, 4]], "set_placement: placement[1][1] = 4 is rank 1's own expert; a slot holds another "
                                    "rank's expert"),
        ([[5, 5], [-1, 0], [1, 4]], "set_placement: placement[0][1] = 5 repeats placement[0][0] (an expert at most "
                                    "once a rank)"),
        ([[5, 9], [-1, -7], [1, 4]], "set_placement: placement[1][1] = -7 is not an expert id in [0, E=12) or -1 "
                                     "(empty)"),
    ]
    for placement, message in bad:
        assert messages(lambda r: bufs[r].set_placement(placement)) == [message] * R
    assert [b.placement for b in bufs] == [None] * R
    virtual.run_threads(R, lambda r: bufs[r].set_placement(torch.tensor(PLACEMENT, dtype=torch.int32)))
    for placement, message in bad:
        assert messages(lambda r: bufs[r].set_placement(placement)) == [message] * R
    for b in bufs:
        assert b.placement_epoch == 1 and b.placement.tolist() == PLACEMENT and b.placement.dtype == torch.int32
    plans = virtual.run_threads(R, lambda r: bufs[r].plan(idx[r]))
    for r, plan in enumerate(plans):
        assert plan.placement_epoch == 1
        assert plan.slot_expert.tolist() == PLACEMENT[r] + [-1] * (EPN - B)
        assert plan.stats["loads"] == split_loads(plan.tpe_all, PLACEMENT)


def test_ranks_that_disagree_all_fail_naming_the_first_difference():
    bufs = static_buffers()
    other = [[5, -1], [0, 9], [1, 6]]
    got = messages(lambda r: bufs[r].set_placement(other if r == 2 else PLACEMENT))
    assert got == ["set_placement: ranks disagree on the placement: placement[2][1] is 4 on rank 0 but 6 on rank 2 "
                   "(every rank must pass the same placement)"] * R
    # A placement one rank cannot read (another shape, float ids): that rank names its own; the others fail too.
    got = messages(lambda r: bufs[r].set_placement([[5, 9, 1], [-1, 0, 2], [1, 4, 5]] if r == 1 else PLACEMENT))
    assert got[1] == "set_placement: slots must have shape [R=3, B=2] (one row of B slot experts per rank), got [3, 3]"
    assert got[0] == got[2] == ("set_placement: ranks disagree on the placement: rank 0 passed 6 entries, rank 1 "
                                "passed 7 (every rank must pass the same placement)")
    got = messages(lambda r: bufs[r].set_placement(torch.tensor(PLACEMENT, dtype=torch.float32)))
    assert got == ["set_placement: slots must hold int expert ids (-1: an empty slot), got torch.float32"] * R
    got = messages(lambda r: bufs[r].set_placement("five"))
    assert got == ["set_placement: slots must be an [R=3, B=2] table of int expert ids (-1: an empty slot), got "
                   "'five'"] * R
    assert [b.placement_epoch for b in bufs] == [0] * R
    virtual.run_threads(R, lambda r: bufs[r].set_placement(PLACEMENT))  # usable: not poisoned
    assert [b.placement_epoch for b in bufs] == [1] * R


def test_other_planners_refuse_a_placement():
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    bufs = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, H, E, K, align=1))
    assert messages(lambda r: bufs[r].set_placement([[-1] * EPN] * R)) == [
        "set_placement: this Buffer's planner is 'balanced'; a placement is for the static planner "
        "(PlannerKind::kStatic)"] * R
    with pytest.raises(ValueError, match=r"^Buffer: planner must be 'balanced', 'greedy', 'owner' or 'static', got "
                                         r"'fixed'$"):
        flatep.Buffer(ranks[0], S, H, E, K, planner="fixed")


def inputs(seed, counts=COUNTS):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, H, generator=g) for s in counts]
    idx = [testing.sample_topk(E, S, K, r, sigma=1.5, seed=seed)[:s].long() for r, s in enumerate(counts)]
    return xs, idx


def infer(moes, seed, dense_seed=3):
    """One inference step of every rank's layer: (error against the dense reference, plans, bytes moved)."""
    xs, idx = inputs(seed)

    def step(r):
        with torch.no_grad():
            return moes[r](xs[r], idx[r])

    outs = virtual.run_threads(R, step)
    ref = testing.DenseMoE(H, F, E, K, seed=dense_seed)(torch.cat(xs), torch.cat(idx), chunks=COUNTS)
    return rel_err(torch.cat(outs), ref), [m.last_plan for m in moes], [m.last_placement_bytes for m in moes]


def placed_bytes(placement):
    return [sum(e >= 0 for e in row) * EXPERT_BYTES for row in placement]


def test_static_serving_layer_matches_dense_and_moves_the_weights_once():
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    make = lambda seed: virtual.run_threads(R, lambda r: flatep.nn.MoE(  # noqa: E731
        H, F, E, K, ranks[r], num_tokens=S, align=4, seed=seed, num_slots=B, planner="static"))
    moes, others = make(3), make(5)  # two layers on one process's shared serving pools
    assert moes[0].pools is others[0].pools and moes[0].buffer is not others[0].buffer
    def forward_without_placement(r):
        with torch.no_grad():
            moes[r](torch.zeros(S, H))

    assert messages(forward_without_placement) == [
        "MoE: planner='static' has no placement yet: call moe.set_placement(slots) (collective) before the first "
        "forward"] * R
    virtual.run_threads(R, lambda r: moes[r].set_placement(PLACEMENT))
    virtual.run_threads(R, lambda r: others[r].set_placement([[4, -1], [8, 3], [-1, 7]]))

    err, plans, moved = infer(moes, 11)
    assert err < TOL and moved == placed_bytes(PLACEMENT)
    for r, plan in enumerate(plans):
        assert plan.slot_expert.tolist() == PLACEMENT[r] + [-1] * (EPN - B)
        assert plan.cu_seqlens.shape == (moes[r].pools.view_rows,)
    assert plans[0].stats["loads"] == split_loads(plans[0].tpe_all, PLACEMENT)
    assert plans[0].stats["loads"] != plans[0].stats["loads_before"]  # the placed copies took rows
    for seed in (12, 13):  # new routing, the same placement: nothing moves, the slots still hold the replicas
        err, plans, moved = infer(moes, seed)
        assert err < TOL and moved == [0] * R, (seed, moved)
        assert plans[0].stats["loads"] == split_loads(plans[0].tpe_all, PLACEMENT)
    # Another layer's forward rewrites the shared slot pool: both move their replicas at their next forward.
    err, _, moved = infer(others, 14, dense_seed=5)
    assert err < TOL and moved == placed_bytes([[4, -1], [8, 3], [-1, 7]])
    err, _, moved = infer(moes, 15)
    assert err < TOL and moved == placed_bytes(PLACEMENT)
    # A layer of another planner on the same pools prefetches its own replicas into the slot pool: moved again.
    balanced = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=4, seed=6,
                                                              num_slots=B))
    assert balanced[0].pools is moes[0].pools
    err, plans, _ = infer(balanced, 19, dense_seed=6)
    assert err < TOL and plans[0].stats["replicas"] > 0
    err, _, moved = infer(moes, 20)
    assert err < TOL and moved == placed_bytes(PLACEMENT)
    # A new placement: moved at the next forward, used by every plan from then on.
    new = [[-1, 11], [2, 8], [6, 0]]
    virtual.run_threads(R, lambda r: moes[r].set_placement(new))
    err, plans, moved = infer(moes, 16)
    assert err < TOL and moved == placed_bytes(new) and plans[1].slot_expert.tolist()[:B] == new[1]
    assert plans[0].placement_epoch == 2 and moes[0].placement.tolist() == new
    # New weights (load_dense): moved again, and the outputs follow them.
    dense = testing.DenseMoE(H, F, E, K, seed=9)
    virtual.run_threads(R, lambda r: moes[r].load_dense(dense))
    err, _, moved = infer(moes, 17, dense_seed=9)
    assert err < TOL and moved == placed_bytes(new)
    err, _, moved = infer(moes, 18, dense_seed=9)
    assert err < TOL and moved == [0] * R
    # New weights through load_state_dict (the other layer's, seed 5): moved again, and the outputs follow them.
    states = [others[r].state_dict() for r in range(R)]
    virtual.run_threads(R, lambda r: moes[r].load_state_dict(states[r]))
    err, _, moved = infer(moes, 21, dense_seed=5)
    assert err < TOL and moved == placed_bytes(new)


def test_static_training_layout_matches_dense_forward_and_backward():
    """B = epn (the training layout), autograd recording: every forward moves the placed weights (they change with
    each optimizer step) and every replica's gradient comes back through reduce_grad, placed copies without rows
    included."""
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    placement = [[4, 8, -1, 11], [-1, 0, 9, 3], [1, 5, 2, -1]]
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=1, seed=4,
                                                          planner="static"))
    virtual.run_threads(R, lambda r: moes[r].set_placement(placement))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(R * S, H, generator=g)
    gout = torch.randn(R * S, H, generator=g)
    idx = [testing.sample_topk(E, S, K, r, sigma=1.5, seed=2).long() for r in range(R)]
    xs = [x[r * S:(r + 1) * S].clone().requires_grad_() for r in range(R)]
    outs = virtual.run_threads(R, lambda r: moes[r](xs[r], idx[r]))
    virtual.run_threads(R, lambda r: (outs[r].float() * gout[r * S:(r + 1) * S]).sum().backward())
    dense = testing.DenseMoE(H, F, E, K, seed=4)
    xr = x.clone().requires_grad_()
    ref = dense(xr, torch.cat(idx), chunks=[S] * R)
    (ref.float() * gout).sum().backward()
    assert rel_err(torch.cat(outs), ref) < TOL
    assert rel_err(torch.cat([xi.grad for xi in xs]), xr.grad) < BF16_TOL
    plan = moes[0].last_plan
    assert plan.stats["loads"] == split_loads(plan.tpe_all, placement)
    assert [m.last_placement_bytes for m in moes] == placed_bytes(placement)
    for r, m in enumerate(moes):
        lo, hi = r * EPN, (r + 1) * EPN
        assert rel_err(m.w1.main_grad, dense.w1.grad[lo:hi]) < BF16_TOL, f"rank {r}: w1 main_grad"
        assert rel_err(m.w2.main_grad, dense.w2.grad[lo:hi]) < BF16_TOL, f"rank {r}: w2 main_grad"


def test_use_planner_static_applies_the_placement_to_each_buffer():
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=4, seed=3,
                                                          num_slots=B))
    assert messages(lambda r: moes[r].set_placement(PLACEMENT)) == [
        "MoE.set_placement: the layer plans with planner='balanced'; a placement is for planner='static' "
        "(MoE(..., planner='static') or use_planner('static', num_tokens))"] * R
    lazy = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], align=4, seed=3, num_slots=B,
                                                          planner="static"))
    assert messages(lambda r: lazy[r].set_placement(PLACEMENT)) == [
        "MoE.set_placement: the layer has no Buffer yet (S unknown): pass num_tokens= at construction or call "
        "use_planner('static', num_tokens) first"] * R
    virtual.run_threads(R, lambda r: moes[r].use_planner("static"))
    virtual.run_threads(R, lambda r: moes[r].set_placement(PLACEMENT))
    err, plans, moved = infer(moes, 21)
    assert err < TOL and moved == placed_bytes(PLACEMENT)
    small = virtual.run_threads(R, lambda r: moes[r].use_planner("static", 8))  # another S: its own Buffer
    assert small[0].num_tokens == 8 and small[0].placement.tolist() == PLACEMENT
    virtual.run_threads(R, lambda r: moes[r].use_planner("balanced", S))
    err, plans, _ = infer(moes, 22)
    assert err < TOL and plans[0].placement_epoch == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")])])
@pytest.mark.parametrize("num_slots", [2, None])
def test_static_layer_across_processes_matches_dense_reference(tmp_path, device, num_slots):
    out_path = str(tmp_path / "static.json")
    testing.spawn(static_mp_cases.main, static_mp_cases.R, device, num_slots, out_path)
    with open(out_path) as f:
        ranks = json.load(f)
    for r, res in enumerate(ranks):
        for err, moved, slots, want_slots, loads, want_loads in res:
            assert err < TOL, f"rank {r}: error {err}"
            assert slots == want_slots and loads == want_loads, (r, slots, loads)
        assert [step[1] for step in res] == res[0][1:2] + [0] * (len(res) - 1), f"rank {r}: moved once"
