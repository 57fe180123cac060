"""flatep.baseline's Collectives on the backends the training tests do not drive (issue 62's gaps): one process with
no torch.distributed group ('single': every collective the identity), a one-rank gloo group in this process (bf16
moved as bytes, the bf16 sum refused, a subgroup's global rank), the virtual all-to-all's split checks (their exact
messages), and AllToAllMoE's argument checks and a rank that receives no rows. Exact values throughout."""

import pytest
import torch
import torch.distributed as dist

from flatep import baseline
from flatep.baseline import AllToAllMoE, Collectives, all_to_all_rows, collectives

BF16 = torch.bfloat16


def _rows_grad_through(c, x, out_splits, in_splits):
    """all_to_all_rows of x over c, and x's gradient of (y * weights).sum() (weights 1, 2, 3, ... per element)."""
    leaf = x.clone().requires_grad_()
    y = c.all_to_all_rows(leaf, out_splits, in_splits)
    w = torch.arange(1, y.numel() + 1, dtype=y.dtype).view_as(y)
    (y * w).sum().backward()
    return y.detach(), leaf.grad, w


def test_single_process_collectives_are_the_identity():
    assert not dist.is_initialized()
    c = Collectives(None)
    assert (c.backend, c.rank, c.size, c.virtual) == ("single", 0, 1, False)
    assert repr(c) == "Collectives(single, rank 0 of 1)"
    assert collectives(c) is c
    t = torch.tensor([1.0, 2.0, 3.0])
    assert c.all_reduce(t) is t and t.tolist() == [1.0, 2.0, 3.0]
    gathered = c.all_gather(t)
    assert len(gathered) == 1 and gathered[0] is not t and gathered[0].tolist() == [1.0, 2.0, 3.0]
    gathered[0][0] = 9.0  # a copy, not a view of t
    assert t[0].item() == 1.0
    assert c.all_gather_object({"a": 1}) == [{"a": 1}]
    assert c.broadcast(t, 0) is t
    assert c.barrier() is None
    out = torch.zeros(3)
    assert c.all_to_all_single(out, t, [3], [3]) is out and out.tolist() == [1.0, 2.0, 3.0]
    x = torch.arange(6, dtype=torch.float32).view(3, 2)
    y, grad, w = _rows_grad_through(c, x, [3], [3])
    assert torch.equal(y, x)
    assert torch.equal(grad, w)  # the backward's reverse all-to-all of one rank: the gradient itself
    y2 = all_to_all_rows(x, [3], [3], None)  # the module function over the default (no) group
    assert torch.equal(y2, x)


