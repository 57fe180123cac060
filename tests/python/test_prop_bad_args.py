"""Bad arguments leave the object as it was (hypothesis): a sequence of calls, each with one kind of bad argument
(not a tensor, a wrong dtype, shape or device, an expert id out of range, a plan of another Buffer, a flag that is
not a bool, an out-of-range SM budget or projection, a forward-only option where it cannot go, ...), each refused with
a one-line ValueError naming the argument; then the object's next good step gives bitwise what a fresh object's gives
(the same good calls without the bad ones): Buffer (plan, dispatch, combine, entry_values, the plan's arrays and its
generation), ExpertPools (prefetch, write_grads, reduce_grad: the weights and gradient views, which a refused
write_grads leaves untouched at once) and nn.MoE (forward, backward, every gradient, use_planner and the fp8
switch).

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_prop_bad_args.py
"""

import pytest
import torch

pytest.importorskip("hypothesis")  # Debian's python3-hypothesis (scripts/setup.sh)
from hypothesis import given, settings
from hypothesis import strategies as st

import flatep
from flatep import testing

S, H, E, K, ALIGN = 8, 16, 4, 2, 8
BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("fresh_caches")


def refused(call, *errors):
    """Runs call(); it must raise one of `errors` (ValueError by default) with a one-line message."""
    errors = errors or (ValueError,)
    with pytest.raises(errors) as info:
        call()
    text = str(info.value)
    assert text and "\n" not in text, f"not one line: {text!r}"
    return text


def released(check, *args):
    """check(*args), then the objects it made dropped (each hypothesis example's go before the next one's are made)."""
    try:
        check(*args)
    finally:
        testing.release_all()


def inputs(seed, s=S):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E, (s, K), generator=g)
    x = torch.randn(s, H, generator=g).to(BF16)
    w = torch.rand(s, K, generator=g)
    return idx, x, w


# ---- Buffer ----

META = torch.empty(S, H, dtype=BF16, device="meta")


def other_plan():
    return flatep.Buffer(None, S, H, E, K, align=ALIGN).plan(torch.zeros(S, K, dtype=torch.int64))


# kind -> (what the call gets wrong, call(buffer, plan, x, w, idx)). Each must be refused.
BUFFER_BAD = {
    "plan: topk_idx a list": lambda b, p, x, w, i: b.plan(i.tolist()),
    "plan: topk_idx float": lambda b, p, x, w, i: b.plan(i.float()),
    "plan: topk_idx int16": lambda b, p, x, w, i: b.plan(i.to(torch.int16)),
    "plan: topk_idx with s > S": lambda b, p, x, w, i: b.plan(torch.zeros(S + 1, K, dtype=torch.int64)),
    "plan: topk_idx [s, K+1]": lambda b, p, x, w, i: b.plan(torch.zeros(S, K + 1, dtype=torch.int64)),
    "plan: topk_idx 1-d": lambda b, p, x, w, i: b.plan(i.flatten()),
    "plan: topk_idx on meta": lambda b, p, x, w, i: b.plan(i.to("meta")),
    "plan: num_sms -2": lambda b, p, x, w, i: b.plan(i, num_sms=-2),
    "plan: num_sms a str": lambda b, p, x, w, i: b.plan(i, num_sms="4"),
    "dispatch: plan None": lambda b, p, x, w, i: b.dispatch(None, x, w),
    "dispatch: another Buffer's plan": lambda b, p, x, w, i: b.dispatch(other_plan(), x, w),
    "dispatch: x float32": lambda b, p, x, w, i: b.dispatch(p, x.float(), w),
    "dispatch: x [s, H+8]": lambda b, p, x, w, i: b.dispatch(p, torch.zeros(S, H + 8, dtype=BF16), w),
    "dispatch: x on meta": lambda b, p, x, w, i: b.dispatch(p, META, w),
    "dispatch: x a tuple without fp8": lambda b, p, x, w, i: b.dispatch(p, (x, w), w),
    "dispatch: topk_weights bf16": lambda b, p, x, w, i: b.dispatch(p, x, w.to(BF16)),
    "dispatch: topk_weights [s, K+1]": lambda b, p, x, w, i: b.dispatch(p, x, torch.zeros(S, K + 1)),
    "dispatch: fp8 a str": lambda b, p, x, w, i: b.dispatch(p, x, w, fp8="yes"),
    "dispatch: fp8 with H % 128": lambda b, p, x, w, i: b.dispatch(p, x, w, fp8=True),
    "dispatch: zero_copy 1": lambda b, p, x, w, i: b.dispatch(p, x, w, zero_copy=1),
    "dispatch: plan_ordered a str": lambda b, p, x, w, i: b.dispatch(p, x, w, plan_ordered="x"),
    "dispatch: num_sms 2^21": lambda b, p, x, w, i: b.dispatch(p, x, w, num_sms=2**21),
    "combine: y [NvS, H] float32": lambda b, p, x, w, i: b.combine(p, torch.zeros(b.num_recv_rows, H), None),
    "combine: y [NvS-1, H]": lambda b, p, x, w, i: b.combine(p, torch.zeros(b.num_recv_rows - 1, H, dtype=BF16)),
    "combine: weights [NvS+1]": lambda b, p, x, w, i: b.combine(
        p, torch.zeros(b.num_recv_rows, H, dtype=BF16), torch.zeros(b.num_recv_rows + 1)),
    "combine: another Buffer's plan": lambda b, p, x, w, i: b.combine(
        other_plan(), torch.zeros(b.num_recv_rows, H, dtype=BF16)),
    "entry_values: row_values int32": lambda b, p, x, w, i: b.entry_values(
        p, torch.zeros(b.num_recv_rows, dtype=torch.int32)),
    "entry_values: plan a str": lambda b, p, x, w, i: b.entry_values("plan", torch.zeros(b.num_recv_rows)),
    "num_sms = -1": lambda b, p, x, w, i: setattr(b, "num_sms", -1),
    "num_sms = None": lambda b, p, x, w, i: setattr(b, "num_sms", None),
    "num_sms = 2^21": lambda b, p, x, w, i: setattr(b, "num_sms", 2**21),
}
# Refused after the collective op ran (every rank alike): the plan's counter moved on, as on every rank.
BUFFER_BAD_AFTER_THE_OP = {
    "plan: an expert id E": lambda b, p, x, w, i: b.plan(torch.where(i == 0, E, i)),
    "plan: an expert id -1": lambda b, p, x, w, i: b.plan(torch.where(i == 1, -1, i)),
}


