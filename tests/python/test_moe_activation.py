"""nn.MoE's expert activations (flatep.nn.ACTIVATIONS): 'swiglu' (the default: W1 [H, 2F] = gate and up fused,
columns [0, F) gate, [F, 2F) up; a = silu(x W1_gate) * (x W1_up); y = a W2) and 'silu' (y = silu(x W1) W2), each
against the dense reference (flatep.testing.DenseMoE with the same activation) forward and backward -- output, input
gradient, router gradient and both projections' main_grad -- on two virtual ranks of the CPU backend, with the bf16
tolerance of test_autograd_paths.py; the rounding points of expert_ffn written out; the grouped FFN's loop (and
torch._grouped_mm on a GPU) against it; shapes, defaults and bad arguments.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_moe_activation.py
"""

import pytest
import torch
import torch.nn.functional as F

import flatep
from flatep import testing, virtual
from flatep.nn import expert_ffn, grouped_ffn

R, S, H, FFN, E, K = 2, 24, 16, 12, 8, 2
BF16 = torch.bfloat16
BF16_TOL = 2.0**-6  # as test_autograd_paths.py / test_distributed.py: relative to the reference's largest magnitude


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max()).item()


def run_layer(activation, seed=4):
    """Two virtual ranks of MoE(activation) and the dense reference on the same inputs; both backward."""
    testing.release_all()
    ranks = virtual.virtual_ranks(R)
    moes = virtual.run_threads(
        R, lambda r: flatep.nn.MoE(H, FFN, E, K, group=ranks[r], num_tokens=S, align=1, seed=seed,
                                   activation=activation)
    )
    g = torch.Generator().manual_seed(3)
    x = torch.randn(R * S, H, generator=g)
    gout = torch.randn(R * S, H, generator=g)
    idx = [testing.sample_topk(E, S, K, r, sigma=1.5, seed=2).long() for r in range(R)]
    xs = [x[r * S:(r + 1) * S].clone().requires_grad_() for r in range(R)]
    outs = virtual.run_threads(R, lambda r: moes[r](xs[r], idx[r]))
    virtual.run_threads(R, lambda r: (outs[r].float() * gout[r * S:(r + 1) * S]).sum().backward())
    dense = testing.DenseMoE(H, FFN, E, K, seed=seed, activation=activation)
    xr = x.clone().requires_grad_()
    ref = dense(xr, torch.cat(idx), chunks=[S] * R)
    (ref.float() * gout).sum().backward()
    return moes, outs, xs, dense, ref, xr


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_layer_matches_dense_reference_forward_and_backward(activation):
    moes, outs, xs, dense, ref, xr = run_layer(activation)
    assert moes[0].last_plan.stats["replicas"] >= 1  # replicas' gradients come back through reduce_grad
    cols = 2 * FFN if activation == "swiglu" else FFN
    router_grad = sum(m.router.weight.grad for m in moes)  # replicated: the sum over ranks
    assert rel_err(router_grad, dense.router_weight.grad) < BF16_TOL, "router gradient"
    for r, m in enumerate(moes):
        lo, hi = r * (E // R), (r + 1) * (E // R)
        assert m.w1.shape == (E // R, H, cols) and m.w2.shape == (E // R, FFN, H)
        assert m.pools.projections == [(H, cols), (FFN, H)]
        assert rel_err(outs[r], ref[r * S:(r + 1) * S]) < BF16_TOL, f"rank {r}: out"
        assert rel_err(xs[r].grad, xr.grad[r * S:(r + 1) * S]) < BF16_TOL, f"rank {r}: grad x"
        assert rel_err(m.w1.main_grad, dense.w1.grad[lo:hi]) < BF16_TOL, f"rank {r}: w1 main_grad"
        assert rel_err(m.w2.main_grad, dense.w2.grad[lo:hi]) < BF16_TOL, f"rank {r}: w2 main_grad"
        assert m.w1.grad is None and m.w2.grad is None
    testing.release_all()


def test_the_two_activations_differ_and_swiglu_is_the_default():
    testing.release_all()
    default, silu = flatep.nn.MoE(H, FFN, E, K, seed=1), flatep.nn.MoE(H, FFN, E, K, seed=1, activation="silu")
    assert default.activation == "swiglu" and testing.DenseMoE(H, FFN, E, K).activation == "swiglu"
    assert default.w1.shape == (E, H, 2 * FFN) and silu.w1.shape == (E, H, FFN)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(default(x), silu(x))
    testing.release_all()


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_single_rank_layer_is_bitwise_the_dense_reference(activation):
    testing.release_all()
    moe = flatep.nn.MoE(H, FFN, E, K, align=8, seed=5, activation=activation)
    dense = testing.DenseMoE(H, FFN, E, K, seed=5, activation=activation)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(1))
    assert torch.equal(moe(x), dense(x))
    testing.release_all()


def test_swiglu_rounding_points_written_out():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, H, generator=g).to(BF16)
    w1 = (torch.randn(H, 2 * FFN, generator=g) / H**0.5).to(BF16)
    w2 = (torch.randn(FFN, H, generator=g) / FFN**0.5).to(BF16)
    h = (x.float() @ w1.float()).to(BF16)  # the GEMM's bf16 output of gate and up at once
    gate, up = h[:, :FFN].float(), h[:, FFN:].float()  # columns [0, F) gate, [F, 2F) up
    a = (F.silu(gate) * up).to(BF16)  # fp32, rounded once
    want = (a.float() @ w2.float()).to(BF16)
    assert torch.equal(expert_ffn(x, w1, w2), want)  # inferred from the shapes
    assert torch.equal(expert_ffn(x, w1, w2, "swiglu"), want)
    silu_want = ((F.silu((x.float() @ w1[:, :FFN].float()).to(BF16).float())).to(BF16).float() @ w2.float()).to(BF16)
    assert torch.equal(expert_ffn(x, w1[:, :FFN], w2, "silu"), silu_want)


