"""The expert FFN over grouped receive rows (flatep.nn.grouped_ffn): the CPU loop against per-group expert_ffn, and
on a GPU with torch._grouped_mm against the loop (skipped without CUDA).

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_grouped.py
"""

import pytest
import torch

from flatep.nn import expert_ffn, grouped_ffn

BF16 = torch.bfloat16


def make(groups=6, rows=80, hidden=32, ffn=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(BF16)
    w1 = (torch.randn(groups, hidden, ffn, generator=g) / hidden**0.5).to(BF16)
    w2 = (torch.randn(groups, ffn, hidden, generator=g) / ffn**0.5).to(BF16)
    cu = torch.tensor([16, 16, 40, 48, 64, 64], dtype=torch.int32)[:groups]  # empty groups 1 and 5, tail 64..80
    return x, w1, w2, cu


def test_loop_matches_per_group_ffn():
    x, w1, w2, cu = make()
    y = grouped_ffn(x, w1, w2, cu)
    assert y.shape == x.shape and y.dtype == BF16
    start = 0
    for g, end in enumerate(cu.tolist()):
        if end > start:
            assert torch.equal(y[start:end], expert_ffn(x[start:end], w1[g], w2[g])), f"group {g}"
        start = end
    assert (y[64:] == 0).all()


@pytest.mark.cuda
@pytest.mark.skipif(
    not (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")), reason="needs CUDA and torch._grouped_mm"
)
def test_grouped_mm_matches_loop():
    x, w1, w2, cu = make()
    ref = grouped_ffn(x, w1, w2, cu).float()
    dev = grouped_ffn(x.cuda(), w1.cuda(), w2.cuda(), cu.cuda()).float().cpu()
    err = (dev - ref).abs().max().item() / ref.abs().max().item()
    assert err <= 2**-6, f"relative error {err}"
    assert (dev[64:] == 0).all()


@pytest.mark.cuda
@pytest.mark.skipif(
    not (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")), reason="needs CUDA and torch._grouped_mm"
)
def test_grouped_mm_autograd_matches_loop():
    """Under autograd on the GPU (the rows past the last group end zeroed in place in y, their gradient masked):
    y past the end is zero and the weight and row gradients are the loop's (rows past the end get none)."""
    x, w1, w2, cu = make(seed=4)
    g = torch.Generator().manual_seed(9)
    grad_y = torch.randn(x.shape, generator=g).to(BF16)
    grads = []
    for dev in ("cpu", "cuda"):
        leaves = [t.to(dev).float().requires_grad_() if dev == "cpu" else t.to(dev).requires_grad_()
                  for t in (x, w1, w2)]
        y = grouped_ffn(*leaves, cu.to(dev))
        assert (y[64:] == 0).all(), dev
        y.backward(grad_y.to(dev).to(y.dtype))
        grads.append([t.grad.float().cpu() for t in leaves])
    for name, ref, got in zip(("x", "w1", "w2"), *grads):
        ref, got = (ref[:64], got[:64]) if name == "x" else (ref, got)
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err <= 2**-5, f"{name}: relative error {err}"


def test_the_serving_kernels_rule_is_whether_autograd_records():
    """On the GPU grouped_ffn takes the bounded serving kernels (activate_rows, zero_rows_from_end: no autograd
    formula) only when autograd records nothing; its rule (flatep.ffn._records_grad, computed on the host) must be
    torch's own: whether an op on the three tensors gives a result that requires grad, in every grad mode and for
    every set of tensors requiring grad (a wrong rule takes the kernels under training: no gradient, or the torch ops
    under serving: work bounded by the capacity)."""
    import itertools

    from flatep import ffn

    for flags in itertools.product((False, True), repeat=3):
        ts = [torch.ones(2, 2, requires_grad=f) for f in flags]
        for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
            with mode():
                recorded = (ts[0] + ts[1] + ts[2]).requires_grad
                assert ffn._records_grad(*ts) is recorded, (flags, mode.__name__)
                assert recorded == (any(flags) and mode is torch.enable_grad)