def buffer_step(buffer, idx, x, w):
    """Everything a good step computes (plan arrays, rows, outputs), and the plan's generation."""
    plan = buffer.plan(idx)
    recv_x, recv_w, cu = buffer.dispatch(plan, x, w)
    real = plan.real_rows
    out = buffer.combine(plan, recv_x, recv_w)
    values = buffer.entry_values(plan, recv_w)
    arrays = [plan.slot_expert, cu, plan.tpe_all, plan.alloc, plan.entry_ranks, plan.entry_rows, real,
              recv_x[: int(cu[-1])], recv_w[: int(cu[-1])], out, values]
    return arrays, plan.generation


def check_buffer_after(bad, seed, s):
    """`bad` refused one after the other on a Buffer, then a step of s tokens: bitwise a fresh Buffer's step."""
    idx, x, w = inputs(seed)
    first = flatep.Buffer(None, S, H, E, K, align=ALIGN)
    fresh = flatep.Buffer(None, S, H, E, K, align=ALIGN)
    plan = first.plan(idx)  # a good call before the bad ones, on both
    fresh.plan(idx)
    num_sms = first.num_sms
    ops_ran = 0
    for kind in bad:
        call = BUFFER_BAD.get(kind) or BUFFER_BAD_AFTER_THE_OP[kind]
        refused(lambda: call(first, plan, x, w, idx))
        ops_ran += kind in BUFFER_BAD_AFTER_THE_OP
    assert first.num_sms == num_sms
    idx, x, w = inputs(seed + 1, s)
    got, generation = buffer_step(first, idx, x, w)
    want, fresh_generation = buffer_step(fresh, idx, x, w)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert generation == fresh_generation + ops_ran


@pytest.mark.parametrize("kind", sorted(BUFFER_BAD) + sorted(BUFFER_BAD_AFTER_THE_OP))
def test_each_refused_buffer_call_leaves_the_buffer_as_it_was(kind):
    check_buffer_after([kind], seed=len(kind), s=S)


@settings(max_examples=60)
@given(bad=st.lists(st.sampled_from(sorted(BUFFER_BAD) + sorted(BUFFER_BAD_AFTER_THE_OP)), min_size=1, max_size=4),
       seed=st.integers(0, 2**16), s=st.integers(0, S))
