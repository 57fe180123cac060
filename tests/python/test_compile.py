"""FlatEP's ops as PyTorch custom ops (flatep.ops) and torch.compile (design §3, "torch.compile").

* Registration fallback (any torch): where torch.library.custom_op is missing (torch < 2.4, e.g. Debian's 1.13)
  flatep.ops.AVAILABLE is False, nothing is registered, compiling() is False and the methods take the direct path;
  where it exists the eight ops are registered under torch.ops.flatep.
* torch >= 2.4, CPU backend: torch.compile(fullgraph=True, backend="aot_eager") of plan + dispatch + combine (forward
  and backward) and of the pools ops equals eager bitwise, and torch._dynamo.explain counts no graph break.
* GPU (marker cuda): the same with the default backend (inductor) on a one-rank CUDA Buffer, plus a grouped GEMM
  between dispatch and combine: bitwise or within 2^-6 relative of eager, forward and backward; no graph break.

Reproduce: python3 -m pytest -q tests/python/test_compile.py (add -m cuda on a GPU for the device part only)
"""

import pytest
import torch

import flatep
from flatep import ops, testing

import mp_cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
NEEDS_OPS = pytest.mark.skipif(not ops.AVAILABLE, reason=f"torch {torch.__version__} has no torch.library.custom_op")
S, H, F, E, K = 64, 64, 32, 8, 2
OP_NAMES = ("plan", "dispatch", "combine", "entry_values", "combine_grad", "prefetch", "reduce_grad", "write_grads")


