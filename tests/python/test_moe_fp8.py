"""nn.MoE(fp8=True): FP8 dispatch (e4m3 rows, one fp32 scale per 128 channels), receive rows dequantised to bf16,
expert FFN and all of backward in bf16. Two virtual ranks of the CPU backend, both activations:

* Semantics, at the bf16 tolerance of test_autograd_paths.py (2^-6 of the reference's largest magnitude): the layer
  equals flatep.testing.DenseMoE(fp8=True), whose expert inputs are the FP8 round trip of the bf16 token rows
  (flatep.fp8's rule) with the gradient passed straight through -- output, input gradient, router gradient and both
  projections' main_grad.
* Accuracy against the bf16 reference (DenseMoE(fp8=False)): relative L2 error ||fp8 - ref|| / ||ref|| of the output
  and of every gradient at most FP8_TOL = 2^-3. Why: e4m3 keeps 3 fraction bits, so rounding a value in e4m3's normal
  range to nearest changes it by at most 2^-4 of itself (values below 2^-6 * scale, e4m3's subnormals, by at most
  2^-10 * scale, and the scale is the block's amax / 448, so those are at most 2^-10 / 448 of the block's largest
  value): the expert input's relative L2 error is at most 2^-4. The expert FFN and the gradients are, to first order,
  homogeneous of degree at most 2 in that input (SwiGLU multiplies two projections of it; the weight gradients are a
  product of the input and a gradient that depends on it; the router gradient is <grad_out, y>), so their relative
  error is at most about 2 * 2^-4 = 2^-3. Measured here: 0.030-0.039 (swiglu), 0.019-0.030 (silu); the bf16 layer's own
  error against the same reference is ~2.5e-3, and the test checks the FP8 error is larger (the rows did move as FP8).
* The forward moves the rows with one FP8 dispatch and no bf16 dispatch; backward sends the row gradient through one
  unweighted combine and the weights' through entry_values; H % 128 != 0 and non-bools are refused.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_moe_fp8.py
"""

import pytest
import torch

import flatep
from flatep import fp8 as fp8_rule
from flatep import testing, virtual
from flatep.nn import dequantize_rows

R, S, H, FFN, E, K = 2, 24, 256, 32, 8, 2
BF16_TOL = 2.0**-6
FP8_TOL = 2.0**-3


def max_rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max()).item()


def rel_l2(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm()).item()


def build(activation, fp8=True, seed=4):
    testing.release_all()
    ranks = virtual.virtual_ranks(R)
    return virtual.run_threads(
        R, lambda r: flatep.nn.MoE(H, FFN, E, K, group=ranks[r], num_tokens=S, align=1, seed=seed,
                                   activation=activation, fp8=fp8)
    )


def inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(R * S, H, generator=g)
    gout = torch.randn(R * S, H, generator=g)
    idx = [testing.sample_topk(E, S, K, r, sigma=1.5, seed=2).long() for r in range(R)]
    return x, gout, idx


def layer_step(moes, x, gout, idx):
    """Forward + backward on every rank; returns (out, grad_x, router grad summed over ranks, [w1 main_grad],
    [w2 main_grad]) with the rank pieces concatenated in expert order."""
    xs = [x[r * S:(r + 1) * S].clone().requires_grad_() for r in range(R)]
    outs = virtual.run_threads(R, lambda r: moes[r](xs[r], idx[r]))
    virtual.run_threads(R, lambda r: (outs[r].float() * gout[r * S:(r + 1) * S]).sum().backward())
    return (torch.cat([o.detach() for o in outs]), torch.cat([v.grad for v in xs]),
            sum(m.router.weight.grad for m in moes), torch.cat([m.w1.main_grad for m in moes]),
            torch.cat([m.w2.main_grad for m in moes]))


def dense_step(activation, fp8, x, gout, idx, seed=4):
    dense = testing.DenseMoE(H, FFN, E, K, seed=seed, activation=activation, fp8=fp8)
    xr = x.clone().requires_grad_()
    ref = dense(xr, torch.cat(idx), chunks=[S] * R)
    (ref.float() * gout).sum().backward()
    return ref.detach(), xr.grad, dense.router_weight.grad, dense.w1.grad, dense.w2.grad


