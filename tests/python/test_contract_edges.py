"""The Python front at the edges of the contract: expert ids -1 and E (invalid) next to E-1 (valid), in both index
widths; calls of s = 0 and s = S tokens; parameters at their largest allowed values; and a collective op whose peer
never comes, which must fail within its timeout (not only with the right message).

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_contract_edges.py
"""

import time

import pytest
import torch

import flatep
from flatep import virtual

S, H, E, K = 6, 16, 4, 2
BF16 = torch.bfloat16


def bad_id_message(value, flat):
    return (
        f"rank 0: invalid expert id {value} at topk_idx flat index {flat} (token {flat // K}, k {flat % K}); "
        f"ids must be in [0, E={E}); the entry was skipped"
    )


@pytest.fixture(scope="module")
def buffer():
    return flatep.Buffer(None, S, H, E, K, align=1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("value", [-1, E])
def test_ids_just_outside_the_range_are_rejected_with_their_index(buffer, dtype, value):
    idx = torch.tensor([[E - 1, 0]] * S, dtype=dtype)
    idx[2, 1] = value
    with pytest.raises(ValueError) as info:
        buffer.plan(idx)
    assert str(info.value) == bad_id_message(value, 2 * K + 1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_last_expert_id_is_valid(buffer, dtype):
    # Token t routes to E-1 and to t % (E-1): each row of the last expert's group is the row of a token that chose it.
    idx = torch.tensor([[E - 1, t % (E - 1)] for t in range(S)], dtype=dtype)
    plan = buffer.plan(idx)
    x = torch.arange(S * H, dtype=torch.float32).view(S, H).to(BF16)
    recv_x, _, cu = buffer.dispatch(plan, x)
    last = recv_x[cu[E - 2]:cu[E - 1]]
    assert torch.equal(last, x), "the group of expert E-1 holds every token, in token order"
    assert torch.equal(buffer.combine(plan, recv_x), (x.float() * 2).to(BF16))


def test_zero_and_full_token_counts(buffer):
    empty = buffer.plan(torch.zeros(0, K, dtype=torch.int64))
    recv_x, recv_w, cu = buffer.dispatch(empty, torch.zeros(0, H, dtype=BF16), torch.zeros(0, K))
    assert empty.num_tokens == 0 and cu.tolist() == [0] * (2 * E)
    assert recv_x.shape == (buffer.num_recv_rows, H)  # every row is past the last group end: none is defined
    assert buffer.combine(empty, recv_x, recv_w).shape == (0, H)
    assert buffer.entry_values(empty, recv_w).shape == (0, K)
    full = buffer.plan(torch.tensor([[1, 2]] * S))
    assert full.num_tokens == S and full.stats["loads"] == [S * K]
    with pytest.raises(ValueError, match=rf"s <= S={S}, got \[{S + 1}, {K}\]"):
        buffer.plan(torch.tensor([[1, 2]] * (S + 1)))


def test_parameters_at_their_largest_allowed_values():
    # K = E, align = 4096, capacity_factor = 4: C = ceil(4 * S * K), NvS = round_up(C + 2 * E * 4095, 4096).
    buf = flatep.Buffer(None, S, H, E, E, align=4096, capacity_factor=4.0)
    assert buf.capacity == 4 * S * E
    assert buf.num_recv_rows == -(-(4 * S * E + 2 * E * 4095) // 4096) * 4096
    idx = torch.tensor([list(range(E))] * S)
    plan = buf.plan(idx)
    x = torch.ones(S, H, dtype=BF16)
    recv_x, _, cu = buf.dispatch(plan, x)
    assert cu[:E].tolist() == [4096 * (e + 1) for e in range(E)]  # every group of S rows padded to 4096
    assert torch.equal(buf.combine(plan, recv_x), torch.full((S, H), float(E), dtype=BF16))
    with pytest.raises(ValueError, match="align must be in"):
        flatep.Buffer(None, S, H, E, K, align=4097)
    with pytest.raises(ValueError, match="capacity_factor must be in"):
        flatep.Buffer(None, S, H, E, K, capacity_factor=4.001)


def test_a_collective_whose_peer_never_comes_times_out_in_time():
    timeout = 0.5
    ranks = virtual.virtual_ranks(2, "cpu", timeout_s=10)
    bufs = virtual.run_threads(2, lambda r: flatep.Buffer(ranks[r], S, H, E, K, align=1, timeout_s=timeout))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^timeout in plan: rank 0 waited 0\.5 s for peer 1 "):
        bufs[0].plan(torch.tensor([[0, 1]] * S))  # rank 1 never calls plan
    elapsed = time.monotonic() - start
    assert timeout <= elapsed < timeout + 2.0, f"timed out after {elapsed:.2f} s, timeout {timeout} s"


def test_dispatch_zeroes_padding_rows_itself():
    # The Python wrapper hands dispatch zero-filled buffers, which would hide a backend that skips the padding: call
    # the bound op on NaN-filled buffers. Rows inside a group's padded range but past its real rows must come back
    # zero with weight 0; rows past the last group end are not written.
    buf = flatep.Buffer(None, S, H, E, K, align=4)
    idx = torch.tensor([[0, 1 + t % (E - 1)] for t in range(S)])
    plan = buf.plan(idx)
    x = torch.ones(S, H, dtype=BF16)
    recv_x = torch.full((buf.num_recv_rows, H), float("nan"), dtype=BF16)
    recv_w = torch.full((buf.num_recv_rows,), float("nan"))
    buf._buffer.dispatch(plan._plan, x.data_ptr(), 0, recv_x.data_ptr(), recv_w.data_ptr())
    cu = plan.cu_seqlens.tolist()
    real = plan.real_rows
    end = cu[-1]
    padding = ~real[:end]
    assert padding.any(), "the routing leaves padding rows"
    assert (recv_x[:end][padding] == 0).all() and (recv_w[:end][padding] == 0).all()
    assert (recv_x[:end][~padding] == 1).all() and (recv_w[:end][~padding] == 1).all()
    assert recv_x[end:].isnan().all() and recv_w[end:].isnan().all()


def _sleep_forever(rank, world_size):
    time.sleep(3600)


def test_spawn_kills_a_run_past_its_wall_clock_limit(monkeypatch):
    monkeypatch.setenv("FLATEP_SPAWN_TIMEOUT_S", "4")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^spawn: _sleep_forever on 2 process\(es\) did not finish within 4 s "):
        flatep.testing.spawn(_sleep_forever, 2)
    assert time.monotonic() - t0 < 60


def test_spawn_timeout_is_checked(monkeypatch):
    for bad in ("0", "-1", "nan", "inf", "soon"):
        monkeypatch.setenv("FLATEP_SPAWN_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=r"^FLATEP_SPAWN_TIMEOUT_S must be a positive number of seconds, got "):
            flatep.testing.spawn_timeout_s()
    monkeypatch.delenv("FLATEP_SPAWN_TIMEOUT_S")
    assert flatep.testing.spawn_timeout_s() is None
