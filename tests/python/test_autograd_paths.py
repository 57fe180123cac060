"""Every combination of inputs requiring gradients through dispatch (x, topk_weights), combine (y, weights) and
flatep.nn.MoE (x, router, w1, w2), on two virtual ranks of the CPU backend, against a dense single-process
reference: each gradient that is asked for equals the reference, every other one stays None, and the backward ops
compute only what is asked for (combine_grad's outputs, entry_values, the gradient combine).

dispatch and combine run on small integers and dyadic weights, so every sum is exact and the comparison is bitwise;
the MoE layer is held to the reference with the tolerances of test_distributed.py.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_autograd_paths.py
"""

import inspect
import itertools

import pytest
import torch

import flatep
from flatep import virtual
from flatep.testing import DenseMoE

R, S, H, E, K, F = 2, 8, 16, 4, 2, 24
ALIGN = 4
BF16 = torch.bfloat16
BF16_TOL, FP32_TOL = 2.0**-6, 1e-4  # as test_distributed.py (relative to the reference's largest magnitude)


def skewed_idx(rank):
    """[S, K] int64: every token routes to expert 0 (rank 0) and one other expert, so rank 0 is overloaded, entries
    cross ranks and rank 1 hosts a replica."""
    return torch.tensor([[0, 1 + (t + rank) % (E - 1)] for t in range(S)], dtype=torch.int64)


def ints(generator, *shape, lo=-4, hi=4):
    return torch.randint(lo, hi + 1, shape, generator=generator).float()


def dyadic(generator, *shape):
    """Weights in {0.25, 0.5, 1, 2}: products with small integers stay exact in bf16 and fp32."""
    return torch.tensor([0.25, 0.5, 1.0, 2.0])[torch.randint(0, 4, shape, generator=generator)]


@pytest.fixture(scope="module")
def world():
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    bufs = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, H, E, K, align=ALIGN))
    idx = [skewed_idx(r) for r in range(R)]
    plans = virtual.run_threads(R, lambda r: bufs[r].plan(idx[r]))
    assert plans[0].stats["replicas"] >= 1
    assert any((plans[s].entry_ranks != s).any() for s in range(R)), "no entry crosses ranks"
    return ranks, bufs, idx, plans


def sources_of_rows(plans, nvs):
    """Per destination rank d: [NvS] global token index s*S + t and [NvS] k of the entry at each row (-1: none)."""
    token = [torch.full((nvs,), -1, dtype=torch.long) for _ in range(R)]
    k_of = [torch.full((nvs,), -1, dtype=torch.long) for _ in range(R)]
    for s, plan in enumerate(plans):
        for t, k in itertools.product(range(S), range(K)):
            d, row = int(plan.entry_ranks[t, k]), int(plan.entry_rows[t, k])
            assert token[d][row] == -1, f"two entries on rank {d} row {row}"
            token[d][row], k_of[d][row] = s * S + t, k
    return token, k_of


@pytest.fixture
def calls(world, monkeypatch):
    """Records, per rank, the raw ops the backward passes run: name and the outputs they were asked for."""
    _, bufs, _, _ = world
    record = [[] for _ in range(R)]
    for r, buf in enumerate(bufs):
        def wrap(name, fn, r=r):
            signature = inspect.signature(fn)

            def spy(*args, **kwargs):
                if name == "combine_grad":
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    record[r].append((name, (bound.arguments["want_grad_y"], bound.arguments["want_grad_weights"])))
                else:
                    record[r].append((name,))
                return fn(*args, **kwargs)
            return spy

        for name in ("combine", "entry_values", "combine_grad", "dispatch", "dispatch_region"):
            attr = f"_{name}_raw"
            monkeypatch.setattr(buf, attr, wrap(name, getattr(buf, attr)))
    return record


def run_backward(losses, calls):
    """Clears the forward's records, then runs every rank's backward on its own thread (the ops are collective)."""
    for c in calls:
        c.clear()
    virtual.run_threads(R, lambda r: losses[r].backward())