NAMES = ("out", "grad_x", "grad_router", "grad_w1", "grad_w2")


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_fp8_layer_is_the_fp8_dense_reference_and_within_fp8_tolerance_of_bf16(activation):
    x, gout, idx = inputs()
    moes = build(activation, fp8=True)
    assert moes[0].fp8 and all(m.activation == activation for m in moes)
    got = layer_step(moes, x, gout, idx)
    assert moes[0].last_plan.stats["replicas"] >= 1
    assert any((p.entry_ranks != r).any() for r, p in enumerate(m.last_plan for m in moes)), "no entry crosses ranks"
    same_rule = dense_step(activation, True, x, gout, idx)
    bf16_ref = dense_step(activation, False, x, gout, idx)
    for name, a, b in zip(NAMES, got, same_rule):
        assert max_rel(a, b) < BF16_TOL, f"{name}: {max_rel(a, b):.3g} from DenseMoE(fp8=True)"
    bf16_layer = layer_step(build(activation, fp8=False), x, gout, idx)
    for name, a, b, c in zip(NAMES, got, bf16_ref, bf16_layer):
        err, bf16_err = rel_l2(a, b), rel_l2(c, b)
        assert err <= FP8_TOL, f"{name}: relative L2 error {err:.3g} against the bf16 reference > {FP8_TOL}"
        assert err > 2 * bf16_err, f"{name}: FP8 error {err:.3g} is no larger than bf16's {bf16_err:.3g}"
    testing.release_all()


def test_fp8_forward_moves_fp8_rows_and_backward_is_bf16(monkeypatch):
    x, gout, idx = inputs()
    moes = build("swiglu", fp8=True)
    record = [[] for _ in range(R)]
    for r, m in enumerate(moes):
        for name in ("dispatch", "dispatch_region", "dispatch_fp8", "combine", "entry_values", "combine_grad"):
            attr = f"_{name}_raw"
            fn = getattr(m.buffer, attr)
            monkeypatch.setattr(m.buffer, attr, lambda *a, _fn=fn, _n=name, _r=r, **k: (record[_r].append(_n),
                                                                                      _fn(*a, **k))[1])
    xs = [x[r * S:(r + 1) * S].clone().requires_grad_() for r in range(R)]
    outs = virtual.run_threads(R, lambda r: moes[r](xs[r], idx[r]))
    assert all(rec == ["dispatch_fp8", "combine"] for rec in record), record
    for rec in record:
        rec.clear()
    virtual.run_threads(R, lambda r: (outs[r].float() * gout[r * S:(r + 1) * S]).sum().backward())
    # combine's backward (bf16 dispatch of grad_out into the receive region, combine_grad), then the fp8 node's: row
    # grads through an unweighted bf16 combine, the weights' through entry_values.
    assert all(rec == ["dispatch_region", "combine_grad", "combine", "entry_values"] for rec in record), record
    testing.release_all()


