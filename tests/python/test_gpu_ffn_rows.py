"""The expert FFN's row kernels on a GPU (flatep.ffn.activate_rows and zero_rows_from_end: CUDA kernels that read the
last group end on the device) and grouped_ffn's use of them where autograd records nothing (serving).

* activate_rows: for swiglu and silu, F = 8 (16-byte path), 1536 (16-byte path, a decode-sized FFN) and 13 (element
  path), and ends 0, 1, n//3 and n: the rows below the end bitwise equal to flatep.ffn.activate(h[:end]) (the torch
  ops: fp32 silu, multiply, .to(bfloat16)) on h with |values| up to 30, negatives, exact zeros of both signs and tiny
  values; the rows past the end exactly +0.0 although the output was filled with NaN. Also the element path on
  unaligned pointers, an end outside [0, n] (clamped) and n = 0.
* zero_rows_from_end: the rows past the end +0.0, the rows below it untouched (NaN rows included), for H = 8, 13 and
  1536.
* grouped_ffn under torch.no_grad() / torch.inference_mode() (the kernels) bitwise equal on every row to the same
  call that autograd records (the torch ops), and a CUDA graph of it replayed after cu_seqlens changed in place
  gives the eager result of the new cu_seqlens; with zero_past_end=False the same bits below the end and no zeroing.
* Bad arguments (dtype, a CPU tensor, non-contiguous, shapes) raise a one-line ValueError naming the argument.

Skipped without a GPU or without FlatEP's CUDA build (flatep._C.has_cuda); the grouped_ffn cases also need
torch._grouped_mm.

Reproduce: PYTHONPATH=python:build-cuda/python python3 -m pytest -q -m cuda tests/python/test_gpu_ffn_rows.py
"""

import pytest
import torch

import mp_cases
from flatep import ffn

BF16 = torch.bfloat16
CUDA_SKIP = mp_cases.cuda_unavailable_reason()
cuda_only = pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
grouped_mm_only = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                     reason=f"torch {torch.__version__} has no _grouped_mm")
N = 48  # rows of the kernel cases: ends 0, 1, 16, 48


def bits(t):
    return t.contiguous().view(torch.int16)


