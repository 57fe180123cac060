"""FlatEP's ops as PyTorch custom ops (flatep.ops) and torch.compile (design §3, "torch.compile").

* Registration fallback (any torch): where torch.library.custom_op is missing (torch < 2.4, e.g. Debian's 1.13)
  flatep.ops.AVAILABLE is False, nothing is registered, compiling() is False and the methods take the direct path;
  where it exists the eight ops are registered under torch.ops.flatep.
* torch >= 2.4, CPU backend: torch.compile(fullgraph=True, backend="aot_eager") of plan + dispatch + combine (forward
  and backward) and of the pools ops equals eager bitwise, and torch._dynamo.explain counts no graph break.
* GPU (marker cuda): the same with the default backend (inductor) on a one-rank CUDA Buffer, plus a grouped GEMM
  between dispatch and combine: bitwise or within 2^-6 relative of eager, forward and backward; no graph break.
* nn.MoE (issue 20's target): torch.compile(fullgraph=True) of a 2-layer model (MoE, RMS norm and residual between,
  the second layer with a shared expert, a loss) equals eager bitwise on the CPU backend (aot_eager): the output,
  the loss and every gradient (both layers' main_grad, the routers', the shared expert's, the input's); no graph
  break; forward_microbatches too. On cuda:0 with inductor: within 2^-6 relative. Any torch: the experts' compiled
  arithmetic (nn.ffn_forward / ffn_backward / experts_backward_step, the bodies of the "experts" ops) run through
  an autograd.Function in place of the eager one gives the eager model's bits (so the torch 1.13 machine checks it
  too), and what the compiled path refuses (FP8, no Buffer yet) raises a ValueError saying so.

Reproduce: python3 -m pytest -q tests/python/test_compile.py (add -m cuda on a GPU for the device part only)
"""

import itertools

import pytest
import torch

import flatep
from flatep import ops, testing

import mp_cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
NEEDS_OPS = pytest.mark.skipif(not ops.AVAILABLE, reason=f"torch {torch.__version__} has no torch.library.custom_op")
S, H, F, E, K = 64, 64, 32, 8, 2
OP_NAMES = ("plan", "dispatch", "combine", "entry_values", "combine_grad", "prefetch", "reduce_grad", "write_grads",
            "experts", "experts_backward")


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
        assert ops.dispatch_op is None and ops.prefetch_op is None and ops.experts_op is None
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


# ---- nn.MoE ----

MOE_ALIGN = 8  # padding rows inside the groups (CPU); the GPU tests use 16 (grouped_mm's row alignment)


def _rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _TwoLayer(torch.nn.Module):
    """Two MoE layers with an RMS norm before each and a residual around each; the second has a shared expert.
    forward(x, gout) -> (out, loss = sum(out * gout))."""

    def __init__(self, device, align, seed=1):
        super().__init__()
        kwargs = dict(num_tokens=S, align=align, device=device)
        self.moe1 = flatep.nn.MoE(H, F, E, K, seed=seed, **kwargs)
        self.moe2 = flatep.nn.MoE(H, F, E, K, seed=seed + 1, shared_ffn=F, **kwargs)
        self.layers = [self.moe1, self.moe2]

    def forward(self, x, gout):
        h = x + self.moe1(_rms_norm(x))
        out = h + self.moe2(_rms_norm(h))
        return out, (out * gout).sum()


def _model_inputs(seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, H, generator=g).to(device), torch.randn(S, H, generator=g).to(device)


def _model_step(model, fn, x, gout):
    """One forward and backward of fn (the model, compiled or not) from zero gradients: (out, loss, gradients by
    name: every parameter's .grad that is set, each layer's main_grad, the input's)."""
    for p in model.parameters():
        p.grad = None
    for moe in model.layers:
        moe.zero_main_grad()
    x = x.detach().clone().requires_grad_()
    out, loss = fn(x, gout)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    for i, moe in enumerate(model.layers):
        assert moe.w1.grad is None and moe.w2.grad is None, "expert gradients go to main_grad, .grad stays unset"
        grads[f"layer{i}.w1.main_grad"] = moe.w1.main_grad.clone()
        grads[f"layer{i}.w2.main_grad"] = moe.w2.main_grad.clone()
    grads["x"] = x.grad
    return out.detach(), loss.detach(), grads


