"""dispatch(zero_copy=True): the receive rows are views of the symmetric receive region (no copy-out of chain-head
rows), equal to the copying dispatch's rows inside the groups, rewritten by the next dispatch, forward only. CPU
backend, virtual ranks."""

import pytest
import torch

import flatep
from flatep import testing, virtual

R, S, H, E, K = 2, 24, 16, 8, 2


@pytest.fixture()
def world():
    testing.release_all()
    ranks = virtual.virtual_ranks(R)
    bufs = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, H, E, K, align=4))
    yield bufs
    testing.release_all()


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    idx = [testing.sample_topk(E, S, K, r, sigma=1.2, seed=seed).long() for r in range(R)]
    x = [torch.randn(S, H, generator=g).to(torch.bfloat16) for _ in range(R)]
    w = [torch.rand(S, K, generator=g) for _ in range(R)]
    return idx, x, w


def test_zero_copy_rows_equal_the_copied_rows_and_live_in_the_symmetric_region(world):
    bufs = world
    idx, x, w = inputs(1)
    plans = virtual.run_threads(R, lambda r: bufs[r].plan(idx[r]))
    copied = virtual.run_threads(R, lambda r: bufs[r].dispatch(plans[r], x[r], w[r]))
    copied = [(a.clone(), b.clone(), c) for a, b, c in copied]
    views = virtual.run_threads(R, lambda r: bufs[r].dispatch(plans[r], x[r], w[r], zero_copy=True))
    for r in range(R):
        end = int(plans[r].cu_seqlens[-1])
        rx, rw, cu = views[r]
        assert rx.data_ptr() == bufs[r]._buffer.symmetric_recv[0] and rw.data_ptr() == bufs[r]._buffer.symmetric_recv[1]
        assert torch.equal(rx[:end].view(torch.int16), copied[r][0][:end].view(torch.int16)), f"rank {r}: rows"
        assert torch.equal(rw[:end], copied[r][1][:end]), f"rank {r}: weights"
        assert torch.equal(cu, copied[r][2])
    outs = virtual.run_threads(R, lambda r: bufs[r].combine(plans[r], views[r][0], views[r][1]))
    ref = virtual.run_threads(R, lambda r: bufs[r].combine(plans[r], copied[r][0], copied[r][1]))
    for r in range(R):
        assert torch.equal(outs[r].view(torch.int16), ref[r].view(torch.int16)), f"rank {r}: combine of the views"


def test_the_next_dispatch_rewrites_the_views(world):
    bufs = world
    idx, x, w = inputs(2)
    plans = virtual.run_threads(R, lambda r: bufs[r].plan(idx[r]))
    first = virtual.run_threads(R, lambda r: bufs[r].dispatch(plans[r], x[r], w[r], zero_copy=True))
    snapshot = [v[0].clone() for v in first]
    x2 = [t.float().neg().to(torch.bfloat16) for t in x]
    second = virtual.run_threads(R, lambda r: bufs[r].dispatch(plans[r], x2[r], w[r], zero_copy=True))
    for r in range(R):
        end = int(plans[r].cu_seqlens[-1])
        real = plans[r].real_rows[:end]
        assert real.any()
        # the same memory: the first call's views now hold the second call's (negated) rows
        assert second[r][0].data_ptr() == first[r][0].data_ptr()
        assert torch.equal(first[r][0][:end][real].float(), -snapshot[r][:end][real].float()), f"rank {r}"


def test_zero_copy_is_forward_only_and_default_stream_only(world):
    bufs = world
    idx, x, w = inputs(3)
    plans = virtual.run_threads(R, lambda r: bufs[r].plan(idx[r]))
    with pytest.raises(ValueError, match=r"^dispatch: zero_copy=True is forward-only .* but x requires grad"):
        bufs[0].dispatch(plans[0], x[0].clone().requires_grad_(), w[0], zero_copy=True)
    with pytest.raises(ValueError, match=r"^dispatch: zero_copy=True takes no fp8, stream"):
        bufs[0].dispatch(plans[0], x[0], w[0], zero_copy=True, num_sms=4)
    with pytest.raises(ValueError, match=r"^dispatch: zero_copy must be a bool, got 1"):
        bufs[0].dispatch(plans[0], x[0], w[0], zero_copy=1)