def check_grad(name, got, want):
    if want is None:
        assert got is None, f"{name}: a gradient where none was asked for"
    else:
        assert got is not None, f"{name}: no gradient, but one was asked for"
        assert torch.equal(got, want), f"{name}: {(got != want).sum().item()} elements differ from the reference"


# (the rows or tokens require grad, the weights: absent, given without grad, requiring grad)
GRAD_CASES = list(itertools.product([False, True], ["none", "fixed", "grad"]))


def rank_inputs(seed, values_shape, weights_shape, values_grad, weights, lo=-4, hi=4):
    """Per rank: integer values in [lo, hi] and weights as the case says; the generator for more inputs."""
    g = torch.Generator().manual_seed(seed)
    values = [ints(g, *values_shape, lo=lo, hi=hi).requires_grad_(values_grad) for _ in range(R)]
    w = [None if weights == "none" else dyadic(g, *weights_shape).requires_grad_(weights == "grad") for _ in range(R)]
    return g, values, w


@pytest.mark.parametrize("x_grad,weights", GRAD_CASES)
def test_dispatch_gradients(world, calls, x_grad, weights):
    _, bufs, _, plans = world
    nvs = bufs[0].num_recv_rows
    g, x, w = rank_inputs(1, (S, H), (S, K), x_grad, weights)
    gx = [ints(g, nvs, H) for _ in range(R)]  # loss = sum(recv_x * gx + recv_w * gw) on every rank
    gw = [ints(g, nvs) for _ in range(R)]

    # Rows past the last group end are unspecified (dispatch does not write them): the loss reads the defined rows.
    ends = [int(p.cu_seqlens[-1]) for p in plans]
    for r in range(R):
        gx[r][ends[r] :], gw[r][ends[r] :] = 0, 0

    def forward(r):
        recv_x, recv_w, _ = bufs[r].dispatch(plans[r], x[r].to(BF16), w[r])
        e = ends[r]
        return recv_x, recv_w, (recv_x[:e].float() * gx[r][:e]).sum() + (recv_w[:e] * gw[r][:e]).sum()

    results = virtual.run_threads(R, forward)
    wants_grad = x_grad or weights == "grad"
    assert all(res[2].requires_grad == wants_grad for res in results)

    # Dense reference: rank d's row holds token s*S + t's row and its k-th weight (1 without weights), 0 elsewhere.
    token, k_of = sources_of_rows(plans, nvs)
    xd = torch.cat([v.detach() for v in x]).requires_grad_(x_grad)
    wd = None if weights == "none" else torch.cat([v.detach() for v in w]).requires_grad_(weights == "grad")
    loss_d = 0
    for d in range(R):
        real = token[d] >= 0
        rows = torch.where(real.unsqueeze(1), xd.to(BF16).float()[token[d].clamp(min=0)], torch.zeros(nvs, H))
        row_w = torch.ones(nvs) if wd is None else wd[token[d].clamp(min=0), k_of[d].clamp(min=0)]
        row_w = torch.where(real, row_w, torch.zeros(nvs))
        e = ends[d]
        assert torch.equal(results[d][0][:e].float(), rows[:e]), f"rank {d}: recv_x"
        assert torch.equal(results[d][1][:e], row_w.detach()[:e]), f"rank {d}: recv_w"
        loss_d = loss_d + (rows * gx[d]).sum() + (row_w * gw[d]).sum()
    if not wants_grad:
        return
    run_backward([res[2] for res in results], calls)
    loss_d.backward()
    for r in range(R):
        mine = slice(r * S, (r + 1) * S)
        check_grad(f"rank {r} x", x[r].grad, xd.grad[mine] if x_grad else None)
        check_grad(f"rank {r} topk_weights", None if w[r] is None else w[r].grad,
                   wd.grad[mine] if weights == "grad" else None)
        # Backward computes only what is asked: the gradient combine for x, entry_values for the weights.
        expected = ([("combine",)] if x_grad else []) + ([("entry_values",)] if weights == "grad" else [])
        assert calls[r] == expected, f"rank {r}"


