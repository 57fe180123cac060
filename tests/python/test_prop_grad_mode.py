"""The grad-mode rules of the Python front, each over every combination of grad mode (enabled, torch.no_grad(),
torch.inference_mode()) and of which inputs require grad, the case each rule exists for among them: a forward-only
option (plan_ordered, fp8, zero_copy, a serving layer) refuses a call that autograd would record, and only such a
call (inputs that require grad under no_grad or inference_mode are the eager inference it is for); combine and
dispatch record autograd exactly when a differentiable input requires grad and grad mode is on, the weights alone
included; the training layout's inference (autograd records nothing) runs the serving FFN and gives the bits of the
recorded forward.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_prop_grad_mode.py
"""

import contextlib
import itertools

import pytest
import torch

import flatep
from flatep import testing

S, H, E, K = 6, 128, 4, 2
BF16 = torch.bfloat16
MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.fixture(scope="module")
def buffer():
    testing.release_all()
    yield flatep.Buffer(None, S, H, E, K, align=1)
    testing.release_all()


def inputs(x_grad, w_grad):
    g = torch.Generator().manual_seed(62)
    x = torch.randn(S, H, generator=g).to(BF16).requires_grad_(x_grad)
    w = torch.rand(S, K, generator=g).requires_grad_(w_grad)
    idx = torch.tensor([[t % E, (t + 1) % E] for t in range(S)])
    return x, w, idx


def records(mode, *tensors):
    return mode == "grad" and any(t.requires_grad for t in tensors)


CASES = list(itertools.product(MODES, [False, True], [False, True]))


@pytest.mark.parametrize("mode,x_grad,w_grad", CASES)
def test_plan_ordered_refuses_exactly_the_calls_autograd_records(buffer, mode, x_grad, w_grad):
    x, w, idx = inputs(x_grad, w_grad)
    plan = buffer.plan(idx)
    with torch.no_grad():
        want_rows, want_w, _ = buffer.dispatch(plan, x, w)
        want_out = buffer.combine(plan, want_rows, want_w)
    with MODES[mode]():
        if records(mode, x, w):
            with pytest.raises(ValueError, match="dispatch: plan_ordered=True is for eager inference"):
                buffer.dispatch(plan, x, w, plan_ordered=True)
            rows, recv_w, _ = buffer.dispatch(plan, x, w)  # the object is usable: the same call without the option
        else:
            rows, recv_w, _ = buffer.dispatch(plan, x, w, plan_ordered=True)
        assert torch.equal(rows, want_rows) and torch.equal(recv_w, want_w)
        y = rows.detach().requires_grad_(x_grad) if mode == "grad" else rows
        if records(mode, y, recv_w):
            with pytest.raises(ValueError, match="combine: plan_ordered=True is for eager inference"):
                buffer.combine(plan, y, recv_w, plan_ordered=True)
        else:
            assert torch.equal(buffer.combine(plan, y, recv_w, plan_ordered=True), want_out)


@pytest.mark.parametrize("mode,x_grad,w_grad", CASES)
@pytest.mark.parametrize("option", ["fp8", "zero_copy"])
def test_forward_only_dispatch_refuses_exactly_the_calls_autograd_records(buffer, option, mode, x_grad, w_grad):
    x, w, idx = inputs(x_grad, w_grad)
    plan = buffer.plan(idx)
    with MODES[mode]():
        if records(mode, x, w):
            with pytest.raises(ValueError, match=f"dispatch: {option}=True is forward-only"):
                buffer.dispatch(plan, x, w, **{option: True})
            return
        out = buffer.dispatch(plan, x, w, **{option: True})
    with torch.no_grad():
        rows, recv_w, _ = buffer.dispatch(plan, x, w)
    if option == "zero_copy":
        assert torch.equal(out[0], rows) and torch.equal(out[1], recv_w)
    else:
        (q, scales), fp8_w, _ = out
        assert torch.equal(fp8_w, recv_w)
        want_q, want_scales = flatep.fp8.quantize(rows)
        real = plan.real_rows
        assert torch.equal(flatep.fp8.as_bytes(q)[real], flatep.fp8.as_bytes(want_q)[real])
        assert torch.equal(scales[real], want_scales[real])


@pytest.mark.parametrize("mode,x_grad,w_grad", CASES)
def test_combine_and_dispatch_record_exactly_when_an_input_requires_grad(buffer, mode, x_grad, w_grad):
    x, w, idx = inputs(x_grad, w_grad)
    plan = buffer.plan(idx)
    with MODES[mode]():
        rows, recv_w, _ = buffer.dispatch(plan, x, w)
        assert rows.requires_grad == recv_w.requires_grad == records(mode, x, w)
        out = buffer.combine(plan, rows, recv_w)
        assert out.requires_grad == records(mode, x, w)
    if not records(mode, x, w):
        return
    out.float().sum().backward()
    # Only the weights require grad: the case the rule has the weights in it for (their gradient is <x row, y row>).
    assert (x.grad is not None) == x_grad and (w.grad is not None) == w_grad
    if w_grad:
        assert w.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("x_grad", [False, True])
@pytest.mark.parametrize("router_grad", [False, True])
def test_a_serving_layer_refuses_exactly_the_forwards_autograd_records(mode, x_grad, router_grad):
    testing.release_all()
    moe = flatep.nn.MoE(H, 32, E, K, num_tokens=S, align=1, num_slots=1, activation="silu")
    moe.router.weight.requires_grad_(router_grad)
    assert not moe.w1.requires_grad and not moe.w2.requires_grad  # serving weights have no gradient
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(1)).requires_grad_(x_grad)
    with torch.no_grad():
        want = moe(x)
    with MODES[mode]():
        if mode == "grad" and (x_grad or router_grad):
            with pytest.raises(ValueError, match="is inference only"):
                moe(x)
        else:
            assert torch.equal(moe(x), want)
    testing.release_all()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_training_layouts_inference_gives_the_recorded_forwards_bits(mode):
    testing.release_all()
    moe = flatep.nn.MoE(H, 32, E, K, num_tokens=S, align=1)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(2))
    recorded = moe(x)
    assert recorded.requires_grad
    with MODES[mode]():
        inferred = moe(x)
    assert not inferred.requires_grad and inferred.grad_fn is None
    assert torch.equal(inferred, recorded.detach())
    testing.release_all()
