"""dispatch(zero_copy=True) on the GPU over many calls of different sizes (issue 17, "cost follows the tokens"): the
CUDA fan-out zeroes only the padding rows of the receive region that an earlier call may have written (the region's
row marks), so a row that was real in one call and is padding in the next must still come back zero, and an FP8
dispatch (whose e4m3 rows and scales share the region) must leave every row to be zeroed again.

R=2 virtual ranks on cuda:0 driven by one thread (one stream per rank) against the CPU backend on the same routing
and rows, bitwise: the same cu_seqlens, every real row and weight equal, every padding row and weight zero, over ten
calls with s from 0 to S, skew from uniform to sigma 3, one FP8 dispatch among them.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_zero_copy.py
"""

import pytest
import torch

import mp_cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
R, S, H, E, K = 2, 96, 256, 8, 4
# (s, sigma, fp8): large to small and back, so that rows real in one call fall into padding in the next
CALLS = [(96, 0.0, False), (24, 2.0, False), (3, 1.0, False), (96, 3.0, False), (48, 0.5, True), (48, 0.0, False),
         (1, 2.5, False), (0, 0.0, False), (96, 1.5, False), (7, 3.0, False)]


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_zero_copy_padding_rows_stay_zero_across_calls_and_fp8():
    import flatep
    from flatep import testing, virtual

    testing.release_all()
    device = torch.device("cuda", 0)
    gpu = virtual.virtual_ranks(R, device, timeout_s=60)
    cpu = virtual.virtual_ranks(R)
    gbufs = virtual.run_threads(R, lambda r: flatep.Buffer(gpu[r], S, H, E, K, align=16, device=device))
    cbufs = virtual.run_threads(R, lambda r: flatep.Buffer(cpu[r], S, H, E, K, align=16))
    streams = [torch.cuda.Stream(device) for _ in range(R)]
    checked_padding = 0
    for i, (s, sigma, fp8) in enumerate(CALLS):
        idx = [testing.sample_topk(E, s, K, r, sigma=sigma, seed=10 + i).long() for r in range(R)]
        g = torch.Generator().manual_seed(i)
        x = [torch.randn(s, H, generator=g).to(torch.bfloat16) for _ in range(R)]
        w = [torch.rand(s, K, generator=g) for _ in range(R)]
        dx = [t.to(device) for t in x]
        dw = [t.to(device) for t in w]
        didx = [t.to(device) for t in idx]
        torch.cuda.synchronize()
        got = []
        for r in range(R):  # one thread enqueues every rank's calls, each on its own stream
            with torch.cuda.stream(streams[r]), torch.no_grad():
                plan = gbufs[r].plan(didx[r])
                if fp8:
                    gbufs[r].dispatch(plan, dx[r], dw[r], fp8=True)
                    got.append(None)
                else:
                    got.append((plan,) + gbufs[r].dispatch(plan, dx[r], dw[r], zero_copy=True))
        torch.cuda.synchronize()
        if fp8:
            continue
        ref = virtual.run_threads(R, lambda r: (lambda p: (p,) + cbufs[r].dispatch(p, x[r], w[r]))(cbufs[r].plan(idx[r])))
        for r in range(R):
            gplan, grx, grw, gcu = got[r]
            cplan, crx, crw, ccu = ref[r]
            assert torch.equal(gcu.cpu(), ccu), f"call {i} rank {r}: cu_seqlens differ from the CPU backend's"
            end = int(ccu[-1])
            real = cplan.real_rows[:end]
            rows, weights = grx[:end].cpu(), grw[:end].cpu()
            assert torch.equal(rows[real].view(torch.int16), crx[:end][real].view(torch.int16)), f"call {i} rank {r}"
            assert torch.equal(weights[real], crw[:end][real]), f"call {i} rank {r}: weights"
            padding = ~real
            assert not rows[padding].view(torch.int16).any(), f"call {i} rank {r}: a padding row is not zero"
            assert not weights[padding].any(), f"call {i} rank {r}: a padding weight is not zero"
            checked_padding += int(padding.sum())
    for b in gbufs:
        b.check_status()
    assert checked_padding > 0
    testing.release_all()