@pytest.mark.parametrize("y_grad,weights", GRAD_CASES)
def test_combine_gradients(world, calls, y_grad, weights):
    _, bufs, _, plans = world
    nvs = bufs[0].num_recv_rows
    g, y, w = rank_inputs(2, (nvs, H), (nvs,), y_grad, weights, lo=-3, hi=3)
    gout = [ints(g, S, H, lo=-2, hi=2) for _ in range(R)]

    def forward(r):
        out = bufs[r].combine(plans[r], y[r].to(BF16), w[r])
        return out, (out.float() * gout[r]).sum()

    results = virtual.run_threads(R, forward)
    wants_grad = y_grad or weights == "grad"
    assert all(res[1].requires_grad == wants_grad for res in results)

    # Dense reference: out_s[t] = sum_k weight * y over the rows of (t, k) on their destination ranks.
    yd = [v.detach().clone().requires_grad_(y_grad) for v in y]
    wd = None if w[0] is None else [v.detach().clone().requires_grad_(weights == "grad") for v in w]
    ys = torch.stack([v.to(BF16).float() for v in yd])
    ws = torch.ones(R, nvs) if wd is None else torch.stack(wd)
    loss_d = 0
    for s in range(R):
        dest, rows = plans[s].entry_ranks.long(), plans[s].entry_rows.long()
        ref = (ys[dest, rows] * ws[dest, rows].unsqueeze(2)).sum(1).to(BF16)
        assert torch.equal(results[s][0], ref), f"rank {s}: out"
        loss_d = loss_d + (ref.float() * gout[s]).sum()
    if not wants_grad:
        return
    run_backward([res[1] for res in results], calls)
    loss_d.backward()
    for r in range(R):
        check_grad(f"rank {r} y", y[r].grad, yd[r].grad if y_grad else None)
        check_grad(f"rank {r} weights", None if w[r] is None else w[r].grad,
                   wd[r].grad if weights == "grad" else None)
        # Weighted: one dispatch of the output gradient into the receive region (zero copy) and one combine_grad
        # asked for exactly the wanted outputs. Unweighted: the dispatched rows (a tensor of their own) are y's
        # gradient.
        expected = [("dispatch",)]
        if weights != "none":
            expected = [("dispatch_region",), ("combine_grad", (y_grad, weights == "grad"))]
        assert calls[r] == expected, f"rank {r}"


@pytest.fixture(scope="module")
def moe_world(world):
    ranks, _, idx, _ = world
    moes = virtual.run_threads(
        R, lambda r: flatep.nn.MoE(H, F, E, K, group=ranks[r], num_tokens=S, align=ALIGN, seed=3)
    )
    return moes, idx


def rel_err(a, b):
    scale = b.abs().max().item()
    err = (a.detach().float() - b.detach().float()).abs().max().item()
    return err / scale if scale > 0 else err