def test_a_buffer_after_refused_calls_steps_like_a_fresh_one(bad, seed, s):
    released(check_buffer_after, bad, seed, s)


# ---- ExpertPools ----

PROJECTIONS = [(H, 8), (8, H)]


def pools_setup():
    """A Buffer and training pools of one layer whose own weights hold a pattern."""
    buffer = flatep.Buffer(None, S, H, E, K, align=ALIGN)
    pools = flatep.ExpertPools(None, E, PROJECTIONS)
    layer = pools.register_layer()
    g = torch.Generator().manual_seed(5)
    for p in range(len(PROJECTIONS)):
        layer.own_weights(p).copy_(torch.randn(layer.own_weights(p).shape, generator=g).to(BF16))
    return buffer, pools, layer


def grad_of(p, seed):
    rows, cols = PROJECTIONS[p]
    return torch.randn(2 * E, rows, cols, generator=torch.Generator().manual_seed(seed))


POOLS_BAD = {
    "prefetch: plan a str": lambda pools, layer, plan, other: pools.prefetch("plan", layer),
    "prefetch: another pools' layer": lambda pools, layer, plan, other: pools.prefetch(plan, other),
    "prefetch: plan_ordered on training pools": lambda pools, layer, plan, other: pools.prefetch(
        plan, layer, plan_ordered=True),
    "prefetch: plan_ordered 1": lambda pools, layer, plan, other: pools.prefetch(plan, layer, plan_ordered=1),
    "prefetch: a plan of another shape": lambda pools, layer, plan, other: pools.prefetch(
        flatep.Buffer(None, S, H, 2 * E, K).plan(torch.zeros(S, K, dtype=torch.int64)), layer),
    "prefetch: num_sms -5": lambda pools, layer, plan, other: pools.prefetch(plan, layer, num_sms=-5),
    "write_grads: projection 2": lambda pools, layer, plan, other: pools.write_grads(plan, layer, 2, grad_of(0, 1)),
    "write_grads: projection True": lambda pools, layer, plan, other: pools.write_grads(
        plan, layer, True, grad_of(1, 1)),
    "write_grads: grad of the other projection": lambda pools, layer, plan, other: pools.write_grads(
        plan, layer, 0, grad_of(1, 1)),
    "write_grads: grad int32": lambda pools, layer, plan, other: pools.write_grads(
        plan, layer, 0, grad_of(0, 1).int()),
    "write_grads: grad a list": lambda pools, layer, plan, other: pools.write_grads(
        plan, layer, 0, grad_of(0, 1).tolist()),
    "write_grads: another pools' layer": lambda pools, layer, plan, other: pools.write_grads(
        plan, other, 0, grad_of(0, 1)),
    "reduce_grad: plan None": lambda pools, layer, plan, other: pools.reduce_grad(None, layer),
    "reduce_grad: num_sms a float": lambda pools, layer, plan, other: pools.reduce_grad(plan, layer, num_sms=1.0),
    "layer.weights(5)": lambda pools, layer, plan, other: layer.weights(5),
    "layer.own_grads(-1)": lambda pools, layer, plan, other: layer.own_grads(-1),
    "slot_pool(True)": lambda pools, layer, plan, other: pools.slot_pool(True),
    "reduce_pool('0')": lambda pools, layer, plan, other: pools.reduce_pool("0"),
    "view_row on training pools": lambda pools, layer, plan, other: pools.view_row(0),
    "view_row(E)": lambda pools, layer, plan, other: pools.view_row(E),
    "num_sms = -3": lambda pools, layer, plan, other: setattr(pools, "num_sms", -3),
}


def snapshot(layer):
    """Copies of the layer's weights and gradient views (own experts and the pools' slots)."""
    return [t.clone() for p in range(len(PROJECTIONS)) for t in (layer.weights(p), layer.grads(p))]


def pools_step(buffer, pools, layer, idx, seed):
    plan = buffer.plan(idx)
    pools.prefetch(plan, layer)
    pools.write_grads(plan, layer, 0, grad_of(0, seed))
    pools.write_grads(plan, layer, 1, grad_of(1, seed).to(BF16), accumulate=True)
    pools.reduce_grad(plan, layer)
    return snapshot(layer)