def make_h(rows, cols, seed):
    """bf16 [rows, cols] on the GPU: normal values of scale 6, 10% uniform in [-30, 30], exact +-30, exact zeros
    (+0.0 and -0.0) and tiny values (1e-30, a bf16 subnormal)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, cols, generator=g) * 6
    pick = lambda p: torch.rand(rows, cols, generator=g) < p  # noqa: E731
    big = pick(0.1)
    h[big] = torch.rand(int(big.sum()), generator=g) * 60 - 30
    h = h.clamp(-30, 30)
    h[pick(0.01)] = 30.0
    h[pick(0.01)] = -30.0
    h[pick(0.03)] = 0.0
    h[pick(0.03)] = -0.0
    h[pick(0.01)] = 1e-30
    h[pick(0.01)] = -1e-39  # bf16 subnormal
    return h.to(BF16).cuda()


def ends_of(end):
    """cu_seqlens (int32, on the GPU) with a few groups whose last end is `end`."""
    return torch.tensor([end // 3, end // 2, end // 2, end], dtype=torch.int32, device="cuda")


def end_cases(n):
    return sorted({0, 1, n // 3, n})


def check_activated(out, h, end, activation):
    torch.cuda.synchronize()
    n = h.shape[0]
    want = ffn.activate(h[:end], activation)
    assert torch.equal(bits(out[:end]), bits(want)), f"rows below end={end} differ from flatep.ffn.activate"
    assert (bits(out[end:]) == 0).all(), f"rows [{end}, {n}) must be +0.0"


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
@pytest.mark.parametrize("ffn_size", [8, 1536, 13])
@pytest.mark.parametrize("end", end_cases(N))
def test_activate_rows_bitwise_below_the_end_zero_past_it(activation, ffn_size, end):
    cols = 2 * ffn_size if activation == "swiglu" else ffn_size
    h = make_h(N, cols, seed=ffn_size * 10 + end)
    out = torch.full((N, ffn_size), float("nan"), dtype=BF16, device="cuda")
    got = ffn.activate_rows(h, ends_of(end), activation, out=out)
    assert got is out
    check_activated(out, h, end, activation)
    fresh = ffn.activate_rows(h, ends_of(end), activation)  # out=None: a new tensor
    assert fresh.shape == (N, ffn_size) and fresh.dtype == BF16 and fresh.is_contiguous()
    check_activated(fresh, h, end, activation)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
@pytest.mark.parametrize("ffn_size", [8, 13])  # the 16-byte and the element kernel
@pytest.mark.parametrize("end", end_cases(N))
def test_activate_rows_leaves_the_rows_past_the_end_untouched_when_asked(activation, ffn_size, end):
    """zero_past_end=False (the serving FFN: the second grouped GEMM reads no row past the end): the same bits below
    the end, and the rows past it keep whatever they held (here NaN: no store reached them)."""
    cols = 2 * ffn_size if activation == "swiglu" else ffn_size
    h = make_h(N, cols, seed=ffn_size * 7 + end)
    out = torch.full((N, ffn_size), float("nan"), dtype=BF16, device="cuda")
    ffn.activate_rows(h, ends_of(end), activation, out=out, zero_past_end=False)
    torch.cuda.synchronize()
    assert torch.equal(bits(out[:end]), bits(ffn.activate(h[:end], activation))), f"rows below end={end} differ"
    assert torch.isnan(out[end:].float()).all(), f"a row in [{end}, {N}) was written"


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_activate_rows_unaligned_pointers_take_the_element_path(activation):
    ffn_size, cols = 8, (16 if activation == "swiglu" else 8)
    h_full = make_h(1, N * cols + 1, seed=5).view(-1)
    h = h_full[1:].view(N, cols)  # contiguous, 2 bytes past a 16-byte boundary
    out_full = torch.full((N * ffn_size + 1,), float("nan"), dtype=BF16, device="cuda")
    out = out_full[1:].view(N, ffn_size)
    assert h.data_ptr() % 16 and out.data_ptr() % 16
    ffn.activate_rows(h, ends_of(N // 3), activation, out=out)
    check_activated(out, h, N // 3, activation)
    assert torch.isnan(out_full[:1].float()).all(), "the element before out was written"


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_activate_rows_clamps_the_end_and_takes_no_rows(activation):
    ffn_size = 16
    cols = 2 * ffn_size if activation == "swiglu" else ffn_size
    h = make_h(N, cols, seed=7)
    out = ffn.activate_rows(h, torch.tensor([3, N + 7], dtype=torch.int32, device="cuda"), activation)
    check_activated(out, h, N, activation)  # an end past n: every row
    out = torch.full((N, ffn_size), float("nan"), dtype=BF16, device="cuda")
    ffn.activate_rows(h, torch.tensor([-3], dtype=torch.int32, device="cuda"), activation, out=out)
    check_activated(out, h, 0, activation)  # a negative end: no row
    empty = ffn.activate_rows(h[:0], ends_of(0), activation)
    torch.cuda.synchronize()
    assert empty.shape == (0, ffn_size)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("hidden", [8, 13, 1536])
@pytest.mark.parametrize("end", end_cases(N) + [N + 5])
def test_zero_rows_from_end(hidden, end):
    y = make_h(N, hidden, seed=hidden + end)
    y[1] = float("nan")  # a row below the end keeps even NaN bits
    before = y.clone()
    assert ffn.zero_rows_from_end(y, ends_of(end)) is y
    torch.cuda.synchronize()
    keep = min(end, N)
    assert torch.equal(bits(y[:keep]), bits(before[:keep])), "rows below the end must be untouched"
    assert (bits(y[keep:]) == 0).all(), "rows past the end must be +0.0"
    ffn.zero_rows_from_end(y[:0], ends_of(end))  # no rows: nothing launched
    torch.cuda.synchronize()


def grouped_case(activation, groups=6, rows=256, hidden=64, ffn_size=96, seed=0):
    """x [rows, H], w1, w2 bf16 on the GPU and cu_seqlens with empty groups whose last end (80) is well below rows
    (NvS ~3x the real rows, as the owner planner's capacity is)."""
    g = torch.Generator().manual_seed(seed)
    cols = 2 * ffn_size if activation == "swiglu" else ffn_size
    x = (torch.randn(rows, hidden, generator=g) * 2).to(BF16)
    w1 = (torch.randn(groups, hidden, cols, generator=g) / hidden**0.5).to(BF16)
    w2 = (torch.randn(groups, ffn_size, hidden, generator=g) / ffn_size**0.5).to(BF16)
    cu = torch.tensor([16, 16, 40, 48, 80, 80], dtype=torch.int32)[:groups]
    return [t.cuda() for t in (x, w1, w2, cu)]


def torch_ops_ffn(x, w1, w2, cu, activation):
    """grouped_ffn as autograd records it (the torch ops: activate, masked_fill), detached."""
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        return ffn.grouped_ffn(leaf, w1, w2, cu, activation).detach()


class Calls(list):
    """The kernels' names in call order; .keywords: each call's keyword arguments."""

    keywords = None


def count_kernel_calls(monkeypatch):
    calls = Calls()
    calls.keywords = []

    def spy(*a, _real, _name, **k):
        calls.append(_name)
        calls.keywords.append(k)
        return _real(*a, **k)

    for name in ("activate_rows", "zero_rows_from_end"):
        monkeypatch.setattr(ffn, name, lambda *a, _real=getattr(ffn, name), _name=name, **k: spy(
            *a, _real=_real, _name=_name, **k))
    return calls


@pytest.mark.cuda
@cuda_only
@grouped_mm_only
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_grouped_ffn_kernels_bitwise_equal_the_torch_ops(activation, mode, monkeypatch):
    x, w1, w2, cu = grouped_case(activation, seed=3)
    calls = count_kernel_calls(monkeypatch)
    want = torch_ops_ffn(x, w1, w2, cu, activation)
    assert calls == [], "the autograd path must keep the torch ops"
    with (torch.no_grad() if mode == "no_grad" else torch.inference_mode()):
        got = ffn.grouped_ffn(x, w1, w2, cu, activation)
    assert calls == ["activate_rows", "zero_rows_from_end"]
    torch.cuda.synchronize()
    assert torch.equal(bits(got), bits(want)), "grouped_ffn with the kernels differs from the torch ops"
    assert (bits(got[80:]) == 0).all()
    # Weights that require grad, outside no_grad: autograd records, so the torch ops run.
    with torch.enable_grad():
        y = ffn.grouped_ffn(x, w1.detach().requires_grad_(), w2, cu, activation)
    assert y.requires_grad and calls == ["activate_rows", "zero_rows_from_end"]


@pytest.mark.cuda
@cuda_only
@grouped_mm_only
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_grouped_ffn_without_zeroing_is_bitwise_below_the_end(activation, monkeypatch):
    """zero_past_end=False (serving_experts: combine reads only real rows): the same bits below the end, no
    zero_rows_from_end; where autograd records, the rows past the end are zero all the same (the torch ops)."""
    x, w1, w2, cu = grouped_case(activation, seed=4)
    want = torch_ops_ffn(x, w1, w2, cu, activation)
    calls = count_kernel_calls(monkeypatch)
    with torch.inference_mode():
        got = ffn.grouped_ffn(x, w1, w2, cu, activation, zero_past_end=False)
    assert calls == ["activate_rows"], "zero_past_end=False must not zero y"
    assert calls.keywords[0].get("zero_past_end") is False, "nor store zeros past the end of the activation"
    torch.cuda.synchronize()
    assert torch.equal(bits(got[:80]), bits(want[:80])), "rows below the end differ"
    with torch.enable_grad():
        y = ffn.grouped_ffn(x.detach().requires_grad_(), w1, w2, cu, activation, zero_past_end=False)
    torch.cuda.synchronize()
    assert torch.equal(bits(y.detach()), bits(want)), "under autograd every row, zeros past the end included"


@pytest.mark.cuda
@cuda_only
@grouped_mm_only
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_grouped_ffn_graph_replay_reads_the_new_cu_seqlens(activation):
    x, w1, w2, cu = grouped_case(activation, seed=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        ffn.grouped_ffn(x, w1, w2, cu, activation)  # warm-up outside the capture (cuBLAS workspaces, kernel loads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = ffn.grouped_ffn(x, w1, w2, cu, activation)
    cases = ([16, 16, 40, 48, 80, 80], [8, 30, 30, 100, 150, 200], [0, 0, 0, 0, 0, 0], [20, 40, 60, 80, 100, 256])
    for ends in cases:
        cu.copy_(torch.tensor(ends, dtype=torch.int32))
        graph.replay()
        want = torch_ops_ffn(x, w1, w2, cu, activation)  # eager, the torch ops, the new cu_seqlens
        torch.cuda.synchronize()
        assert torch.equal(bits(y), bits(want)), f"replay with cu_seqlens {ends}"
        assert (bits(y[ends[-1]:]) == 0).all()


def one_line_value_error(call, prefix):
    with pytest.raises(ValueError) as info:
        call()
    text = str(info.value)
    assert text.startswith(prefix) and "\n" not in text, text
    return text


@pytest.mark.cuda
@cuda_only
def test_bad_arguments_raise_one_line_value_errors_naming_the_argument():
    h = make_h(8, 32, seed=1)
    cu = ends_of(5)
    one_line_value_error(lambda: ffn.activate_rows(h.float(), cu, "swiglu"), "activate_rows: h must be bfloat16")
    one_line_value_error(lambda: ffn.activate_rows(h.cpu(), cu, "swiglu"), "activate_rows: h must be on a CUDA")
    one_line_value_error(lambda: ffn.activate_rows(h, cu.cpu(), "swiglu"), "activate_rows: cu_seqlens is on cpu")
    one_line_value_error(lambda: ffn.activate_rows(h, cu.long(), "swiglu"), "activate_rows: cu_seqlens must be int32")
    strided = h.t().contiguous().t()
    one_line_value_error(lambda: ffn.activate_rows(strided, cu, "swiglu"), "activate_rows: h must be contiguous")
    one_line_value_error(lambda: ffn.activate_rows(h[:, :31].contiguous(), cu, "swiglu"),
                         "activate_rows: h must have an even number")
    out = torch.empty(8, 32, dtype=BF16, device="cuda")
    one_line_value_error(lambda: ffn.activate_rows(h, cu, "swiglu", out=out),
                         "activate_rows: out must have shape [8, 16]")
    one_line_value_error(lambda: ffn.activate_rows(h, cu, "swiglu", out=out[:, :16]),
                         "activate_rows: out must be contiguous")
    one_line_value_error(lambda: ffn.activate_rows(h, cu, "silu", out=out.cpu()), "activate_rows: out is on cpu")
    one_line_value_error(lambda: ffn.zero_rows_from_end(h.float(), cu), "zero_rows_from_end: y must be bfloat16")
    one_line_value_error(lambda: ffn.zero_rows_from_end(h.cpu(), cu), "zero_rows_from_end: y must be on a CUDA")
    one_line_value_error(lambda: ffn.zero_rows_from_end(strided, cu), "zero_rows_from_end: y must be contiguous")
    one_line_value_error(lambda: ffn.zero_rows_from_end(h, cu[:0]), "zero_rows_from_end: cu_seqlens must be 1-D")

