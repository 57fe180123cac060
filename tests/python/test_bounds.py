"""Bounds of the Python front that used to not hold (issue 18): every timeout is a finite number of seconds in
(0, 86400], every integer argument out of range is a one-line ValueError naming it and its value (not pybind11's
multi-line TypeError), and a peer that leaves or stalls before a constructor is named on one line by the survivors
(not a gloo stack) within the timeout. R=2 and R=3 processes over gloo on the CPU backend.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_bounds.py
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import flatep
from flatep import _C, virtual
from flatep.distributed import SingleProcessBootstrap, transport_for

S, H, E, K = 16, 16, 8, 2
TIMEOUT_RANGE = "must be a finite number of seconds in (0, 86400] or None, got"


def raises(fn, message, kind=ValueError):
    with pytest.raises(kind) as info:
        fn()
    assert str(info.value) == message
    assert "\n" not in str(info.value)


# ---- timeouts ----

BAD_TIMEOUTS = [float("nan"), float("inf"), -float("inf"), 0, 0.0, -1, 86400.5, 10**400, True, "3"]


@pytest.mark.parametrize("timeout_s", BAD_TIMEOUTS, ids=lambda t: "10**400" if t == 10**400 else repr(t))
def test_bad_timeouts_are_rejected_at_the_call(timeout_s):
    """NaN used to switch the timeout off, 0 and -1 to fail later with "did not arrive within 0 s"."""
    text = f"{TIMEOUT_RANGE} {timeout_s!r}"
    raises(lambda: flatep.Buffer(None, S, H, E, K, timeout_s=timeout_s), f"Buffer: timeout_s {text}")
    raises(lambda: flatep.ExpertPools(None, 1, [(8, 8)], timeout_s=timeout_s), f"ExpertPools: timeout_s {text}")
    raises(lambda: virtual.virtual_ranks(2, timeout_s=timeout_s), f"virtual_ranks: timeout_s {text}")
    raises(lambda: transport_for(None, "cpu", timeout_s), f"transport_for: timeout_s {text}")


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1.0, 1e9])
def test_bad_timeouts_are_rejected_by_the_binding(timeout_s):
    """What a direct user of flatep._C gets: the C++ checks (the transport's constructor, the timeout_s setter)."""
    text = f"must be a finite number of seconds in (0, 86400], got {timeout_s:g}"
    raises(lambda: _C.make_ipc_transport(SingleProcessBootstrap(), "host", timeout_s),
           f"ipc transport: timeout_s {text}")
    transport = transport_for(None, "cpu")

    def set_timeout():
        transport.timeout_s = timeout_s

    before = transport.timeout_s
    raises(set_timeout, f"Transport: timeout_s {text}")
    assert transport.timeout_s == before


def test_the_bounds_themselves_are_valid():
    before = transport_for(None, "cpu").timeout_s
    try:
        flatep.Buffer(None, S, H, E, K, timeout_s=86400)
        assert transport_for(None, "cpu").timeout_s == 86400.0
        flatep.Buffer(None, S, H, E, K, timeout_s=1e-3)
        assert transport_for(None, "cpu").timeout_s == 1e-3
    finally:
        transport_for(None, "cpu", before)  # the process's one-rank transport is shared by later tests


@pytest.mark.parametrize("text", ["inf", "nan", "0", "-2", "1e9", "3s"])
def test_bad_flatep_timeout_s_is_rejected(monkeypatch, text):
    """FLATEP_TIMEOUT_S=inf used to be accepted (no bound at all)."""
    monkeypatch.setenv("FLATEP_TIMEOUT_S", text)
    message = f"FLATEP_TIMEOUT_S must be a number of seconds in (0, 86400], got '{text}'"
    raises(lambda: virtual.virtual_ranks(2), message)  # fresh transports: the variable is read now
    raises(_C.env_timeout_s, message)


def test_flatep_timeout_s_bounds_a_process_world():
    """A fresh process: the one-rank world's transport takes FLATEP_TIMEOUT_S, and rejects a bad one at the call."""
    code = "import flatep; b = flatep.Buffer(None, 16, 16, 8, 2); print(flatep.distributed.transport_for().timeout_s)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    good = subprocess.run([sys.executable, "-c", code], env=dict(env, FLATEP_TIMEOUT_S="2.5"), capture_output=True,
                          text=True, timeout=120)
    assert good.returncode == 0 and good.stdout.strip() == "2.5", good.stderr
    bad = subprocess.run([sys.executable, "-c", code], env=dict(env, FLATEP_TIMEOUT_S="inf"), capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == (
        "ValueError: FLATEP_TIMEOUT_S must be a number of seconds in (0, 86400], got 'inf'"
    )


# ---- integer arguments ----

BUFFER_INTS = {
    # id: (positional arguments after the group, keyword arguments, message)
    "num_tokens=2**31": ((2**31, H, E, K), {}, "Buffer: num_tokens must be in [1, 2147483647], got 2147483648"),
    "num_tokens=-2**31-1": ((-(2**31) - 1, H, E, K), {},
                            "Buffer: num_tokens must be in [1, 2147483647], got -2147483649"),
    "hidden=2**40": ((S, 2**40, E, K), {},
                     "Buffer: hidden must be a multiple of 8 in [8, 2147483640], got 1099511627776"),
    "num_experts=2**31": ((S, H, 2**31, K), {}, "Buffer: num_experts must be in [1, 2147483647], got 2147483648"),
    "topk=2**64": ((S, H, E, 2**64), {}, "Buffer: topk must be in [1, 32], got 18446744073709551616"),
    "align=2**31": ((S, H, E, K), {"align": 2**31}, "Buffer: align must be in [1, 4096], got 2147483648"),
    "align=-2**63": ((S, H, E, K), {"align": -(2**63)},
                     "Buffer: align must be in [1, 4096], got -9223372036854775808"),
    "capacity_factor=10**400": ((S, H, E, K), {"capacity_factor": 10**400},
                                f"Buffer: capacity_factor must be in [1, 4], got {10**400}"),
}


@pytest.mark.parametrize("args, kwargs, message", BUFFER_INTS.values(), ids=BUFFER_INTS.keys())
def test_out_of_range_buffer_ints_are_one_line_value_errors(args, kwargs, message):
    """Before: pybind11's "TypeError: __init__(): incompatible constructor arguments ..." over several lines (or, for
    capacity_factor, an OverflowError)."""
    raises(lambda: flatep.Buffer(None, *args, **kwargs), message)


def test_in_range_ints_keep_the_configs_own_messages():
    """Values a C++ int holds reach Config::validate, whose one-line messages name the field (as for C++ users)."""
    raises(lambda: flatep.Buffer(None, 0, H, E, K), "num_tokens (S) must be positive, got 0")
    raises(lambda: flatep.Buffer(None, S, 2**31 - 1, E, K),
           "hidden (H) must be a positive multiple of 8 (16-byte bf16 rows), got 2147483647")
    raises(lambda: flatep.Buffer(None, 2**31 - 1, H, E, K), "num_tokens*topk (S*K) must fit int32, got 4294967294")
    raises(lambda: flatep.Buffer(None, S, H, E, 2**31 - 1), "topk (K) must be in [1, 32], got 2147483647")
    raises(lambda: flatep.Buffer(None, S, H, 2**31 - 1, K),
           "num_experts (E) too large: 2*R*E must fit int32, got 2*1*2147483647")


def test_out_of_range_pools_ints_are_one_line_value_errors():
    raises(lambda: flatep.ExpertPools(None, 2**31, [(8, 8)]),
           "ExpertPools: experts_per_rank must be in [1, 2147483647], got 2147483648")
    raises(lambda: flatep.ExpertPools(None, 2, [(8, 8), (2**63, 4)]),
           "ExpertPools: projection 1 of [9223372036854775808][4] x 2 experts is too large")
    raises(lambda: flatep.ExpertPools(None, 2, [(4, 2**70)]),
           f"ExpertPools: projection 0 of [4][{2**70}] x 2 experts is too large")
    raises(lambda: flatep.ExpertPools(None, 2, [(2**40, 2**40)]),  # fits int64: the C++ check's message
           "ExpertPools: projection 0 of [1099511627776][1099511627776] x 2 experts is too large")


# ---- a peer that leaves or stalls before a constructor (R processes over gloo) ----


def _peer_fault_rank(rank, world_size, init_file, out_dir, fault, victim, timeout_s):
    """Every rank but `victim` builds a Buffer; the victim exits at once ('exit') or stalls past the timeout
    ('stall'), never calling FlatEP. Each survivor writes its error text and how long it took."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    if rank == victim:
        if fault == "stall":
            time.sleep(timeout_s + 3)
        os._exit(0)  # no teardown: the peers see the process leave
    start = time.monotonic()
    try:
        flatep.Buffer(None, S, H, E, K, timeout_s=timeout_s)
        result = {"error": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": str(e), "type": type(e).__name__}
    result["elapsed"] = time.monotonic() - start
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # the group has lost a member: skip the teardown's collectives


def _spawn_fault(world_size, fault, victim, timeout_s):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_peer_fault_rank, args=(world_size, os.path.join(tmp, "rendezvous"), tmp, fault, victim, timeout_s),
                 nprocs=world_size, join=True)
        results = {}
        for rank in range(world_size):
            if rank != victim:
                with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                    results[rank] = json.load(f)
        return results


@pytest.mark.parametrize("world_size, victim", [(2, 1), (3, 0)], ids=["R2-victim1", "R3-victim0"])
def test_a_peer_that_exits_before_the_constructor_is_named_on_one_line(world_size, victim):
    """Before: a 15-line RuntimeError ("Bootstrap.all_gather raised RuntimeError: [../gloo/transport/tcp/pair.cc:589]
    Read error ...: Connection reset by peer" and a Python traceback through Bootstrap.all_gather)."""
    timeout_s = 20.0  # the peer is gone at once: the survivors must not wait for the timeout
    for rank, r in _spawn_fault(world_size, "exit", victim, timeout_s).items():
        assert r["type"] == "RuntimeError"
        assert r["error"] == (
            f"torch.distributed bootstrap all_gather #0 on rank {rank}: rank {victim} left the job (connection "
            "closed) without arriving"
        ), f"rank {rank}"
        assert r["elapsed"] < timeout_s / 2, f"rank {rank} took {r['elapsed']:.1f} s"


def test_a_peer_that_stalls_before_the_constructor_is_named_within_the_timeout():
    """Before: the bootstrap waited for the gloo group's own timeout (30 min by default), not timeout_s."""
    timeout_s = 2.0
    (rank, r), = _spawn_fault(2, "stall", 1, timeout_s).items()
    assert r["type"] == "RuntimeError"
    assert r["error"] == "torch.distributed bootstrap all_gather #0 on rank 0: rank 1 did not arrive within 2 s"
    assert timeout_s - 0.1 <= r["elapsed"] <= timeout_s + 5, f"took {r['elapsed']:.1f} s"


def test_each_object_keeps_its_own_timeout():
    """timeout_s of one Buffer used to change every object of the group (it lived on the shared transport only): a
    Buffer built with 30 s then timed out after another Buffer's 0.5 s."""
    import time

    import flatep
    from flatep import virtual

    ranks = virtual.virtual_ranks(2, "cpu")
    a = virtual.run_threads(2, lambda r: flatep.Buffer(ranks[r], 4, 8, 2, 1, align=1, timeout_s=3))
    b = virtual.run_threads(2, lambda r: flatep.Buffer(ranks[r], 4, 8, 2, 1, align=1, timeout_s=0.5))
    for buf, want in ((b[0], 0.5), (a[0], 3.0)):  # rank 1 never comes: rank 0 alone waits its own bound
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"timeout in plan: rank 0 waited {want:.1f} s for peer 1"):
            buf.plan(torch.zeros(4, 1, dtype=torch.long))
        assert want - 0.1 < time.monotonic() - start < want + 1.5
