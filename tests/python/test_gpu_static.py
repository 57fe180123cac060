"""The static planner on a GPU (issue 60), through the public API on virtual ranks: plans of CUDA Buffers bitwise equal
to the CPU backend's (the host planner) for the same placement and routing; the step (plan, dispatch, combine)
captured in CUDA graphs and replayed with new routing bitwise equal to the eager step, and a new placement set between
replays taking effect in them (the graph's plan op reads the placement from the device memory set_placement writes);
nn.MoE(planner="static") on the GPU against the dense reference, the placed weights moved once.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_static.py
"""

import pytest
import torch

import graph_steps
import mp_cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
R, S, H, E, K, B = 4, 256, 512, 32, 4, 3
EPN = E // R
PLACEMENT = [[8, -1, 17], [0, 1, 30], [-1, 4, 9], [2, 12, 0]]
NEW_PLACEMENT = [[27, 9, -1], [16, -1, 3], [1, 0, 6], [-1, 10, 20]]

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")]


def static_buffer(group, device, align):
    """A static Buffer for serving pools of B slots on `device` (the Buffer takes B from them; collective)."""
    import flatep

    pools = flatep.ExpertPools(group, EPN, [(64, 16)], num_slots=B, device=device)
    return flatep.Buffer(group, S, H, E, K, align=align, planner="static", pools=pools, device=device)


def step(buf, idx, x, w):
    plan = buf.plan(idx)
    recv_x, recv_w, cu = buf.dispatch(plan, x, w)
    return buf.combine(plan, recv_x, recv_w), cu, plan.slot_expert


def group_sizes(plan, d, Q):
    """Rank d's group sizes from its cu_seqlens in the serving view [R*Q + B] (Q: the pools' view stride, larger on
    device pools than on the CPU's): each expert's group, then each slot's; the view's other groups must be empty."""
    cu = plan.cu_seqlens_of(d).long()
    sizes = torch.diff(cu, prepend=cu.new_zeros(1)).tolist()
    assert len(sizes) == R * Q + B, f"rank {d}: {len(sizes)} groups, expected R*Q + B = {R * Q + B}"
    used = [h * Q + j for h in range(R) for j in range(EPN)] + [R * Q + j for j in range(B)]
    assert all(sizes[i] == 0 for i in set(range(len(sizes))) - set(used)), f"rank {d}: rows in a gap of the view"
    return [sizes[i] for i in used]


def test_gpu_static_plans_are_the_host_planners_bitwise():
    import flatep
    from flatep import testing, virtual

    plans, strides = {}, {}
    for device in ("cpu", torch.device("cuda", 0)):
        group = virtual.virtual_ranks(R, device, timeout_s=30)
        bufs = virtual.run_threads(R, lambda r: static_buffer(group[r], device, align=8))
        strides[torch.device(device).type] = bufs[0].view_stride
        virtual.run_threads(R, lambda r: bufs[r].set_placement(PLACEMENT))
        for trial in range(4):
            idx = [testing.sample_topk(E, S - 17 * r, K, r, sigma=0.5 * trial, seed=trial).long().to(device)
                   for r in range(R)]
            got = virtual.run_threads(R, lambda r: bufs[r].plan(idx[r]))
            plans.setdefault(trial, []).append(got)
        testing.release_all()
    for trial, (host, gpu) in plans.items():
        for r in range(R):
            h, g = host[r], gpu[r]
            what = f"trial {trial} rank {r}"
            assert torch.equal(h.alloc, g.alloc) and torch.equal(h.tpe_all, g.tpe_all), what
            assert torch.equal(h.entry_ranks, g.entry_ranks) and torch.equal(h.entry_rows, g.entry_rows), what
            assert h.stats == g.stats, what
            for d in range(R):
                assert torch.equal(h.slot_expert_of(d), g.slot_expert_of(d)), f"{what}: slot_expert of {d}"
                assert group_sizes(h, d, strides["cpu"]) == group_sizes(g, d, strides["cuda"]), (
                    f"{what}: cu_seqlens of {d}")
            assert g.slot_expert.cpu().tolist()[:B] == PLACEMENT[r]


def test_gpu_static_step_replays_as_cuda_graphs_and_follows_a_new_placement():
    import flatep
    from flatep import virtual

    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(R, device, timeout_s=30)
    bufs = virtual.run_threads(R, lambda r: static_buffer(group[r], device, align=1))
    virtual.run_threads(R, lambda r: bufs[r].set_placement(PLACEMENT))
    ranks = graph_steps.GraphedRanks(bufs, device, S, H, E, K, step)
    ranks.write_inputs(0)
    ranks.eager()
    ranks.capture()
    for trial in range(1, 6):
        if trial == 3:  # a new placement between replays: the captured plan op reads it
            virtual.run_threads(R, lambda r: bufs[r].set_placement(NEW_PLACEMENT))
            torch.cuda.synchronize()
        ranks.write_inputs(trial)
        replayed = ranks.replay()
        want = ranks.eager()
        placement = PLACEMENT if trial < 3 else NEW_PLACEMENT
        for r in range(R):
            out, cu, slots = replayed[r]
            assert slots.cpu().tolist()[:B] == placement[r], f"trial {trial} rank {r}: slot table"
            assert torch.equal(cu, want[r][1]), f"trial {trial} rank {r}: cu_seqlens"
            assert torch.equal(out.view(torch.int16), want[r][0].view(torch.int16)), (
                f"trial {trial} rank {r}: the replayed step differs from the eager one")
    for b in bufs:
        b.check_status()


def test_gpu_static_moe_matches_dense_and_moves_once():
    import flatep
    from flatep import testing, virtual

    device = torch.device("cuda", 0)
    Hs, F = 128, 64
    group = virtual.virtual_ranks(R, device, timeout_s=30)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(Hs, F, E, K, group[r], num_tokens=64, align=16, seed=5,
                                                          num_slots=B, planner="static", device=device))
    virtual.run_threads(R, lambda r: moes[r].set_placement(PLACEMENT))
    dense = testing.DenseMoE(Hs, F, E, K, seed=5)
    counts = [64, 0, 33, 64]
    for trial in range(3):
        g = torch.Generator().manual_seed(trial)
        xs = [torch.randn(s, Hs, generator=g) for s in counts]
        idx = [testing.sample_topk(E, 64, K, r, sigma=1.5, seed=trial)[:s].long() for r, s in enumerate(counts)]

        def forward(r):
            with torch.no_grad():
                return moes[r](xs[r].to(device), idx[r].to(device)).cpu()

        outs = virtual.run_threads(R, forward)
        ref = dense(torch.cat(xs), torch.cat(idx), chunks=counts)
        err = ((torch.cat(outs).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < 2.0**-6, f"trial {trial}: error {err}"
        moved = [m.last_placement_bytes for m in moes]
        assert (moved == [0] * R) == (trial > 0), f"trial {trial}: moved {moved}"
