"""dispatch and combine with plan_ordered=True (no entry barrier, ordered by the step's plan op) on CPU virtual ranks:
the same bits as with the barrier over several steps, bf16 and FP8 rows; flatep.nn.MoE passes it for inference only;
misuse raises one line naming the argument. The ordering itself (a slow reader of the receive region) is tested in
C++ (tests/unit/host/test_plan_ordered.cpp); the CUDA kernels in tests/gpu/test_gpu_serving.cu."""

import pytest
import torch

import flatep
from flatep import testing, virtual
from flatep.nn import dequantize_rows

BF16 = torch.bfloat16
R, EPN, S, H, F, K = 3, 4, 12, 128, 8, 2
E = R * EPN
COUNTS = [S, 0, 7]  # ragged ranks, one empty


@pytest.fixture(autouse=True)
def _release():
    testing.release_all()
    yield
    testing.release_all()


def _inputs(step):
    g = torch.Generator().manual_seed(50 + step)
    idx = [testing.sample_topk(E, S, K, r, sigma=1.5, seed=step)[:s].long() for r, s in enumerate(COUNTS)]
    xs = [torch.randn(s, H, generator=g).to(BF16) for s in COUNTS]
    ws = [torch.rand(s, K, generator=g) for s in COUNTS]
    return idx, xs, ws


@pytest.mark.parametrize("planner", ["balanced", "owner"])
def test_ordered_steps_give_the_barriers_bits(planner):
    """Three steps per Buffer, each plan, dispatch (bf16, then FP8 of the same plan's next step), expert stand-in,
    combine: one Buffer with every op plan-ordered, one with the barriers, on the same inputs."""
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    bufs = virtual.run_threads(R, lambda r: [flatep.Buffer(ranks[r], S, H, E, K, align=4, planner=planner)
                                             for _ in range(2)])

    def step(r, inputs, ordered, fp8):
        buf = bufs[r][1 if ordered else 0]
        idx, xs, ws = inputs
        plan = buf.plan(idx[r])
        if fp8:
            (rq, rs), rw, cu = buf.dispatch(plan, xs[r], ws[r], fp8=True, plan_ordered=ordered)
            rx = dequantize_rows(rq, rs)
        else:
            rx, rw, cu = buf.dispatch(plan, xs[r], ws[r], plan_ordered=ordered)
        end = int(cu[-1]) if cu.numel() else 0
        y = (rx.float() * 1.5).to(BF16)
        out = buf.combine(plan, y, rw, plan_ordered=ordered)
        return rx[:end].clone(), rw[:end].clone(), out

    for s, fp8 in enumerate((False, False, True)):
        inputs = _inputs(s)
        want = virtual.run_threads(R, lambda r: step(r, inputs, False, fp8))
        got = virtual.run_threads(R, lambda r: step(r, inputs, True, fp8))
        for r in range(R):
            for a, b, what in zip(got[r], want[r], ("recv_x", "recv_w", "out")):
                assert torch.equal(a.view(torch.int16) if a.dtype == BF16 else a,
                                   b.view(torch.int16) if b.dtype == BF16 else b), f"step {s} rank {r} {what}"
        assert any(w[2].numel() and w[2].abs().sum() > 0 for w in want), "every output zero: the test checks nothing"


def test_nn_moe_passes_plan_ordered_for_inference_only(monkeypatch):
    """An inference forward (no_grad, and serving pools) runs dispatch and combine plan-ordered; a training forward
    (autograd records) keeps the barriers. The outputs are the ones the layer gave before (the same bits as the
    ops with barriers, above)."""
    seen = []
    dispatch, combine = flatep.Buffer.dispatch, flatep.Buffer.combine

    def spy_dispatch(self, *args, **kwargs):
        seen.append(("dispatch", kwargs.get("plan_ordered", False)))
        return dispatch(self, *args, **kwargs)

    def spy_combine(self, *args, **kwargs):
        seen.append(("combine", kwargs.get("plan_ordered", False)))
        return combine(self, *args, **kwargs)

    monkeypatch.setattr(flatep.Buffer, "dispatch", spy_dispatch)
    monkeypatch.setattr(flatep.Buffer, "combine", spy_combine)
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=30)
    for num_slots, grad in ((None, False), (1, False), (None, True)):
        moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=4, seed=3,
                                                              num_slots=num_slots))
        idx, xs, _ = _inputs(0)
        seen.clear()

        def forward(r):
            with torch.set_grad_enabled(grad):
                return moes[r](xs[r].float().requires_grad_(grad), idx[r])

        virtual.run_threads(R, forward)
        assert sorted(set(seen)) == [("combine", not grad), ("dispatch", not grad)], (num_slots, grad, seen)
        assert len(seen) == 2 * R


def test_plan_ordered_errors_name_the_argument_and_the_value():
    ranks = virtual.virtual_ranks(1, "cpu", timeout_s=30)
    buf = flatep.Buffer(ranks[0], 4, H, 4, 1)
    plan = buf.plan(torch.zeros(3, 1, dtype=torch.long))
    x = torch.randn(3, H).to(BF16)
    with pytest.raises(ValueError, match=r"^dispatch: plan_ordered must be a bool, got 1$"):
        buf.dispatch(plan, x, plan_ordered=1)
    rx, rw, _ = buf.dispatch(plan, x)
    with pytest.raises(ValueError, match=r"^combine: plan_ordered must be a bool, got 'yes'$"):
        buf.combine(plan, rx, rw, plan_ordered="yes")
    with pytest.raises(ValueError, match=r"^dispatch: plan_ordered=True is for eager inference \(no torch.compile, no "
                                         r"input requiring grad\): a backward runs more ops on the same plan, which "
                                         r"need the entry barrier$"):
        buf.dispatch(plan, x.clone().requires_grad_(), plan_ordered=True)
    with pytest.raises(ValueError, match=r"^combine: plan_ordered=True is for eager inference"):
        buf.combine(plan, rx.clone().requires_grad_(), rw, plan_ordered=True)
    with torch.no_grad():  # nothing records: allowed, and the same bits as the barrier's
        got = buf.combine(plan, rx, rw, plan_ordered=True)
    assert torch.equal(got.view(torch.int16), buf.combine(plan, rx, rw).view(torch.int16))
