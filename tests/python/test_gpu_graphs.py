"""The public API's step inside CUDA graphs: plan + dispatch + combine of every virtual rank captured with
torch.cuda.graph (capture_error_mode "global": any cudaMalloc, synchronising copy or device synchronisation an op made
would fail the capture), replayed with new routing and tokens written into the static inputs, bitwise equal to the
eager ops on the same inputs, S*K rows on every rank.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_graphs.py
"""

import pytest
import torch

import graph_steps
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
    from flatep import virtual

    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(R, device, timeout_s=30)
    bufs = virtual.run_threads(R, lambda r: flatep.Buffer(group[r], S, H, E, K, align=1, device=device))
    ranks = graph_steps.GraphedRanks(bufs, device, S, H, E, K, step)
    ranks.write_inputs(0)
    ranks.eager()  # warm-up outside capture (kernel attributes, torch's allocator pools)
    ranks.capture()
    for trial in range(1, 6):
        ranks.write_inputs(trial)
        replayed = ranks.replay()
        want = ranks.eager()
        for r in range(R):
            assert int(replayed[r][1][-1]) == S * K and int(want[r][1][-1]) == S * K, f"trial {trial} rank {r}: rows"
            assert torch.equal(replayed[r][0].view(torch.int16), want[r][0].view(torch.int16)), (
                f"trial {trial} rank {r}: the replayed step differs from the eager one"
            )
    for b in bufs:
        b.check_status()