def _inputs(seed, device, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    idx = testing.sample_topk(E, S, K, 0, sigma=0.7, seed=seed).long().to(device)
    x = torch.randn(S, H, generator=g).to(torch.bfloat16).to(device)
    w = torch.rand(S, K, generator=g).to(device)
    gout = torch.randn(S, H, generator=g).to(device)
    if requires_grad:
        x.requires_grad_()
        w.requires_grad_()
    return idx, x, w, gout


def _bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _close(a, b, what, bitwise):
    if bitwise:
        assert torch.equal(_bits(a), _bits(b)), f"{what}: not bitwise equal to eager"
    else:
        err = mp_cases.rel_err(a, b)
        assert err <= 2.0**-6, f"{what}: relative error {err} > 2^-6"


# ---- registration (every torch) ----


def test_registration_degrades_gracefully_without_custom_op():
    has = all(hasattr(torch.library, n) for n in ("custom_op", "register_fake", "register_autograd"))
    assert ops.AVAILABLE == has
    if not has:  # e.g. Debian's torch 1.13: nothing registered, direct calls, plans carry no handle
        assert not ops.compiling()
        assert ops.dispatch_op is None and ops.prefetch_op is None
        buf = flatep.Buffer(None, S, H, E, K, align=1)
        assert buf._op_id is None
        idx, x, w, _ = _inputs(1, "cpu")
        plan = buf.plan(idx)
        assert plan._handle is None
        rx, rw, _ = buf.dispatch(plan, x, w)
        assert buf.combine(plan, rx, rw).shape == (S, H)
        with pytest.raises(ValueError, match="under torch.compile"):
            ops.stream_code("dispatch", buf, None, None, True)
        return
    for name in OP_NAMES:
        assert hasattr(torch.ops.flatep, name), name
    assert not ops.compiling()  # eager: the direct path


@NEEDS_OPS
def test_plan_handles_follow_the_plan_lifetime():
    import gc

    buf = flatep.Buffer(None, S, H, E, K, align=1)
    idx, x, w, _ = _inputs(2, "cpu")
    plan = buf.plan(idx)
    key = int(plan._handle[0])
    assert ops.plan_of(plan._handle) is plan._plan
    # the ops on (handle, storage) equal the methods
    rx, rw = torch.ops.flatep.dispatch(buf._op_id, plan._handle, plan._storage, x, w, True, False, 0, -1)
    rx2, rw2, _ = buf.dispatch(plan, x, w)
    assert torch.equal(_bits(rx), _bits(rx2)) and torch.equal(rw, rw2)
    del plan, rx, rw, rx2, rw2
    gc.collect()
    assert key not in ops._plans


def _step(buf, idx, x, w):
    plan = buf.plan(idx)
    rx, rw, cu = buf.dispatch(plan, x, w)
    y = (rx.float() * 1.5).to(torch.bfloat16)
    return buf.combine(plan, y, rw), cu


def _fwd_bwd(fn, buf, seed, device):
    idx, x, w, gout = _inputs(seed, device, requires_grad=True)
    out, cu = fn(buf, idx, x, w)
    (out.float() * gout).sum().backward()
    return out.detach(), x.grad, w.grad, cu


def _check_compiled_step(device, backend, bitwise):
    import torch._dynamo

    torch._dynamo.reset()
    buf = flatep.Buffer(None, S, H, E, K, align=1, device=device)
    compiled = torch.compile(_step, fullgraph=True, backend=backend)
    for seed in (3, 4):
        want = _fwd_bwd(_step, buf, seed, device)
        got = _fwd_bwd(compiled, buf, seed, device)
        for name, a, b in zip(("out", "grad_x", "grad_w", "cu_seqlens"), got, want):
            _close(a, b, f"seed {seed}: {name}", bitwise)
        with torch.no_grad():  # forward only, too
            idx, x, w, _ = _inputs(seed + 10, device)
            _close(compiled(buf, idx, x, w)[0], _step(buf, idx, x, w)[0], "no_grad out", bitwise)
    idx, x, w, _ = _inputs(5, device, requires_grad=True)
    explanation = torch._dynamo.explain(_step)(buf, idx, x, w)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    buf.check_status()


def _pools_step(buf, pools, layer, idx, g0, g1):
    plan = buf.plan(idx)
    pools.prefetch(plan, layer)
    w0 = layer.weights(0)
    pools.write_grads(plan, layer, 0, g0, accumulate=True)
    pools.write_grads(plan, layer, 1, g1, accumulate=True)
    pools.reduce_grad(plan, layer)
    return w0.float().sum() + plan.cu_seqlens[-1]


def _check_compiled_pools(device, backend):
    import torch._dynamo

    torch._dynamo.reset()
    buf = flatep.Buffer(None, S, H, E, K, align=1, device=device)
    pools = flatep.ExpertPools(None, E, [(H, F), (F, H)], device=device)
    layer = pools.register_layer()
    with torch.no_grad():
        layer.own_weights(0).copy_(torch.randn(E, H, F))
        layer.own_weights(1).copy_(torch.randn(E, F, H))
    g = torch.Generator().manual_seed(6)
    g0 = torch.randn(2 * E, H, F, generator=g).to(device)
    g1 = torch.randn(2 * E, F, H, generator=g).to(device)
    idx = _inputs(6, device)[0]
    results = []
    for fn in (_pools_step, torch.compile(_pools_step, fullgraph=True, backend=backend)):
        for p in (0, 1):
            layer.own_grads(p).zero_()
        r = fn(buf, pools, layer, idx, g0, g1)
        fn(buf, pools, layer, idx, g0, g1)  # accumulates a second time
        results.append((r.detach().clone(), layer.own_grads(0).clone(), layer.own_grads(1).clone()))
    (r_eager, *grads_eager), (r_compiled, *grads_compiled) = results
    _close(r_compiled, r_eager, "weights sum", bitwise=False)  # a reduction: the compiler may order it differently
    for p, (a, b) in enumerate(zip(grads_compiled, grads_eager)):
        assert torch.equal(a, b), f"own_grads({p})"
    explanation = torch._dynamo.explain(_pools_step)(buf, pools, layer, idx, g0, g1)
    assert explanation.graph_break_count == 0, explanation.break_reasons


@NEEDS_OPS
def test_cpu_compiled_step_equals_eager_with_no_graph_break():
    _check_compiled_step("cpu", "aot_eager", bitwise=True)


@NEEDS_OPS
def test_cpu_compiled_pools_ops_equal_eager_with_no_graph_break():
    _check_compiled_pools("cpu", "aot_eager")


# ---- GPU: inductor ----


@pytest.mark.cuda
@NEEDS_OPS
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_compiled_step_equals_eager_with_no_graph_break():
    _check_compiled_step(torch.device("cuda", 0), "inductor", bitwise=True)


def _gemm_step(buf, idx, x, w, w1):
    plan = buf.plan(idx)
    rx, rw, cu = buf.dispatch(plan, x, w)
    h = torch._grouped_mm(rx, w1, offs=cu)
    y = torch.nn.functional.silu(h.float()).to(torch.bfloat16)
    return buf.combine(plan, y, rw), cu


@pytest.mark.cuda
@NEEDS_OPS
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_gpu_compiled_grouped_gemm_step_close_to_eager():
    import torch._dynamo

    torch._dynamo.reset()
    device = torch.device("cuda", 0)
    buf = flatep.Buffer(None, S, H, E, K, align=16, device=device)  # grouped_mm wants 16-row aligned groups
    g = torch.Generator().manual_seed(9)
    w1 = (torch.randn(2 * E, H, H, generator=g) / H**0.5).to(torch.bfloat16).to(device).requires_grad_()
    compiled = torch.compile(_gemm_step, fullgraph=True)
    results = []
    for fn in (_gemm_step, compiled):
        w1.grad = None
        idx, x, w, gout = _inputs(8, device, requires_grad=True)
        out, cu = fn(buf, idx, x, w, w1)
        (out.float() * gout).sum().backward()
        results.append((out.detach(), x.grad, w.grad, w1.grad))
    for name, a, b in zip(("out", "grad_x", "grad_w", "grad_w1"), results[1], results[0]):
        _close(a, b, name, bitwise=False)
    idx, x, w, _ = _inputs(8, device, requires_grad=True)
    explanation = torch._dynamo.explain(_gemm_step)(buf, idx, x, w, w1)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    buf.check_status()


@pytest.mark.cuda
@NEEDS_OPS
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_compiled_pools_ops_equal_eager_with_no_graph_break():
    _check_compiled_pools(torch.device("cuda", 0), "inductor")


@pytest.mark.cuda
@NEEDS_OPS
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_compiled_step_on_the_comm_stream():
    import torch._dynamo

    torch._dynamo.reset()
    device = torch.device("cuda", 0)
    buf = flatep.Buffer(None, S, H, E, K, align=1, device=device)

    def side(buf, idx, x, w):
        plan = buf.plan(idx, stream=buf.comm_stream)
        rx, rw, cu = buf.dispatch(plan, x, w, stream=buf.comm_stream, num_sms=8)
        y = (rx.float() * 1.5).to(torch.bfloat16)
        return buf.combine(plan, y, rw, stream=buf.comm_stream), cu

    want = _fwd_bwd(_step, buf, 11, device)
    got = _fwd_bwd(torch.compile(side, fullgraph=True), buf, 11, device)
    for name, a, b in zip(("out", "grad_x", "grad_w", "cu_seqlens"), got, want):
        _close(a, b, name, bitwise=True)
