"""The public API's step inside CUDA graphs: plan + dispatch + combine of every virtual rank captured with
torch.cuda.graph (capture_error_mode "global": any cudaMalloc, synchronising copy or device synchronisation an op made
would fail the capture), replayed with new routing and tokens written into the static inputs, bitwise equal to the
eager ops on the same inputs, S*K rows on every rank.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_graphs.py
"""

import pytest
import torch

import mp_cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
R, S, H, E, K = 4, 256, 512, 32, 4


def step(buf, idx, x, w):
    plan = buf.plan(idx)
    recv_x, recv_w, cu = buf.dispatch(plan, x, w)
    return buf.combine(plan, recv_x, recv_w), cu


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_public_step_replays_as_cuda_graphs_bitwise():
    import flatep
    from flatep import testing, virtual

    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(R, device, timeout_s=30)
    bufs = virtual.run_threads(R, lambda r: flatep.Buffer(group[r], S, H, E, K, align=1, device=device))
    streams = [torch.cuda.Stream(device) for _ in range(R)]
    idx = [torch.zeros(S, K, dtype=torch.int64, device=device) for _ in range(R)]
    x = [torch.zeros(S, H, dtype=torch.bfloat16, device=device) for _ in range(R)]
    w = [torch.zeros(S, K, device=device) for _ in range(R)]

    def write_inputs(trial):
        for r in range(R):
            idx[r].copy_(testing.sample_topk(E, S, K, r, sigma=0.5 + 0.4 * trial, seed=trial).long())
            g = torch.Generator().manual_seed(100 * trial + r)
            x[r].copy_(torch.randn(S, H, generator=g).to(torch.bfloat16))
            w[r].copy_(torch.rand(S, K, generator=g))
        torch.cuda.synchronize()

    def eager():
        outs = []
        for r in range(R):
            with torch.cuda.stream(streams[r]), torch.no_grad():
                outs.append(step(bufs[r], idx[r], x[r], w[r]))
        torch.cuda.synchronize()
        return [(o.clone(), int(cu[-1])) for o, cu in outs]

    write_inputs(0)
    eager()  # warm-up outside capture (kernel attributes, torch's allocator pools)
    graphs, static = [], []
    for r in range(R):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[r], capture_error_mode="global"), torch.no_grad():
            static.append(step(bufs[r], idx[r], x[r], w[r]))
        graphs.append(graph)
    torch.cuda.synchronize()
    for trial in range(1, 6):
        write_inputs(trial)
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        replayed = [(o.clone(), int(cu[-1])) for o, cu in static]
        want = eager()
        for r in range(R):
            assert replayed[r][1] == S * K and want[r][1] == S * K, f"trial {trial} rank {r}: rows"
            assert torch.equal(replayed[r][0].view(torch.int16), want[r][0].view(torch.int16)), (
                f"trial {trial} rank {r}: the replayed step differs from the eager one"
            )
    for b in bufs:
        b.check_status()
