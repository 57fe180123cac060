"""flatep.ffn's row kernels (activate_rows, zero_rows_from_end) where no GPU is needed: their argument checks raise
one-line ValueErrors naming the argument and the value before anything touches a device (so they run on any
machine), the address of cu_seqlens' last element that the kernels read, and grouped_ffn on the CPU (the loop over
groups, which never calls the kernels, with autograd recording or not). The kernels themselves:
tests/python/test_gpu_ffn_rows.py.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_ffn_rows.py
"""

import pytest
import torch

from flatep import ffn

BF16 = torch.bfloat16


@pytest.fixture
def no_device(monkeypatch):
    """Fails a test that gets past the checks: the stream lookup and both C++ entry points raise AssertionError."""

    def refuse(*args, **kwargs):
        raise AssertionError("an argument check let a bad call reach the device")

    monkeypatch.setattr(ffn, "stream_handle", refuse)
    monkeypatch.setattr(ffn, "device_guard", refuse)
    for name in ("activate_rows", "zero_rows_from_end"):
        monkeypatch.setattr(ffn._C, name, refuse, raising=False)


def raises_one_line(call, message):
    with pytest.raises(ValueError) as info:
        call()
    text = str(info.value)
    assert text == message, text
    assert "\n" not in text


H = torch.zeros(4, 16, dtype=BF16)  # swiglu: F = 8
CU = torch.tensor([1, 3], dtype=torch.int32)

ACTIVATE_CASES = {
    "h not a tensor": (lambda: ffn.activate_rows([[0.0]], CU, "silu"),
                       "activate_rows: h must be a torch.Tensor, got list"),
    "h float32": (lambda: ffn.activate_rows(H.float(), CU, "swiglu"), "activate_rows: h must be bfloat16, got float32"),
    "h 1-D": (lambda: ffn.activate_rows(H[0], CU, "silu"), "activate_rows: h must be 2-D, got shape [16]"),
    "h not contiguous": (lambda: ffn.activate_rows(H.t().contiguous().t(), CU, "swiglu"),
                         "activate_rows: h must be contiguous (row-major), got strides (1, 4) for shape [4, 16]"),
    "swiglu h of odd columns": (
        lambda: ffn.activate_rows(H[:, :15].contiguous(), CU, "swiglu"),
        "activate_rows: h must have an even number >= 2 of columns (2F: gate, then up) for swiglu, got shape [4, 15]"),
    "silu h of no columns": (lambda: ffn.activate_rows(H[:, :0], CU, "silu"),
                             "activate_rows: h must have a column or more (F) for silu, got shape [4, 0]"),
    "activation gelu": (lambda: ffn.activate_rows(H, CU, "gelu"),
                        "activate_rows: activation must be one of 'swiglu', 'silu', got 'gelu'"),
    "out of the wrong shape": (lambda: ffn.activate_rows(H, CU, "swiglu", out=torch.zeros(4, 16, dtype=BF16)),
                               "activate_rows: out must have shape [4, 8] ([n, F] for h of shape [4, 16]), got "
                               "[4, 16]"),
    "out float32": (lambda: ffn.activate_rows(H, CU, "swiglu", out=torch.zeros(4, 8)),
                    "activate_rows: out must be bfloat16, got float32"),
    "zero_past_end not a bool": (lambda: ffn.activate_rows(H, CU, "silu", zero_past_end=0),
                                 "activate_rows: zero_past_end must be a bool, got 0"),
    "out not contiguous": (lambda: ffn.activate_rows(H, CU, "silu", out=H.t().contiguous().t()),
                           "activate_rows: out must be contiguous (row-major), got strides (1, 4) for shape [4, 16]"),
    "cu_seqlens int64": (lambda: ffn.activate_rows(H, CU.long(), "swiglu"),
                         "activate_rows: cu_seqlens must be int32, got int64"),
    "cu_seqlens empty": (lambda: ffn.activate_rows(H, CU[:0], "swiglu"),
                         "activate_rows: cu_seqlens must be 1-D with at least one group end, got shape [0]"),
    "h on the CPU": (lambda: ffn.activate_rows(H, CU, "swiglu"), "activate_rows: h must be on a CUDA device, got cpu"),
    "h on meta": (lambda: ffn.activate_rows(H.to("meta"), CU.to("meta"), "silu"),
                  "activate_rows: h must be on a CUDA device, got meta"),
}