def _check_same_step(got, want, bitwise, what=""):
    (out, loss, grads), (out_w, loss_w, grads_w) = got, want
    _close(out, out_w, f"{what}out", bitwise)
    _close(loss.reshape(1), loss_w.reshape(1), f"{what}loss", bitwise)
    assert sorted(grads) == sorted(grads_w), f"{what}gradients: {sorted(grads)} != {sorted(grads_w)}"
    for name in grads_w:
        _close(grads[name], grads_w[name], f"{what}{name}", bitwise)
    assert all(grads_w[f"layer{i}.w1.main_grad"].abs().sum() > 0 for i in (0, 1)), "main_grad was not written"


class _CompilePathExperts(torch.autograd.Function):
    """The compiled path's experts arithmetic as an eager autograd.Function (what the "experts" custom op and its
    registered backward run), for torches without custom ops."""

    @staticmethod
    def forward(ctx, moe, plan, recv_x, w1, w2):
        layer = moe.expert_layer
        moe.pools.prefetch(plan, layer)
        y, h, a = flatep.nn.ffn_forward(recv_x, layer.weights(0), layer.weights(1), plan.cu_seqlens, moe.activation,
                                        True)
        ctx.moe, ctx.plan = moe, plan
        ctx.save_for_backward(recv_x, h, a)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        moe, plan = ctx.moe, ctx.plan
        recv_x, h, a = ctx.saved_tensors
        want_x, want_w1, want_w2 = ctx.needs_input_grad[2:5]
        grad_x = flatep.nn.experts_backward_step(
            moe.pools, moe.expert_layer, plan, grad_y.to(torch.bfloat16).contiguous(), recv_x, h, a, plan.cu_seqlens,
            moe.activation, want_x, want_w1, want_w2,
        )
        return None, None, grad_x, None, None


def test_compile_path_experts_arithmetic_equals_eager_moe(monkeypatch):
    model = _TwoLayer("cpu", MOE_ALIGN, seed=21)
    for seed in (22, 23):
        x, gout = _model_inputs(seed, "cpu")
        want = _model_step(model, model, x, gout)
        with monkeypatch.context() as patch:
            patch.setattr(flatep.nn, "_ExpertsFunction", _CompilePathExperts)
            got = _model_step(model, model, x, gout)
        _check_same_step(got, want, bitwise=True, what=f"seed {seed}: ")


def _check_ffn_backward(activation, device, cu, rows, bitwise):
    # the eager experts' arithmetic: grouped_ffn differentiated by autograd, on fp32 copies of the views (CPU) or on
    # the bf16 views themselves (GPU, grouped_mm)
    g = torch.Generator().manual_seed(31)
    groups, ffn = len(cu), 16
    cols = 2 * ffn if activation == "swiglu" else ffn
    cu = torch.tensor(cu, dtype=torch.int32, device=device)
    x = torch.randn(rows, H, generator=g).to(torch.bfloat16).to(device)
    w1 = (torch.randn(groups, H, cols, generator=g) / H**0.5).to(torch.bfloat16).to(device)
    w2 = (torch.randn(groups, ffn, H, generator=g) / ffn**0.5).to(torch.bfloat16).to(device)
    grad_y = torch.randn(rows, H, generator=g).to(torch.bfloat16).to(device)
    on_views = x.is_cuda and hasattr(torch, "_grouped_mm")
    leaves = [x.detach().requires_grad_()] + [(w if on_views else w.float()).requires_grad_() for w in (w1, w2)]
    y_want = flatep.nn.grouped_ffn(*leaves, cu, activation)
    want = list(torch.autograd.grad(y_want, leaves, grad_y))
    if on_views:  # the eager path zeroes the rows' gradient past the last group end
        want[0] = want[0].masked_fill(torch.arange(rows, device=device).unsqueeze(1) >= cu[-1], 0)
    y, h, a = flatep.nn.ffn_forward(x, w1, w2, cu, activation, True)
    _close(y, y_want, f"{activation}: ffn_forward y", bitwise)
    got = flatep.nn.ffn_backward(grad_y, x, h, a, w1, w2, cu, activation, True, True, True)
    for name, a_, b_ in zip(("grad_x", "grad_w1", "grad_w2"), got, want):
        assert a_.dtype == b_.dtype, f"{activation}: {name} is {a_.dtype}, autograd's {b_.dtype}"
        _close(a_, b_, f"{activation}: {name}", bitwise)
    # Fewer gradients asked (a frozen projection, an input that needs none): the others are the same bits, the ones
    # not asked are None.
    for wants in itertools.product((False, True), repeat=3):
        part = flatep.nn.ffn_backward(grad_y, x, h, a, w1, w2, cu, activation, *wants)
        for name, wanted, p, full in zip(("grad_x", "grad_w1", "grad_w2"), wants, part, got):
            if wanted:
                assert torch.equal(_bits(p), _bits(full)), f"{activation}: {name} with wants {wants} differs"
            else:
                assert p is None, f"{activation}: {name} not asked (wants {wants}) but returned"
    y2, h2, a2 = flatep.nn.ffn_forward(x, w1, w2, cu, activation, False)  # forward only: nothing kept
    assert torch.equal(_bits(y2), _bits(y)) and h2.numel() == 0 and a2.numel() == 0


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_ffn_backward_equals_autograd_of_grouped_ffn(activation):
    _check_ffn_backward(activation, "cpu", [7, 7, 20, 33], 40, bitwise=True)  # an empty group, rows past the end


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_ffn_backward_close_to_autograd_of_grouped_ffn(activation):
    _check_ffn_backward(activation, torch.device("cuda", 0), [16, 16, 48, 64], 80, bitwise=False)


