"""Virtual ranks on CUDA run on streams of their own, ordered with the caller's stream (flatep.virtual.run_threads):
a plain run_threads(R, step) with no stream of the user's must neither hang (torch's default stream is CUDA's legacy
stream, one queue for every thread: a rank's collective kernel waiting for a peer would hold the peer's kernel back)
nor read a tensor before the caller's kernel wrote it, nor hand back a result before the rank's kernel wrote it.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_virtual_streams.py
"""

import pytest
import torch

import mp_cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")]
R = 4
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: long enough that an unordered read sees the old value


def test_rank_threads_run_on_streams_of_their_own():
    from flatep import virtual

    virtual.virtual_ranks(R, torch.device("cuda", 0))
    handles = virtual.run_threads(R, lambda r: torch.cuda.current_stream().cuda_stream)
    assert 0 not in handles, f"a rank runs on the default stream: {handles}"
    assert len(set(handles)) == R, f"ranks share a stream: {handles}"
    assert virtual.run_threads(R, lambda r: torch.cuda.current_stream().cuda_stream) == handles  # persistent


def test_run_threads_is_ordered_with_the_callers_stream_both_ways():
    from flatep import virtual

    device = torch.device("cuda", 0)
    virtual.virtual_ranks(R, device)
    src = torch.zeros(1024, device=device)
    torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream is busy ...
    src.fill_(7.0)  # ... before it writes the input

    def step(r):
        seen = src.clone()  # rank r's stream: after the caller's fill
        torch.cuda._sleep(SLEEP_CYCLES)
        out = torch.full_like(src, float(r + 1))  # written late on rank r's stream
        return seen, out

    results = virtual.run_threads(R, step)
    for r, (seen, out) in enumerate(results):
        assert torch.equal(seen.cpu(), torch.full((1024,), 7.0)), f"rank {r} read the input before the caller wrote it"
        assert torch.equal(out.cpu(), torch.full((1024,), float(r + 1))), f"rank {r}'s result read before it was written"
