"""A weighted combine's backward on the GPU leaves the dispatched output gradient in the receive region and runs
combine_grad there (Buffer._combine_backward_raw, what flatep.autograd's combine backward runs): bitwise the CPU
backend's copy path (a dispatch into a tensor of its own, then combine_grad), over calls of different sizes and skews
between which the region is rewritten by forward dispatches into tensors of their own and by zero-copy ones (the
region's row marks: a row real in one call and padding in the next), with the Buffers' SM budget capped and not.

R=2 virtual ranks on cuda:0 driven by one thread (one stream per rank) against the CPU backend on the same routing.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_combine_backward.py
"""

import pytest
import torch

import mp_cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
R, S, H, E, K = 2, 96, 264, 8, 4  # H = 33 chunks of 8: combine_grad's lanes do not divide a row evenly
# (s, sigma, forward dispatch before the backward: "copy" into a tensor of its own, "zero_copy" into the region)
CALLS = [(96, 0.0, "copy"), (24, 2.0, "zero_copy"), (3, 1.0, "copy"), (96, 3.0, "zero_copy"), (1, 2.5, "copy"),
         (0, 0.0, "copy"), (96, 1.5, "copy"), (7, 3.0, "zero_copy")]


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
@pytest.mark.parametrize("num_sms", [0, 2])
def test_combine_backward_in_the_region_matches_the_cpu_copy_path(num_sms):
    import flatep
    from flatep import testing, virtual

    testing.release_all()
    device = torch.device("cuda", 0)
    gpu = virtual.virtual_ranks(R, device, timeout_s=60)
    cpu = virtual.virtual_ranks(R)
    gbufs = virtual.run_threads(
        R, lambda r: flatep.Buffer(gpu[r], S, H, E, K, align=16, device=device, num_sms=num_sms))
    cbufs = virtual.run_threads(R, lambda r: flatep.Buffer(cpu[r], S, H, E, K, align=16))
    nvs = gbufs[0].num_recv_rows
    streams = [torch.cuda.Stream(device) for _ in range(R)]
    checked = 0
    for i, (s, sigma, forward) in enumerate(CALLS):
        idx = [testing.sample_topk(E, s, K, r, sigma=sigma, seed=20 + i).long() for r in range(R)]
        g = torch.Generator().manual_seed(100 + i)
        x = [torch.randn(s, H, generator=g).to(torch.bfloat16) for _ in range(R)]
        w = [torch.rand(s, K, generator=g) for _ in range(R)]
        grad_out = [torch.randn(s, H, generator=g).to(torch.bfloat16) for _ in range(R)]
        y = [torch.randn(nvs, H, generator=g).to(torch.bfloat16) for _ in range(R)]
        row_w = [torch.rand(nvs, generator=g) for _ in range(R)]
        dev = lambda ts: [t.to(device) for t in ts]  # noqa: E731
        dx, dw, dgo, dy, drw, didx = dev(x), dev(w), dev(grad_out), dev(y), dev(row_w), dev(idx)
        torch.cuda.synchronize()
        got = []
        for r in range(R):  # one thread enqueues every rank's calls, each on its own stream
            with torch.cuda.stream(streams[r]), torch.no_grad():
                plan = gbufs[r].plan(didx[r])
                gbufs[r].dispatch(plan, dx[r], dw[r], zero_copy=forward == "zero_copy")
                got.append(gbufs[r]._combine_backward_raw(plan, dgo[r], dy[r], drw[r]))
        torch.cuda.synchronize()

        def reference(r):
            plan = cbufs[r].plan(idx[r])
            rows, _ = cbufs[r]._dispatch_raw(plan, grad_out[r], None, want_weights=False)
            return cbufs[r]._combine_grad_raw(plan, rows, y[r], row_w[r])

        ref = virtual.run_threads(R, reference)
        for r in range(R):
            gy, gw = (t.cpu() for t in got[r])
            cy, cw = ref[r]
            assert torch.equal(gy.view(torch.int16), cy.view(torch.int16)), f"call {i} rank {r}: grad_y"
            assert torch.equal(gw.view(torch.int32), cw.view(torch.int32)), f"call {i} rank {r}: grad_weights"
            checked += int((cw != 0).sum())
    for b in gbufs:
        b.check_status()
    assert checked > 0
    testing.release_all()