@pytest.fixture
def gloo_world(tmp_path):
    """torch.distributed initialised in this process as a one-rank gloo group, destroyed after the test."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gloo_collectives_of_one_rank(gloo_world):
    c = collectives(None)
    assert (c.backend, c.rank, c.size) == ("gloo", 0, 1)
    assert repr(c) == "Collectives(gloo, rank 0 of 1)"
    with pytest.raises(ValueError) as e:
        c.all_reduce(torch.ones(2, dtype=BF16))
    assert str(e.value) == "Collectives.all_reduce: gloo has no bf16 sum; all-reduce fp32 tensors"
    t = torch.tensor([1.5, -2.0])
    assert c.all_reduce(t) is t and t.tolist() == [1.5, -2.0]
    b = torch.tensor([1.5, -2.0, 3.25], dtype=BF16)
    for src in (b, t):  # bf16 as bytes, fp32 as is
        (got,) = c.all_gather(src)
        assert got.dtype == src.dtype and torch.equal(got, src)
    assert c.all_gather_object(("x", 3)) == [("x", 3)]
    assert c.broadcast(b, 0) is b and b.tolist() == [1.5, -2.0, 3.25]
    sub = dist.new_group([0])  # not WORLD: src is translated to its global rank
    sc = collectives(sub)
    assert sc.broadcast(t, 0) is t and t.tolist() == [1.5, -2.0]
    assert baseline._global_rank(sub, 0) == 0
    assert c.barrier() is None
    # A 1-D bf16 tensor's rows are its elements: moved as bytes, the split sizes still count them (the uint8 view of
    # the whole tensor had twice the rows, and gloo refused the splits).
    rows = torch.tensor([[0.5, 1.0], [2.0, -4.0], [8.0, 0.25]], dtype=BF16)
    for src in (b, t, rows):
        out = torch.zeros_like(src)
        assert c.all_to_all_single(out, src, [src.shape[0]], [src.shape[0]]) is out
        assert out.dtype == src.dtype and torch.equal(out, src)
    x = torch.arange(8, dtype=torch.float32).view(4, 2)
    y, grad, w = _rows_grad_through(c, x, [4], [4])
    assert torch.equal(y, x) and torch.equal(grad, w)


def _virtual_pair():
    virtual = pytest.importorskip("flatep.virtual")
    return virtual, virtual.virtual_ranks(2, "cpu", timeout_s=30)


def test_virtual_all_to_all_rows_refuses_disagreeing_splits():
    virtual, ranks = _virtual_pair()
    x = [torch.arange(6, dtype=torch.float32).view(3, 2) + 10 * r for r in range(2)]

    def run(splits):
        return virtual.run_threads(2, lambda r: collectives(ranks[r]).all_to_all_rows(x[r], *splits[r]))

    # Rank 0 sends 2 rows to rank 1, which expects 1 from it.
    with pytest.raises(ValueError) as e:
        run([([1, 1], [1, 2]), ([1, 2], [2, 1])])
    assert str(e.value).splitlines()[0] == (
        "virtual rank 0: all_to_all_rows: rank 0 sends 2 rows to rank 1, whose output_split_sizes is [1, 2]")
    # Rank 1's input_split_sizes has a negative entry (its sum still matches its 3 rows).
    with pytest.raises(ValueError) as e:
        run([([1, 4], [1, 2]), ([2, -1], [4, -1])])
    assert str(e.value).splitlines()[0] == (
        "virtual rank 0: all_to_all_rows: rank 1's input_split_sizes must be 2 non-negative ints, got [4, -1]")
    # A rank whose splits do not sum to its rows fails before posting; its peer fails naming it.
    with pytest.raises(ValueError) as e:
        run([([1, 1], [1, 1]), ([1, 1], [1, 2])])
    assert str(e.value).splitlines()[0] == "all_to_all_rows: input_split_sizes sum to 2, x has 3 rows"
    # Agreeing splits after the failures: rank d gets rank p's rows for d, in source order.
    got = run([([1, 2], [1, 2]), ([2, 1], [2, 1])])
    assert got[0].tolist() == [[0.0, 1.0], [10.0, 11.0], [12.0, 13.0]]
    assert got[1].tolist() == [[2.0, 3.0], [4.0, 5.0], [14.0, 15.0]]


def test_alltoall_moe_argument_checks():
    with pytest.raises(ValueError) as e:
        AllToAllMoE(8, 16, 2, 3)
    assert str(e.value) == "AllToAllMoE: topk (K) must be at most num_experts=2, got 3"
    moe = AllToAllMoE(8, 16, 4, 2)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    for bad, text in ((torch.zeros(5, 3, dtype=torch.long), "[5, 3]"), ([[0, 1]] * 5, "list")):
        with pytest.raises(ValueError) as e:
            moe(x, bad)
        assert str(e.value) == f"AllToAllMoE: topk_idx must be a [s=5, K=2] tensor, got {text}"
    with pytest.raises(ValueError) as e:
        moe(x, torch.full((5, 2), 4, dtype=torch.long))
    assert str(e.value) == "AllToAllMoE: topk_idx of rank(s) [0] holds expert ids outside [0, 4)"


def test_alltoall_moe_given_routing_equals_the_routers():
    """One process: the router's own choice given as topk_idx gives the same output, bit for bit, as routing inside;
    every entry is computed here (last_loads)."""
    moe = AllToAllMoE(8, 16, 4, 2, seed=3)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    routed = moe(x)
    assert moe.last_loads == [12] and int(moe.last_counts.sum()) == 12
    _, idx = baseline.route(x, moe.router.weight, 2)
    given = moe(x, idx)
    assert torch.equal(routed, given)
    assert moe.last_counts.tolist() == [torch.bincount(idx.reshape(-1), minlength=4).tolist()]


def test_alltoall_moe_rank_without_rows():
    """Virtual ranks R=2, every token routed to rank 0's experts: rank 1 computes no rows (its forward's empty path and
    its backward's), and its expert gradients stay zero while rank 0's are not."""
    virtual, ranks = _virtual_pair()
    moes = virtual.run_threads(2, lambda r: AllToAllMoE(8, 16, 4, 2, ranks[r], seed=5))
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(10 + r)).requires_grad_() for r in range(2)]
    idx = torch.tensor([[0, 1]] * 3)
    outs = virtual.run_threads(2, lambda r: moes[r](xs[r], idx))
    assert [m.last_loads for m in moes] == [[12, 0], [12, 0]]
    losses = [o.float().square().sum() for o in outs]
    virtual.run_threads(2, lambda r: baseline.backward(losses) if r == 0 else None)
    assert float(moes[0].w1.main_grad.abs().sum()) > 0
    assert float(moes[1].w1.main_grad.abs().sum()) == 0 and float(moes[1].w2.main_grad.abs().sum()) == 0
    assert all(x.grad is not None and x.grad.shape == (3, 8) for x in xs)


def test_virtual_collectives_go_to_the_virtual_rank():
    """Collectives over a VirtualRank: every call is the virtual rank's own (sum in rank order, copies, src's bits)."""
    virtual, ranks = _virtual_pair()

    def step(r):
        c = collectives(ranks[r])
        assert (c.backend, c.rank, c.size, c.virtual) == ("virtual", r, 2, True)
        summed = c.all_reduce(torch.tensor([1.0 + r, 10.0 * r]))
        gathered = [t.tolist() for t in c.all_gather(torch.tensor([r, r + 5]))]
        objects = c.all_gather_object(f"rank{r}")
        sent = c.broadcast(torch.tensor([7.0 * (r + 1)]), 1)
        c.barrier()
        out = torch.zeros(2)
        c.all_to_all_single(out, torch.tensor([float(r), 10.0 + r]), [1, 1], [1, 1])
        return summed.tolist(), gathered, objects, sent.tolist(), out.tolist()

    got = virtual.run_threads(2, step)
    assert got[0] == ([3.0, 10.0], [[0, 5], [1, 6]], ["rank0", "rank1"], [14.0], [0.0, 1.0])
    assert got[1] == ([3.0, 10.0], [[0, 5], [1, 6]], ["rank0", "rank1"], [14.0], [10.0, 11.0])


@pytest.mark.parametrize("R, epn", [(1, 3), (2, 2), (3, 1), (4, 2), (5, 3), (2, 5), (7, 2)])
def test_by_local_expert_groups_arriving_rows_by_local_expert_then_source(R, epn):
    """Rows arrive ordered by [source rank][local expert]; the order by_local_expert returns lists them by [local
    expert][source rank], each block in arrival order, and offs are the inclusive ends of the local experts' groups,
    for more ranks than local experts too (R > epn), fewer, and equal, with empty blocks."""
    g = torch.Generator().manual_seed(10 * R + epn)
    counts = torch.randint(0, 4, (R, epn), generator=g)
    counts[0, 0] = 0
    arrival = [(s, e) for s in range(R) for e in range(epn) for _ in range(int(counts[s, e]))]
    want = sorted(range(len(arrival)), key=lambda i: (arrival[i][1], arrival[i][0], i))
    for total in (None, len(arrival)):
        order, offs = baseline.by_local_expert(counts, total=total)
        assert order.tolist() == want
        assert offs.dtype == torch.int32 and offs.tolist() == torch.cumsum(counts.sum(0), 0).tolist()