def test_dequantize_rows_is_the_rule_bitwise():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, H, generator=g) * torch.logspace(-30, 30, 40).unsqueeze(1)).to(torch.bfloat16)
    x[3, 5], x[4, :128] = float("nan"), 0
    q, s = fp8_rule.quantize(x)
    want = fp8_rule.dequantize(q, s, torch.bfloat16)
    assert torch.equal(dequantize_rows(fp8_rule.as_bytes(q), s).view(torch.int16), want.view(torch.int16))
    if fp8_rule.E4M3_DTYPE is not None:  # the float8 path (elementwise, no table)
        got = dequantize_rows(fp8_rule.as_e4m3(fp8_rule.as_bytes(q)), s)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp8_option_errors_and_switching():
    testing.release_all()
    with pytest.raises(ValueError, match=r"^MoE: fp8=True needs hidden \(H\) to be a multiple of 128 \(one scale per "
                                         r"128 channels\), got H=64$"):
        flatep.nn.MoE(64, FFN, E, K, fp8=True)
    with pytest.raises(ValueError, match=r"^MoE: fp8 must be a bool, got 1$"):
        flatep.nn.MoE(H, FFN, E, K, fp8=1)
    moe = flatep.nn.MoE(64, FFN, E, K)
    with pytest.raises(ValueError, match=r"^MoE: fp8=True needs hidden"):
        moe.fp8 = True
    assert moe.fp8 is False
    with pytest.raises(ValueError, match=r"^DenseMoE: fp8 must be a bool, and fp8=True needs H % 128 == 0"):
        testing.DenseMoE(64, FFN, E, K, fp8=True)
    testing.release_all()
    moe = flatep.nn.MoE(H, FFN, E, K, seed=2)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(1))
    bf16 = moe(x)
    moe.fp8 = True  # read at every forward
    assert torch.equal(moe(x), testing.DenseMoE(H, FFN, E, K, seed=2, fp8=True)(x))
    assert not torch.equal(moe(x), bf16)
    testing.release_all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or fp8_rule.E4M3_DTYPE is None, reason="needs CUDA and float8")
def test_dequantize_rows_on_the_gpu_is_the_rule_bitwise():
    """Both device paths (the Triton kernel where Triton is installed, the torch ops otherwise) against the CPU rule;
    NaN positions compared as positions (a NaN's payload bits may differ)."""
    import flatep.nn as nn_module

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 512, generator=g) * torch.logspace(-38, 38, 300).unsqueeze(1)).to(torch.bfloat16)
    x[7, 9], x[8, :128] = float("nan"), 0
    q, s = fp8_rule.quantize(x)
    want = fp8_rule.dequantize(q, s, torch.bfloat16)
    triton_fn = nn_module._triton_dequantize()
    paths = [("torch ops", None)] + ([("triton", triton_fn)] if triton_fn else [])
    for name, fn in paths:
        saved = nn_module._triton_dequantize
        nn_module._triton_dequantize = lambda fn=fn: fn
        try:
            got = dequantize_rows(fp8_rule.as_e4m3(q).cuda(), s.cuda()).cpu()
        finally:
            nn_module._triton_dequantize = saved
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), name
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), name


CUDA_SKIP = None if torch.cuda.is_available() and flatep._C.has_cuda else "needs CUDA and FlatEP built with CUDA"


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=str(CUDA_SKIP))
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_fp8_layer_on_the_gpu(activation):
    """One rank on cuda:0 (torch._grouped_mm, the device's FP8 dispatch and dequantisation) against the CPU dense
    references: DenseMoE(fp8=True) at the bf16 tolerance, DenseMoE(fp8=False) at FP8_TOL."""
    testing.release_all()
    n, seed = 64, 7
    moe = flatep.nn.MoE(H, FFN, E, K, num_tokens=n, seed=seed, device="cuda", activation=activation, fp8=True)
    g = torch.Generator().manual_seed(5)
    x, gout = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
    idx = testing.sample_topk(E, n, K, 0, sigma=1.0, seed=5).long()
    xd = x.cuda().requires_grad_()
    out = moe(xd, idx.cuda())
    (out.float() * gout.cuda()).sum().backward()
    got = (out, xd.grad, moe.router.weight.grad, moe.w1.main_grad, moe.w2.main_grad)
    for fp8, check in ((True, lambda a, b: max_rel(a, b) < BF16_TOL), (False, lambda a, b: rel_l2(a, b) <= FP8_TOL)):
        dense = testing.DenseMoE(H, FFN, E, K, seed=seed, activation=activation, fp8=fp8)
        xr = x.clone().requires_grad_()
        ref = dense(xr, idx)
        (ref.float() * gout).sum().backward()
        for name, a, b in zip(NAMES, got, (ref, xr.grad, dense.router_weight.grad, dense.w1.grad, dense.w2.grad)):
            assert check(a.cpu(), b), f"{name} against DenseMoE(fp8={fp8}): {max_rel(a.cpu(), b):.3g} max, " \
                                      f"{rel_l2(a.cpu(), b):.3g} L2"
    testing.release_all()