@pytest.mark.parametrize(
    "x_grad,router_grad,w1_grad,w2_grad", list(itertools.product([False, True], repeat=4)),
    ids=lambda v: "T" if v else "F",
)
def test_moe_gradients(moe_world, x_grad, router_grad, w1_grad, w2_grad):
    moes, idx = moe_world
    g = torch.Generator().manual_seed(4)
    x_all, gout_all = torch.randn(R * S, H, generator=g), torch.randn(R * S, H, generator=g)
    dense = DenseMoE(H, F, E, K, seed=3)
    params = lambda m: (m.router.weight, m.w1, m.w2)  # noqa: E731
    for m in moes:
        for p, flag in zip(params(m), (router_grad, w1_grad, w2_grad)):
            p.requires_grad_(flag)
            p.grad = None
        m.zero_main_grad()  # backward adds into main_grad
    for p, flag in zip((dense.router_weight, dense.w1, dense.w2), (router_grad, w1_grad, w2_grad)):
        p.requires_grad_(flag)
    x = [x_all[r * S:(r + 1) * S].clone().requires_grad_(x_grad) for r in range(R)]
    outs = virtual.run_threads(R, lambda r: moes[r](x[r], idx[r]))
    xr = x_all.clone().requires_grad_(x_grad)
    ref = dense(xr, torch.cat(idx), chunks=[S] * R)
    wants_grad = x_grad or router_grad or w1_grad or w2_grad
    assert all(o.requires_grad == wants_grad for o in outs) and ref.requires_grad == wants_grad
    for r in range(R):
        assert rel_err(outs[r], ref[r * S:(r + 1) * S]) <= BF16_TOL, f"rank {r}: out"
    assert moes[0].last_plan.stats["replicas"] >= 1  # reduce_grad has replicas to add
    if not wants_grad:
        return
    virtual.run_threads(R, lambda r: (outs[r].float() * gout_all[r * S:(r + 1) * S]).sum().backward())
    (ref.float() * gout_all).sum().backward()

    def check(name, got, want, tol):
        if want is None:
            assert got is None, f"{name}: a gradient where none was asked for"
        else:
            assert got is not None, f"{name}: no gradient, but one was asked for"
            assert rel_err(got, want) <= tol, f"{name}: relative error {rel_err(got, want):.3g} > {tol}"

    for r in range(R):
        lo, hi = r * (E // R), (r + 1) * (E // R)
        check(f"rank {r} x", x[r].grad, xr.grad[r * S:(r + 1) * S] if x_grad else None, BF16_TOL)
        for name, param, want in (("w1", moes[r].w1, w1_grad), ("w2", moes[r].w2, w2_grad)):
            # Expert gradients live in main_grad (fp32, the library's memory); .grad stays None.
            assert param.grad is None, f"rank {r} {name}: .grad set (expert gradients go to main_grad)"
            ref_grad = getattr(dense, name).grad
            if want:
                check(f"rank {r} {name}", param.main_grad, ref_grad[lo:hi], FP32_TOL)
            else:
                assert not param.main_grad.any(), f"rank {r} {name}: main_grad written though not asked for"

        if not router_grad:
            assert moes[r].router.weight.grad is None, f"rank {r}: router gradient where none was asked for"
    if router_grad:  # replicated: the layer's gradient is the sum over the ranks (what an all-reduce gives)
        router_sum = sum(m.router.weight.grad for m in moes)
        check("router", router_sum, dense.router_weight.grad, FP32_TOL)


def test_combine_backward_in_the_region_is_the_copy_path(world):
    """A weighted combine's backward leaves the dispatched output gradient in the receive region
    (Buffer._combine_backward_raw): the same bits as a dispatch into a tensor of its own followed by combine_grad,
    whatever the region held before (NaN everywhere: padding rows and rows past the end are never read), for each
    subset of the outputs."""
    _, bufs, _, plans = world
    nvs = bufs[0].num_recv_rows
    g = torch.Generator().manual_seed(11)
    grad_out = [torch.randn(S, H, generator=g).to(BF16) for _ in range(R)]
    y = [torch.randn(nvs, H, generator=g).to(BF16) for _ in range(R)]
    w = [torch.rand(nvs, generator=g) for _ in range(R)]

    def copy_path(r, want_y, want_w):
        rows, _ = bufs[r]._dispatch_raw(plans[r], grad_out[r], None, want_weights=False)
        return bufs[r]._combine_grad_raw(plans[r], rows, y[r], w[r], want_y, want_w)

    def region_path(r, want_y, want_w):
        bufs[r]._region_views()[0].fill_(float("nan"))
        return bufs[r]._combine_backward_raw(plans[r], grad_out[r], y[r], w[r], want_y, want_w)

    for want_y, want_w in ((True, True), (True, False), (False, True)):
        want = virtual.run_threads(R, lambda r: copy_path(r, want_y, want_w))
        got = virtual.run_threads(R, lambda r: region_path(r, want_y, want_w))
        for r in range(R):
            for name, a, b in zip(("grad_y", "grad_weights"), got[r], want[r]):
                assert (a is None) == (b is None), (name, want_y, want_w)
                if a is not None:
                    assert not a.isnan().any(), f"rank {r} {name}: NaN from the region's old contents"
                    assert torch.equal(a.view(torch.int16) if a.dtype == BF16 else a.view(torch.int32),
                                       b.view(torch.int16) if b.dtype == BF16 else b.view(torch.int32)), \
                        f"rank {r} {name} ({want_y}, {want_w}): not the copy path's bits"