def test_compile_path_refusals_are_clear(monkeypatch):
    x = torch.randn(S, 128)
    fp8 = flatep.nn.MoE(128, F, E, K, num_tokens=S, fp8=True)
    lazy = flatep.nn.MoE(H, F, E, K)  # no num_tokens: the Buffer is made at the first call
    with monkeypatch.context() as patch:
        patch.setattr(ops, "compiling", lambda: True)  # what the methods see while torch.compile traces
        with pytest.raises(ValueError, match="fp8=True is not supported under torch.compile"):
            fp8(x)
        with pytest.raises(ValueError, match="num_tokens"):
            lazy(torch.randn(S, H))
        with pytest.raises(ValueError, match="num_tokens"):
            lazy.forward_microbatches([torch.randn(S, H)])
    assert lazy.buffer is None


def _check_compiled_moe(device, backend, bitwise, align):
    import torch._dynamo

    torch._dynamo.reset()
    model = _TwoLayer(device, align, seed=41)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for seed in (42, 43):
        x, gout = _model_inputs(seed, device)
        want = _model_step(model, model, x, gout)
        got = _model_step(model, compiled, x, gout)
        _check_same_step(got, want, bitwise, what=f"seed {seed}: ")
    with torch.no_grad():  # forward only: the experts keep nothing for backward
        x, gout = _model_inputs(44, device)
        want = model(x, gout)[0]
        _close(compiled(x, gout)[0], want, "no_grad out", bitwise)
    assert model.moe1.last_plan is None and model.moe1.last_plans == []  # no traced Plan is kept on the module
    x, gout = _model_inputs(45, device)
    explanation = torch._dynamo.explain(model)(x.requires_grad_(), gout)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    model.moe1.buffer.check_status()


def _check_compiled_microbatches(device, backend, bitwise, align):
    import torch._dynamo

    torch._dynamo.reset()
    moe = flatep.nn.MoE(H, F, E, K, num_tokens=S, align=align, seed=51, shared_ffn=F, device=device)

    def step(fn, xs, gouts):
        for p in moe.parameters():
            p.grad = None
        moe.zero_main_grad()
        xs = [x.detach().clone().requires_grad_() for x in xs]
        outs = fn(xs)
        sum((o * g).sum() for o, g in zip(outs, gouts)).backward()
        grads = [p.grad.clone() for p in moe.replicated_parameters()]
        return outs, grads + [moe.w1.main_grad.clone(), moe.w2.main_grad.clone()] + [x.grad for x in xs]

    (x0, g0), (x1, g1) = _model_inputs(52, device), _model_inputs(53, device)
    xs, gouts = [x0, x1[: S // 2]], [g0, g1[: S // 2]]
    want = step(moe.forward_microbatches, xs, gouts)
    got = step(torch.compile(moe.forward_microbatches, fullgraph=True, backend=backend), xs, gouts)
    for i, (a, b) in enumerate(zip(got[0] + got[1], want[0] + want[1])):
        _close(a, b, f"microbatches result {i}", bitwise)


@NEEDS_OPS
def test_cpu_compiled_moe_model_equals_eager_with_no_graph_break():
    _check_compiled_moe("cpu", "aot_eager", bitwise=True, align=MOE_ALIGN)


@NEEDS_OPS
def test_cpu_compiled_moe_microbatches_equal_eager():
    _check_compiled_microbatches("cpu", "aot_eager", bitwise=True, align=MOE_ALIGN)


@pytest.mark.cuda
@NEEDS_OPS
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_compiled_moe_model_close_to_eager_with_no_graph_break():
    _check_compiled_moe(torch.device("cuda", 0), "inductor", bitwise=False, align=16)


@pytest.mark.cuda
@NEEDS_OPS
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_compiled_moe_microbatches_close_to_eager():
    _check_compiled_microbatches(torch.device("cuda", 0), "inductor", bitwise=False, align=16)