def check_pools_after(bad, seed):
    """`bad` refused one after the other on pools, each leaving the layer's memory as it was, then a step: bitwise
    fresh pools' step."""
    idx, _, _ = inputs(seed)
    buffer, pools, layer = pools_setup()
    fresh_buffer, fresh_pools, fresh_layer = pools_setup()
    other = flatep.ExpertPools(None, E, PROJECTIONS).register_layer()
    plan = buffer.plan(idx)
    fresh_buffer.plan(idx)
    num_sms = pools.num_sms
    for kind in bad:
        before = snapshot(layer)
        refused(lambda: POOLS_BAD[kind](pools, layer, plan, other))
        assert all(torch.equal(a, b) for a, b in zip(snapshot(layer), before)), f"{kind} changed the layer's memory"
    assert pools.num_sms == num_sms
    idx, _, _ = inputs(seed + 1)
    got = pools_step(buffer, pools, layer, idx, seed)
    want = pools_step(fresh_buffer, fresh_pools, fresh_layer, idx, seed)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", sorted(POOLS_BAD))
def test_each_refused_pools_call_leaves_the_pools_as_they_were(kind):
    check_pools_after([kind], seed=len(kind))


@settings(max_examples=60)
@given(bad=st.lists(st.sampled_from(sorted(POOLS_BAD)), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_pools_after_refused_calls_step_like_fresh_ones(bad, seed):
    released(check_pools_after, bad, seed)


# ---- nn.MoE ----

MOE_BAD = {
    "forward: x [s, H+8]": lambda moe, x: moe(torch.zeros(S, H + 8)),
    "forward: x 1-d": lambda moe, x: moe(x.flatten()),
    "forward: x on meta": lambda moe, x: moe(x.to("meta")),
    "forward: x a list": lambda moe, x: moe(x.tolist()),
    "forward: topk_idx [s, K+1]": lambda moe, x: moe(x, torch.zeros(S, K + 1, dtype=torch.int64)),
    "forward: topk_idx with an id E": lambda moe, x: moe(x, torch.full((S, K), E)),
    "forward: topk_idx with an id -1": lambda moe, x: moe(x, torch.full((S, K), -1)),
    "forward: topk_idx float": lambda moe, x: moe(x, torch.zeros(S, K)),
    "forward: topk_idx [s+1, K]": lambda moe, x: moe(x, torch.zeros(S + 1, K, dtype=torch.int64)),
    "use_planner('bogus')": lambda moe, x: moe.use_planner("bogus"),
    "use_planner with num_tokens 0": lambda moe, x: moe.use_planner("owner", 0),
    "fp8 = 'yes'": lambda moe, x: setattr(moe, "fp8", "yes"),
    "fp8 = True with H % 128": lambda moe, x: setattr(moe, "fp8", True),
}


def moe_step(moe, x):
    out = moe(x)
    out.float().pow(2).sum().backward()
    grads = [moe.w1.main_grad.clone(), moe.w2.main_grad.clone(), moe.router.weight.grad.clone()]
    moe.zero_main_grad()
    moe.router.weight.grad = None
    return [out.detach()] + grads


def check_moe_after(bad, seed):
    """`bad` refused one after the other on a layer (its Buffer, planner and fp8 switch kept), then a forward and
    backward: bitwise a fresh layer's."""
    args = dict(num_tokens=S, align=ALIGN, activation="silu", seed=7)
    moe = flatep.nn.MoE(H, 8, E, K, **args)
    testing.release_all()  # the fresh layer gets a Buffer and pools of its own
    fresh = flatep.nn.MoE(H, 8, E, K, **args)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(seed))
    buffer, planner, fp8 = moe.buffer, moe.planner, moe.fp8
    for kind in bad:
        refused(lambda: MOE_BAD[kind](moe, x), ValueError)
        assert (moe.buffer, moe.planner, moe.fp8) == (buffer, planner, fp8), kind
    for a, b in zip(moe_step(moe, x), moe_step(fresh, x)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", sorted(MOE_BAD))
def test_each_refused_moe_call_leaves_the_layer_as_it_was(kind):
    check_moe_after([kind], seed=len(kind))


@settings(max_examples=30)
@given(bad=st.lists(st.sampled_from(sorted(MOE_BAD)), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_a_moe_layer_after_refused_calls_steps_like_a_fresh_one(bad, seed):
    released(check_moe_after, bad, seed)
