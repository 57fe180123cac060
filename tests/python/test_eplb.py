"""flatep.eplb, the periodic expert placement serving engines run: replicate by load, then pack the copies onto the
ranks' B slots. Checked against brute force on small cases (every copy vector, every placement), and for invariants
on large random ones.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_eplb.py
"""

import itertools
import random
from fractions import Fraction

import pytest

from flatep import eplb


def small_cases(count, seed, ranks=(2, 3, 4), per_rank=(1, 2)):
    rng = random.Random(seed)
    for _ in range(count):
        R, epn = rng.choice(ranks), rng.choice(per_rank)
        B = rng.randint(0, epn)
        loads = [int(rng.lognormvariate(0, 1.2) * 20) for _ in range(R * epn)]
        yield R, epn, B, loads


def max_per_copy(loads, copies):
    return max(Fraction(loads[e], copies[e]) for e in range(len(loads)))


def packable(copies, R, epn, B):
    need = {e: c - 1 for e, c in enumerate(copies) if c > 1}
    return eplb._packable(need, [B] * R, lambda e, d: e // epn != d)


@pytest.mark.parametrize("seed", range(4))
def test_replicate_minimises_the_largest_load_per_copy_over_every_packable_copy_vector(seed):
    for R, epn, B, loads in small_cases(40, seed):
        E = R * epn
        extra = min(R * B, E * (R - 1))
        copies = eplb.replicate(loads, R, extra, B)
        assert sum(c - 1 for c in copies) == extra and all(1 <= c <= R for c in copies)
        assert packable(copies, R, epn, B)
        best = min(max_per_copy(loads, c) for c in itertools.product(range(1, R + 1), repeat=E)
                   if sum(x - 1 for x in c) == extra and packable(c, R, epn, B))
        assert max_per_copy(loads, copies) == best, (R, epn, B, loads, copies)


def all_placements(R, epn, B):
    per_rank = []
    for d in range(R):
        others = [e for e in range(R * epn) if e // epn != d]
        per_rank.append([list(c) + [-1] * (B - k) for k in range(B + 1) for c in itertools.combinations(others, k)])
    return itertools.product(*per_rank)


@pytest.mark.parametrize("seed", range(3))
def test_place_is_within_one_copy_of_the_best_placement(seed):
    """Longest-processing-time packing: the busiest rank's expected load is at most the brute-force optimum over
    every placement plus the largest load one copy carries; and the greedy finds the optimum itself on most cases."""
    optimal = total = 0
    for R, epn, B, loads in small_cases(30, 10 + seed, ranks=(2, 3), per_rank=(1, 2)):
        if R * epn > 4 and B == 2:
            continue  # keeps the brute force small
        slots = eplb.place(loads, R, B)
        got = max(eplb.rank_loads(loads, slots))
        best = min(max(eplb.rank_loads(loads, list(p))) for p in all_placements(R, epn, B))
        copies = [1] * (R * epn)
        for row in slots:
            for e in row:
                if e >= 0:
                    copies[e] += 1
        assert got <= best + max_per_copy(loads, copies), (R, epn, B, loads, slots)
        optimal += got == best
        total += 1
    assert optimal >= total // 2, f"the greedy found the optimum on {optimal} of {total} cases"


def check_valid(slots, R, epn, B, num_nodes=1):
    assert len(slots) == R and all(len(row) == B for row in slots)
    for d, row in enumerate(slots):
        used = [e for e in row if e >= 0]
        assert len(set(used)) == len(used), f"rank {d} holds two copies of one expert: {row}"
        assert all(e // epn != d for e in used), f"rank {d} holds a copy of its own expert: {row}"
        assert all(0 <= e < R * epn for e in used)
        assert row == sorted(used) + [-1] * (B - len(used)), "slots are listed in increasing expert id, empty last"


@pytest.mark.parametrize("R,E,B,nodes", [(8, 256, 4, 1), (8, 256, 4, 2), (8, 64, 8, 1), (16, 128, 2, 4), (4, 16, 0, 1)])
def test_large_placements_are_valid_deterministic_and_better_than_none(R, E, B, nodes):
    rng = random.Random(R * E + B)
    epn = E // R
    loads = [int(rng.lognormvariate(0, 1.5) * 100) for _ in range(E)]
    slots = eplb.place(loads, R, B, num_nodes=nodes)
    check_valid(slots, R, epn, B)
    assert slots == eplb.place(list(loads), R, B, num_nodes=nodes)
    used = sum(e >= 0 for row in slots for e in row)
    assert used == min(R * B, E * (R - 1))
    none = eplb.expected_max_load(loads, [[-1] * B for _ in range(R)])
    placed = eplb.expected_max_load(loads, slots)
    assert placed <= none
    if B:
        assert placed < none


def test_nodes_first_keeps_each_nodes_copies_within_its_ranks():
    """With two nodes of two ranks, a node never takes more copies of an expert than it has ranks that may hold one
    (and every rank's slots stay valid)."""
    R, epn, B = 4, 2, 2
    loads = [900, 10, 10, 10, 10, 10, 10, 10]  # expert 0 (node 0) is hot: copies on rank 1 and on node 1
    slots = eplb.place(loads, R, B, num_nodes=2)
    check_valid(slots, R, epn, B)
    assert 0 in slots[1] and 0 in slots[2] and 0 in slots[3]


def test_rank_loads_split_each_expert_evenly_over_its_copies():
    loads = [60, 30, 12, 6]
    slots = [[2], [0]]  # R=2, epn=2: expert 0 gets a copy on rank 1, expert 2 one on rank 0
    assert eplb.rank_loads(loads, slots) == [Fraction(30) + 30 + 6, Fraction(30) + 6 + 6]
    assert eplb.expected_max_load(loads, slots) == pytest.approx(66 / 54)


def test_ties_in_rank_load_go_to_the_lower_rank():
    """Equal loads tie the ranks at every step of pack (module docstring: each copy to the rank of least load, ties to
    the lower rank, among those that leave the later copies placeable), worked by hand."""
    # R=3, epn=1, B=1: each expert gets one extra copy of load 1/2; every rank starts at 1/2. Copy of e0: rank 0 is
    # its home, rank 1 next. Copy of e1: rank 0 (1/2) would leave e2 only rank 2, its home: rank 2. Copy of e2: rank 0.
    assert eplb.place([1, 1, 1], 3, 1) == [[2], [0], [1]]
    # R=4, epn=2, B=1: copies of e0..e3 (1/2 each); ranks start at 1, 1, 2, 2. e0: rank 1 (rank 0 is home). e1: rank
    # 0 is home, rank 1 full, rank 2 (2) before rank 3 (2). e2: rank 0. e3: rank 3.
    assert eplb.place([1] * 8, 4, 1) == [[2], [0], [1], [3]]


@pytest.mark.parametrize("call, message", [
    (lambda: eplb.place([1, 2, 3], 2, 1), "place: the 3 experts must split evenly over num_ranks=2"),
    (lambda: eplb.place([1, 2, 3, 4], 2, 3), "place: num_slots must be in [0, epn=2], got 3"),
    (lambda: eplb.place([1, -2, 3, 4], 2, 1), "place: loads must be non-negative, got -2"),
    (lambda: eplb.place([1.5, 2, 3, 4], 2, 1), "place: loads must be a non-empty list of non-negative integer counts"),
    (lambda: eplb.replicate([1, 2], 2, 3), "replicate: extra must be an int in [0, E*(R-1)=2], got 3"),
    (lambda: eplb.pack([1, 2, 3, 4], [2, 2, 1, 1], 2, 1), "pack: these copies cannot be placed"),
    (lambda: eplb.place([1, 2, 3, 4], 2, 1, num_nodes=3), "pack: num_nodes must be an int dividing num_ranks=2"),
])
def test_bad_arguments_raise_one_line_errors(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_drifting_popularity_keeps_its_skew_wanders_and_shifts():
    import torch

    from flatep import testing

    E, T = 256, 400
    pop = testing.drifting_popularity(E, T, sigma=1.0, drift=0.1, seed=3)
    assert pop.shape == (T, E) and bool((pop > 0).all())
    assert torch.equal(pop, testing.drifting_popularity(E, T, sigma=1.0, drift=0.1, seed=3))
    z = pop.log()
    # every step's log-popularity stays N(0, 1): its spread neither collapses nor explodes over the walk
    assert 0.8 < float(z[0].std()) < 1.2 and 0.8 < float(z[-1].std()) < 1.2
    # consecutive steps are close (correlation sqrt(1 - 0.01)), distant ones have forgotten (1/drift^2 = 100 steps)
    corr = lambda a, b: float(torch.corrcoef(torch.stack([z[a], z[b]]))[0, 1])  # noqa: E731
    assert corr(0, 1) > 0.98 and abs(corr(0, T - 1)) < 0.3
    frozen = testing.drifting_popularity(E, 5, drift=0.0, seed=3)
    assert torch.equal(frozen[0], frozen[4])
    shifted = testing.drifting_popularity(E, 20, drift=0.0, shift_every=10, seed=3)
    assert torch.equal(shifted[0], shifted[9]) and not torch.equal(shifted[9], shifted[10])
    with pytest.raises(ValueError, match=r"drifting_popularity: drift must be in \[0, 1\], got 1.5"):
        testing.drifting_popularity(E, 5, drift=1.5)


def test_sample_topk_from_follows_the_popularity():
    import torch

    from flatep import testing

    pop = [1.0] * 16
    pop[3] = 40.0
    idx = testing.sample_topk_from(pop, 2000, 2, rank=1, seed=5)
    assert idx.shape == (2000, 2) and idx.dtype == torch.int32
    assert bool((idx[:, 0] != idx[:, 1]).all()), "a token's K experts are distinct"
    counts = torch.bincount(idx.flatten().long(), minlength=16)
    assert int(counts.argmax()) == 3 and int(counts[3]) > 1500
    assert torch.equal(idx, testing.sample_topk_from(pop, 2000, 2, rank=1, seed=5))
