"""FP8 rows: flatep.fp8's rule against the C++ rule (bits), exact cases, and Buffer.dispatch(..., fp8=True) on virtual
ranks (CPU backend; the cuda cases compare a GPU run bitwise with the CPU backend).

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_fp8.py
"""

import pytest
import torch

import mp_cases

import flatep
from flatep import _C, fp8, testing, virtual

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
R, S, H, E, K = 4, 24, 256, 16, 3


def cpp_quantize(x, ue8m0):
    """flatep::quantize_fp8_rows on a CPU bf16 tensor [rows, H]."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.uint8)
    s = torch.empty(x.shape[0], x.shape[1] // 128, dtype=torch.float32)
    _C.quantize_fp8(x.data_ptr(), x.shape[0], x.shape[1], ue8m0, q.data_ptr(), s.data_ptr())
    return q, s


def bits(t):
    """The raw bits of a tensor, for exact comparisons (NaN payloads included)."""
    t = t.contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return fp8.as_bytes(t) if t.dtype != torch.bfloat16 else t.view(torch.int16)


def special_rows(rows, width, seed):
    """bf16 rows of random values over a wide range with blocks of zeros, NaN, +-Inf and bf16 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, width), generator=g))).to(
        torch.bfloat16
    )
    blocks = x.view(torch.int16).view(rows, width // 128, 128)
    kinds = torch.randint(0, 8, (rows, width // 128), generator=g)
    blocks[kinds == 0] = 0
    blocks[..., 5][kinds == 1] = 0x7FC1  # NaN
    blocks[..., 9][kinds == 2] = -0x80  # 0xff80: -Inf
    blocks[..., 9][kinds == 3] = 0x7F80  # +Inf
    sub = torch.randint(0, 0x80, (rows, width // 128, 128), generator=g, dtype=torch.int16)
    blocks[kinds == 4] = sub[kinds == 4]
    return x


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_matches_the_cpp_rule_bitwise(ue8m0):
    # Every bf16 bit pattern once (512 rows of 128), in two block arrangements, plus random rows with special blocks.
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    perm = torch.randperm(every.numel(), generator=torch.Generator().manual_seed(1))
    for x in (every.view(-1, 128), every[perm].view(-1, 256), special_rows(64, 384, 2)):
        q, s = fp8.quantize(x, ue8m0=ue8m0)
        want_q, want_s = cpp_quantize(x, ue8m0)
        assert q.shape == x.shape and s.shape == (x.shape[0], x.shape[1] // 128)
        assert torch.equal(bits(q), want_q)
        assert torch.equal(bits(s), bits(want_s))
    if ue8m0:  # power-of-two scales
        mantissa, _ = torch.frexp(want_s)
        assert torch.all(mantissa == 0.5)


def test_quantize_exact_values():
    nan, inf = float("nan"), float("inf")
    block = torch.zeros(4, 128)
    block[1, :6] = torch.tensor([896.0, -448.0, 2.0, nan, inf, -1e-30])
    block[1, 6:] = 1.0
    block[2, :3] = torch.tensor([1.0, 1.25, 3.0])
    block[3, :3] = torch.tensor([nan, inf, -inf])
    x = block.reshape(1, 512).to(torch.bfloat16)
    q, s = fp8.quantize(x)
    q = fp8.as_bytes(q)[0]
    assert [s[0, 0].item(), s[0, 1].item(), s[0, 3].item()] == [1.0, 2.0, 1.0]  # zeros / NaN and Inf only: 1
    assert bits(s)[0, 2].item() == bits(torch.tensor([3.0]) / torch.tensor([448.0]))[0].item()  # amax 3: 3/448
    assert q[:2].tolist() == [0x00, 0x00]  # a zero block: scale 1, zero bytes
    assert q[128:135].tolist() == [0x7E, 0xF6, 0x38, 0x7F, 0x7E, 0x80, 0x30]  # 448, -224, 1, NaN, Inf->448, -0, 0.5
    assert q[256:259].tolist() == [0x71, 0x74, 0x7E]  # 1 / (3/448) = 149.3 -> 144, 186.7 -> 192, 3 -> 448
    assert q[384:387].tolist() == [0x7F, 0x7E, 0xFE]  # only NaN / Inf: scale 1, NaN -> 0x7f, +-Inf -> +-448
    q2, s2 = fp8.quantize(x, ue8m0=True)
    assert s2[0].tolist() == [1.0, 2.0, 2.0**-7, 1.0]
    assert fp8.as_bytes(q2)[0, 256:259].tolist() == [0x70, 0x72, 0x7C]  # 128, 160, 384: exact


def test_dequantize_inverts_exact_rows():
    # Values that are e4m3 values times a power of two come back exactly with power-of-two scales.
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    table = fp8.dequantize(codes[:128].view(1, 128).repeat(1, 1), torch.ones(1, 1))
    assert table[0, 0].item() == 0.0 and table[0, 0x38].item() == 1.0 and table[0, 0x01].item() == 2.0**-9
    assert table[0, 0x7E].item() == 448.0
    x = (table.repeat(3, 2) * torch.tensor([[2.0**-20], [1.0], [2.0**30]])).to(torch.bfloat16)  # [3, 256]
    q, s = fp8.quantize(x, ue8m0=True)
    assert s.tolist() == [[2.0**-20] * 2, [1.0] * 2, [2.0**30] * 2]
    assert torch.equal(fp8.dequantize(q, s), x.float())
    assert torch.equal(fp8.dequantize(q, s, dtype=torch.bfloat16), x)
    nan_row = fp8.dequantize(torch.full((1, 128), 0x7F, dtype=torch.uint8), torch.ones(1, 1))
    assert torch.isnan(nan_row).all()


def test_quantize_errors():
    with pytest.raises(ValueError, match=r"^quantize: x must be bfloat16, got float32$"):
        fp8.quantize(torch.zeros(2, 128))
    with pytest.raises(ValueError, match=r"^quantize: x's last dimension \(H\) must be a positive multiple of 128, got 200$"):
        fp8.quantize(torch.zeros(2, 200, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^quantize: ue8m0 must be a bool, got 1$"):
        fp8.quantize(torch.zeros(2, 128, dtype=torch.bfloat16), ue8m0=1)
    with pytest.raises(ValueError, match=r"^dequantize: scales must have shape \[2, 1\], got \[2, 2\]$"):
        fp8.dequantize(torch.zeros(2, 128, dtype=torch.uint8), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"^dequantize: q must be uint8"):
        fp8.dequantize(torch.zeros(2, 128, dtype=torch.int8), torch.ones(2, 1))


def make_world(device, hidden=H):
    ranks = virtual.virtual_ranks(R, device, timeout_s=30)
    return virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, hidden, E, K, align=8, device=device))


def make_inputs(r, hidden=H):
    idx = testing.sample_topk(E, S, K, r, sigma=1.0, seed=5).long()
    x = special_rows(S, hidden, 10 + r)
    w = torch.rand(S, K, generator=torch.Generator().manual_seed(20 + r))
    return idx, x, w


def run_cpu(ue8m0):
    """Every rank: bf16 dispatch, FP8 dispatch of bf16 rows, FP8 dispatch of the same rows pre-quantised."""
    bufs = make_world("cpu")
    inputs = [make_inputs(r) for r in range(R)]

    def rank(r):
        idx, x, w = inputs[r]
        plan = bufs[r].plan(idx)
        with torch.no_grad():
            bf16 = bufs[r].dispatch(plan, x, w)
            from_bf16 = bufs[r].dispatch(plan, x, w, fp8=True, ue8m0=ue8m0)
            pre = bufs[r].dispatch(plan, fp8.quantize(x, ue8m0=ue8m0), w, fp8=True)
        return plan, bf16, from_bf16, pre

    return inputs, virtual.run_threads(R, rank)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_dispatch_fp8_is_the_bf16_dispatch_quantised_per_row(ue8m0):
    _, results = run_cpu(ue8m0)
    padding_seen = False
    for r, (plan, (recv_x, recv_w, cu), ((q, s), w8, cu8), ((pq, ps), pw, _)) in enumerate(results):
        end = int(cu[-1])
        real = plan.real_rows[:end]
        assert torch.equal(cu8, cu)
        assert q.shape == (bufs_nvs(plan), H) and s.shape == (bufs_nvs(plan), H // 128) and s.dtype == torch.float32
        assert q.dtype == (fp8.E4M3_DTYPE or torch.uint8)
        want_q, want_s = fp8.quantize(recv_x[:end], ue8m0=ue8m0)
        assert torch.equal(bits(q[:end])[real], bits(want_q)[real]), r
        assert torch.equal(bits(s[:end])[real], bits(want_s)[real]), r
        assert torch.all(bits(q[:end])[~real] == 0) and torch.all(bits(s[:end])[~real] == 0), r  # padding: zeros
        padding_seen |= bool((~real).any())
        assert torch.equal(bits(w8[:end]), bits(recv_w[:end])), r
        # Pre-quantised rows arrive with the same bits as rows quantised inside the op.
        assert torch.equal(bits(pq[:end]), bits(q[:end])) and torch.equal(bits(ps[:end]), bits(s[:end])), r
        assert torch.equal(bits(pw[:end]), bits(w8[:end])), r
        # Dequantised payload: NaN where the rows had NaN; finite values within half an e4m3 step (2^-4 relative, or
        # half the smallest subnormal step, 2^-10 * scale) of the bf16 rows.
        deq = fp8.dequantize(q[:end], s[:end])[real]
        ref = recv_x[:end].float()[real]
        assert torch.equal(torch.isnan(deq), torch.isnan(ref))
        finite = torch.isfinite(ref)
        scale = s[:end][real].repeat_interleave(128, dim=1)
        bound = ref.abs() * 2.0**-4 + scale * 2.0**-10
        assert torch.all((deq - ref).abs()[finite] <= bound[finite]), r
    assert padding_seen


def bufs_nvs(plan):
    return plan._buffer.num_recv_rows


def test_dispatch_fp8_errors():
    bufs = make_world("cpu")
    idx, x, w = make_inputs(0)
    plans = virtual.run_threads(R, lambda r: bufs[r].plan(make_inputs(r)[0]))
    b, plan = bufs[0], plans[0]
    with pytest.raises(ValueError, match=r"^dispatch: x must be bfloat16, got float32$"):
        b.dispatch(plan, x.float(), w, fp8=True)
    with pytest.raises(ValueError, match=r"^dispatch: x_q must be uint8( or float8_e4m3fn)?, got int8$"):
        b.dispatch(plan, (torch.zeros(S, H, dtype=torch.int8), torch.ones(S, 2)), w, fp8=True)
    with pytest.raises(ValueError, match=r"^dispatch: x_scales must have shape \[24, 2\], got \[24, 3\]$"):
        b.dispatch(plan, (torch.zeros(S, H, dtype=torch.uint8), torch.ones(S, 3)), w, fp8=True)
    with pytest.raises(ValueError, match=r"^dispatch: x_scales must be float32, got bfloat16$"):
        b.dispatch(plan, (torch.zeros(S, H, dtype=torch.uint8), torch.ones(S, 2, dtype=torch.bfloat16)), w, fp8=True)
    with pytest.raises(ValueError, match=r"^dispatch: fp8 x must be a bf16 tensor or a tuple \(x_q, x_scales\), got a tuple of 3 items$"):
        b.dispatch(plan, (x, x, x), w, fp8=True)
    with pytest.raises(ValueError, match=r"^dispatch: x is a tuple \(pre-quantised FP8 rows, scales\); pass fp8=True$"):
        b.dispatch(plan, fp8.quantize(x), w)
    with pytest.raises(ValueError, match=r"^dispatch: fp8 and ue8m0 must be bools, got fp8=1, ue8m0=False$"):
        b.dispatch(plan, x, w, fp8=1)
    with pytest.raises(ValueError, match=r"^dispatch: fp8=True is forward-only \(no autograd\), but x requires grad"):
        b.dispatch(plan, x.clone().requires_grad_(True), w, fp8=True)
    with pytest.raises(ValueError, match=r"^dispatch: fp8=True is forward-only \(no autograd\), but topk_weights"):
        b.dispatch(plan, x, w.clone().requires_grad_(True), fp8=True)
    # Every rank still runs the collective afterwards (argument errors are local and come before any barrier).
    out = virtual.run_threads(R, lambda r: bufs[r].dispatch(plans[r], make_inputs(r)[1], None, fp8=True))
    assert all(o[1].shape == (b.num_recv_rows,) for o in out)

    odd = make_world("cpu", hidden=64)
    odd_plan = virtual.run_threads(R, lambda r: odd[r].plan(make_inputs(r)[0]))[0]
    with pytest.raises(ValueError, match=r"^dispatch: fp8=True needs hidden \(H\) to be a multiple of 128 \(one scale per 128 channels\), got H=64$"):
        odd[0].dispatch(odd_plan, torch.zeros(S, 64, dtype=torch.bfloat16), None, fp8=True)


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
@pytest.mark.parametrize("ue8m0", [False, True])
def test_cuda_dispatch_fp8_bitwise_equals_the_cpu_backend(ue8m0):
    inputs, cpu = run_cpu(ue8m0)
    device = torch.device("cuda", 0)
    bufs = make_world(device)
    streams = [torch.cuda.Stream(device) for _ in range(R)]
    gpu_in = [tuple(t.to(device) for t in inp) for inp in inputs]
    # The torch rule on the GPU, before any collective: a torch kernel loaded lazily between two ranks' ops could wait
    # for a rank's kernel that spins for a peer this thread has not enqueued yet.
    gpu_q = [fp8.quantize(x, ue8m0=ue8m0) for _, x, _ in gpu_in]
    torch.cuda.synchronize()
    for r in range(R):
        assert torch.equal(bits(gpu_q[r][0].cpu()), bits(fp8.quantize(inputs[r][1], ue8m0=ue8m0)[0]))
        assert torch.equal(bits(gpu_q[r][1].cpu()), bits(fp8.quantize(inputs[r][1], ue8m0=ue8m0)[1]))
    plans, outs = [], []
    for r in range(R):  # one thread enqueues every rank's op on the rank's stream (they never block the host)
        with torch.cuda.stream(streams[r]):
            plans.append(bufs[r].plan(gpu_in[r][0]))
    for r in range(R):
        idx, x, w = gpu_in[r]
        with torch.cuda.stream(streams[r]), torch.no_grad():
            from_bf16 = bufs[r].dispatch(plans[r], x, w, fp8=True, ue8m0=ue8m0)
            outs.append([from_bf16])
    for r in range(R):
        idx, x, w = gpu_in[r]
        with torch.cuda.stream(streams[r]), torch.no_grad():
            outs[r].append(bufs[r].dispatch(plans[r], gpu_q[r], w, fp8=True))  # the pre-quantised path
    torch.cuda.synchronize()
    for r in range(R):
        end = int(cpu[r][0].cu_seqlens[-1])
        for got, want in zip(outs[r], (cpu[r][2], cpu[r][3])):
            (q, s), w8, cu = got
            (cq, cs), cw, ccu = want
            assert torch.equal(cu.cpu(), ccu)
            assert torch.equal(bits(q[:end].cpu()), bits(cq[:end])), r
            assert torch.equal(bits(s[:end].cpu()), bits(cs[:end])), r
            assert torch.equal(bits(w8[:end].cpu()), bits(cw[:end])), r


def test_values_are_multiplied_by_the_block_inverse():
    # The rule multiplies by 448 / amax (one division per block): -0.1708984375 (bf16 0xbe2f) in a block of amax
    # 12.25 gives 0xcd, where dividing by 12.25 / 448 would give 0xcc. A block whose inverse overflows divides.
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    x[0, 0] = 12.25
    x.view(torch.int16)[0, 1] = torch.tensor(0xBE2F - 0x10000, dtype=torch.int16)
    x.view(torch.int16)[1, 0] = 1  # the smallest bf16 subnormal
    q, s = fp8.quantize(x)
    want_q, want_s = cpp_quantize(x, False)
    assert bits(q)[0, :3].tolist() == [0x7E, 0xCD, 0x00]
    assert bits(q)[1, :2].tolist() == [0x7E, 0x00]  # not 0x7f: 0 * inf would be NaN
    assert torch.equal(bits(q), want_q) and torch.equal(bits(s), bits(want_s))