def _grouped_inputs(activation, groups=6, rows=80, seed=0, ffn=16):  # torch._grouped_mm: rows of 16-byte multiples
    g = torch.Generator().manual_seed(seed)
    cols = 2 * ffn if activation == "swiglu" else ffn
    x = torch.randn(rows, H, generator=g).to(BF16)
    w1 = (torch.randn(groups, H, cols, generator=g) / H**0.5).to(BF16)
    w2 = (torch.randn(groups, ffn, H, generator=g) / ffn**0.5).to(BF16)
    cu = torch.tensor([16, 16, 40, 48, 64, 64], dtype=torch.int32)[:groups]  # empty groups 1 and 5, tail 64..80
    return x, w1, w2, cu


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_grouped_loop_matches_per_group_ffn(activation):
    x, w1, w2, cu = _grouped_inputs(activation)
    y = grouped_ffn(x, w1, w2, cu, activation)
    start = 0
    for g, end in enumerate(cu.tolist()):
        if end > start:
            assert torch.equal(y[start:end], expert_ffn(x[start:end], w1[g], w2[g], activation)), f"group {g}"
        start = end
    assert (y[64:] == 0).all()


@pytest.mark.cuda
@pytest.mark.skipif(
    not (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")), reason="needs CUDA and torch._grouped_mm"
)
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_grouped_mm_matches_loop(activation):
    x, w1, w2, cu = _grouped_inputs(activation)
    ref = grouped_ffn(x, w1, w2, cu, activation).float()
    dev = grouped_ffn(x.cuda(), w1.cuda(), w2.cuda(), cu.cuda(), activation).float().cpu()
    assert (dev - ref).abs().max().item() / ref.abs().max().item() <= BF16_TOL
    assert (dev[64:] == 0).all()


def test_bad_activation_and_mismatched_shapes():
    with pytest.raises(ValueError, match=r"^MoE: activation must be one of 'swiglu', 'silu', got 'gelu'$"):
        flatep.nn.MoE(H, FFN, E, K, activation="gelu")
    with pytest.raises(ValueError, match=r"^DenseMoE: activation must be one of 'swiglu', 'silu', got None$"):
        testing.DenseMoE(H, FFN, E, K, activation=None)
    x = torch.zeros(4, H, dtype=BF16)
    with pytest.raises(ValueError, match=r"^expert_ffn: w1 has 12 columns, but w2 has F=12 rows: w1 needs 24 "):
        expert_ffn(x, torch.zeros(H, FFN), torch.zeros(FFN, H), "swiglu")
    with pytest.raises(ValueError, match=r"^expert_ffn: w1 has 13 columns, but w2 has F=12 rows: w1 needs 24 \(swi"):
        expert_ffn(x, torch.zeros(H, FFN + 1), torch.zeros(FFN, H))
    testing.release_all()
    silu = flatep.nn.MoE(H, FFN, E, K, activation="silu")
    with pytest.raises(ValueError, match=r"^MoE: pools must have epn=8 and projections \[\(16, 24\), \(12, 16\)\]"):
        flatep.nn.MoE(H, FFN, E, K, pools=silu.pools)
    with pytest.raises(ValueError, match=r"^MoE.load_dense: the dense reference's activation is 'swiglu', this "):
        silu.load_dense(testing.DenseMoE(H, FFN, E, K))
    silu.load_dense(testing.DenseMoE(H, FFN, E, K, seed=9, activation="silu"))
    testing.release_all()