ZERO_CASES = {
    "y not a tensor": (lambda: ffn.zero_rows_from_end(None, CU), "zero_rows_from_end: y must be a torch.Tensor, got "
                       "NoneType"),
    "cu_seqlens not a tensor": (lambda: ffn.zero_rows_from_end(H, [3]),
                                "zero_rows_from_end: cu_seqlens must be a torch.Tensor, got list"),
    "y float32": (lambda: ffn.zero_rows_from_end(H.float(), CU), "zero_rows_from_end: y must be bfloat16, got float32"),
    "y 3-D": (lambda: ffn.zero_rows_from_end(H.view(2, 2, 16), CU),
              "zero_rows_from_end: y must be 2-D, got shape [2, 2, 16]"),
    "y not contiguous": (lambda: ffn.zero_rows_from_end(H[:, ::2], CU),
                         "zero_rows_from_end: y must be contiguous (row-major), got strides (16, 2) for shape [4, 8]"),
    "cu_seqlens 2-D": (lambda: ffn.zero_rows_from_end(H, CU.view(1, 2)),
                       "zero_rows_from_end: cu_seqlens must be 1-D with at least one group end, got shape [1, 2]"),
    "y on the CPU": (lambda: ffn.zero_rows_from_end(H, CU), "zero_rows_from_end: y must be on a CUDA device, got cpu"),
}


@pytest.mark.parametrize("case", sorted(ACTIVATE_CASES))
def test_activate_rows_checks_raise_one_line_value_errors(case, no_device):
    raises_one_line(*ACTIVATE_CASES[case])


@pytest.mark.parametrize("case", sorted(ZERO_CASES))
def test_zero_rows_from_end_checks_raise_one_line_value_errors(case, no_device):
    raises_one_line(*ZERO_CASES[case])


def test_the_kernels_read_the_last_group_end():
    cu = torch.arange(10, dtype=torch.int32)
    assert ffn._end_address(cu) == cu[-1:].data_ptr()
    strided = cu[::3]  # 0, 3, 6, 9: not contiguous, the last element still found
    assert ffn._end_address(strided) == cu[9:].data_ptr()


def make(activation, groups=5, rows=40, hidden=16, ffn_size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    cols = 2 * ffn_size if activation == "swiglu" else ffn_size
    x = torch.randn(rows, hidden, generator=g).to(BF16)
    w1 = (torch.randn(groups, hidden, cols, generator=g) / hidden**0.5).to(BF16)
    w2 = (torch.randn(groups, ffn_size, hidden, generator=g) / ffn_size**0.5).to(BF16)
    cu = torch.tensor([6, 6, 15, 20, 27], dtype=torch.int32)[:groups]  # an empty group, rows 27..40 past the end
    return x, w1, w2, cu


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_grouped_ffn_on_the_cpu_is_the_loop_and_calls_no_kernel(activation, no_device, monkeypatch):
    for name in ("activate_rows", "zero_rows_from_end"):
        monkeypatch.setattr(ffn, name, lambda *a, **k: pytest.fail("grouped_ffn called a CUDA kernel on the CPU"))
    x, w1, w2, cu = make(activation)
    with torch.no_grad():
        y = ffn.grouped_ffn(x, w1, w2, cu, activation)
    assert y.shape == x.shape and y.dtype == BF16
    start = 0
    for g, end in enumerate(cu.tolist()):
        if end > start:
            assert torch.equal(y[start:end], ffn.expert_ffn(x[start:end], w1[g], w2[g], activation)), f"group {g}"
        start = end
    assert (y[27:] == 0).all()
    leaves = [t.float().requires_grad_() for t in (x, w1, w2)]  # autograd through the loop, as nn.MoE trains
    y_grad = ffn.grouped_ffn(*leaves, cu, activation)
    assert torch.equal(y_grad.detach(), y)
    y_grad.float().sum().backward()
    assert all(t.grad is not None for t in leaves)


def test_grouped_ffn_refuses_a_zero_past_end_that_is_not_a_bool(no_device):
    x, w1, w2, cu = make("swiglu")
    raises_one_line(lambda: ffn.grouped_ffn(x, w1, w2, cu, "swiglu", zero_past_end=1),
                    "grouped_ffn: zero_past_end must be a bool, got 1")


@pytest.mark.parametrize("planner", ["owner", "balanced"])
def test_serving_experts_leaves_the_rows_past_the_end_to_combine(planner, monkeypatch):
    """serving_experts (nn.MoE's inference FFN) asks grouped_ffn not to zero y past the last group end: combine reads
    only the plan's real rows, and with the owner planner most of y is past the end. It pulls the slots first unless
    the planner is the owner."""
    from types import SimpleNamespace

    from flatep import serving

    x, w1, w2, cu = make("swiglu")
    calls = []
    monkeypatch.setattr(serving, "grouped_ffn", lambda *a, **k: calls.append(("ffn", a[3], a[4], k)) or a[0])
    pools = SimpleNamespace(serving=True, prefetch=lambda plan, layer, **k: calls.append(("prefetch", k)))
    layer = SimpleNamespace(weights=lambda i: (w1, w2)[i])
    plan = SimpleNamespace(_buffer=SimpleNamespace(planner=planner), cu_seqlens=cu)
    assert serving.serving_experts(pools, layer, plan, x, "swiglu") is x
    ffn_call = ("ffn", cu, "swiglu", {"zero_past_end": False})
    assert calls == ([ffn_call] if planner == "owner" else [("prefetch", {"plan_ordered": True}), ffn_call])
