"""FlatEP on a GPU under every CUDA_MODULE_LOADING setting (unset, i.e. torch's LAZY default; LAZY; EAGER).

Several ranks in one process, one host thread enqueuing every rank's plan + dispatch + combine on its own stream:
under lazy loading, any kernel loaded for the first time between two ranks' launches (FlatEP's own, or a torch kernel
the Python layer launches) may wait for every running kernel of the context, among them a rank's kernel that spins
for a peer this thread has not launched yet: the first step then hangs until the timeout, and every later step runs
on barriers the timeout left out of step. Each case runs benchmarks/soak/gpu_soak.py in a fresh process (the variable is
read when CUDA starts) and asserts that it passes its checks (exact S*K rows, bitwise replays, clean status, flat
memory) within a time far below the timeout it sets.

Also: GPU-side failures (a timed-out wait, ranks in different ops, a bad expert id) raise at a later op with no
host synchronisation, and a failed wait poisons the Buffer on every rank.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_robustness.py
"""

import os
import re
import subprocess
import sys
import time

import pytest

import mp_cases

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CUDA_SKIP = mp_cases.cuda_unavailable_reason()
TIMEOUT_S = 20  # FLATEP_TIMEOUT_S of the child: a hung first step alone takes this long


def run_soak(loading, mode, ranks, steps):
    env = dict(os.environ)
    env.pop("CUDA_MODULE_LOADING", None)
    if loading is not None:
        env["CUDA_MODULE_LOADING"] = loading
    env["FLATEP_TIMEOUT_S"] = str(TIMEOUT_S)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "soak", "gpu_soak.py"), "--mode", mode, "--ranks", str(ranks),
        "--steps", str(steps), "--tokens", "1024", "--hidden", "2048", "--experts", "64", "--topk", "8",
        "--warmup", "10", "--replay-every", "25", "--max-seconds", str(TIMEOUT_S / 2),
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
@pytest.mark.parametrize("loading", [None, "LAZY", "EAGER"], ids=["unset", "LAZY", "EAGER"])
def test_virtual_ranks_one_thread_never_hang(loading):
    proc, seconds = run_soak(loading, "virtual", 4, 200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"CUDA_MODULE_LOADING={loading}: soak failed after {seconds:.1f} s:\n{out[-3000:]}"
    assert "PASS virtual: 200 steps" in proc.stdout, out[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
@pytest.mark.parametrize("loading", [None, "LAZY"], ids=["unset", "LAZY"])
def test_processes_sharing_the_gpu_never_hang(loading):
    proc, seconds = run_soak(loading, "processes", 2, 100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"CUDA_MODULE_LOADING={loading}: soak failed after {seconds:.1f} s:\n{out[-3000:]}"
    assert "PASS processes: 100 steps" in proc.stdout, out[-3000:]


def _two_virtual_buffers(timeout_s):
    import torch

    import flatep
    from flatep import virtual

    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(2, device, timeout_s=timeout_s)
    bufs = virtual.run_threads(2, lambda r: flatep.Buffer(group[r], 64, 256, 8, 2, align=1, device=device))
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    idx = [torch.randint(0, 8, (64, 2), device=device) for _ in range(2)]
    x = [torch.randn(64, 256, device=device).to(torch.bfloat16) for _ in range(2)]
    return bufs, streams, idx, x


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_timeout_poisons_every_rank_without_a_host_sync():
    import torch

    bufs, streams, idx, x = _two_virtual_buffers(timeout_s=1.0)
    for r in range(2):  # a good step
        with torch.cuda.stream(streams[r]):
            bufs[r].plan(idx[r])
    with torch.cuda.stream(streams[0]):
        bufs[0].plan(idx[0])  # rank 1 never comes: rank 0's kernel times out on the GPU
    start = time.monotonic()
    streams[0].synchronize()
    assert time.monotonic() - start < 5.0, "the GPU wait is bounded by the timeout"
    with torch.cuda.stream(streams[0]), pytest.raises(RuntimeError, match=r"timeout in plan \(GPU\): rank 0 waited "
                                                       r"for peer 1"):
        bufs[0].plan(idx[0])  # the next op raises (read from host-mapped memory, no synchronisation)
    with torch.cuda.stream(streams[0]), pytest.raises(RuntimeError, match="unusable after an earlier cross-rank"):
        bufs[0].plan(idx[0])
    with torch.cuda.stream(streams[1]):
        bufs[1].plan(idx[1])  # the late rank: its kernel sees rank 0's abort word and gives up at once
    start = time.monotonic()
    streams[1].synchronize()
    assert time.monotonic() - start < 0.5, "the late rank must not wait a second timeout"
    with torch.cuda.stream(streams[1]), pytest.raises(RuntimeError, match="rank 1 gives up: peer 0"):
        bufs[1].plan(idx[1])
    assert bufs[0]._buffer.poisoned and bufs[1]._buffer.poisoned


def _mismatch_on_both(streams, op0, op1):
    """Waits for both ranks' streams after rank 0 entered op0 and rank 1 op1 (a mismatch fails at once, not after the
    timeout); returns the message each rank's next op must raise."""
    start = time.monotonic()
    for s in streams:
        s.synchronize()
    assert time.monotonic() - start < 2.0, "a mismatch fails at once, not after the timeout"
    return {0: f"rank 0 is in {op0} of step 1 but rank 1 in {op1} of step 1",
            1: f"rank 1 is in {op1} of step 1 but rank 0 in {op0} of step 1"}


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_ranks_in_different_ops_fail_on_both():
    import torch

    bufs, streams, idx, x = _two_virtual_buffers(timeout_s=10.0)
    plans = []
    for r in range(2):
        with torch.cuda.stream(streams[r]):
            plans.append(bufs[r].plan(idx[r]))
    with torch.cuda.stream(streams[0]), torch.no_grad():
        recv = bufs[0].dispatch(plans[0], x[0])[0]
    with torch.cuda.stream(streams[1]), torch.no_grad():
        bufs[1].combine(plans[1], torch.zeros_like(recv))
    want = _mismatch_on_both(streams, "dispatch", "combine")
    for r in range(2):
        with torch.cuda.stream(streams[r]), pytest.raises(ValueError, match=want[r]):
            bufs[r].plan(idx[r])


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_ranks_that_disagree_on_plan_ordered_fail_on_both():
    """Rank 0 dispatches plan-ordered (no entry barrier), rank 1 not: the barrier rank 0 keeps carries its own tag, so
    both fail at once with a mismatch, instead of rank 0 taking rank 1's entry barrier for its exit barrier."""
    import torch

    bufs, streams, idx, x = _two_virtual_buffers(timeout_s=10.0)
    plans = []
    for r in range(2):
        with torch.cuda.stream(streams[r]):
            plans.append(bufs[r].plan(idx[r]))
    for r in range(2):
        with torch.cuda.stream(streams[r]), torch.no_grad():
            bufs[r].dispatch(plans[r], x[r], plan_ordered=r == 0)
    want = _mismatch_on_both(streams, "dispatch (plan_ordered)", "dispatch")
    for r in range(2):
        with torch.cuda.stream(streams[r]), pytest.raises(ValueError, match=re.escape(want[r])):
            bufs[r].plan(idx[r])


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
@pytest.mark.parametrize("bad", [-1, 8], ids=["minus1", "E"])
def test_gpu_bad_expert_id_raises_at_a_later_op_without_sync(bad):
    import torch

    import flatep

    device = torch.device("cuda", 0)
    buf = flatep.Buffer(None, 16, 64, 8, 2, align=1, device=device)
    idx = torch.randint(0, 8, (16, 2), device=device)
    idx[5, 1] = bad
    x = torch.randn(16, 64, device=device).to(torch.bfloat16)
    plan = buf.plan(idx)
    torch.cuda.synchronize()  # lets the GPU run the plan; the check below reads host-mapped memory only
    with pytest.raises(ValueError, match=rf"invalid expert id {bad} at topk_idx flat index 11 \(token 5, k 1\)"):
        buf.dispatch(plan, x)
    recv_x, recv_w, cu = buf.dispatch(plan, x)  # reported once; the Buffer stays usable (the entry was skipped)
    assert int(cu[-1]) == 16 * 2 - 1
    buf.check_status()  # the device copy was cleared with it


def _two_virtual_pools(timeout_s):
    """Two virtual ranks on cuda:0 with a Buffer and ExpertPools each, and a plan of one step on both."""
    import torch

    import flatep
    from flatep import virtual

    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(2, device, timeout_s=timeout_s)
    bufs = virtual.run_threads(2, lambda r: flatep.Buffer(group[r], 64, 256, 8, 2, align=1, device=device))
    pools = virtual.run_threads(2, lambda r: flatep.ExpertPools(group[r], 4, [(32, 16)], device=device))
    layers = [p.register_layer() for p in pools]
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    idx = [torch.randint(0, 8, (64, 2), generator=gen).to(device) for _ in range(2)]
    plans = []
    for r in range(2):
        with torch.cuda.stream(streams[r]):
            plans.append(bufs[r].plan(idx[r]))
    return pools, layers, streams, plans


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_pools_in_different_ops_fail_on_both():
    import torch

    pools, layers, streams, plans = _two_virtual_pools(timeout_s=10.0)
    with torch.cuda.stream(streams[0]):
        pools[0].prefetch(plans[0], layers[0])
    with torch.cuda.stream(streams[1]):
        pools[1].reduce_grad(plans[1], layers[1])
    want = _mismatch_on_both(streams, "prefetch", "reduce_grad")
    for r in range(2):
        with torch.cuda.stream(streams[r]), pytest.raises(ValueError, match=want[r]):
            pools[r].prefetch(plans[r], layers[r])
        with torch.cuda.stream(streams[r]), pytest.raises(RuntimeError,
                                                          match="unusable after an earlier cross-rank"):
            pools[r].reduce_grad(plans[r], layers[r])


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_pools_timeout_names_the_missing_rank():
    import torch

    pools, layers, streams, plans = _two_virtual_pools(timeout_s=1.0)
    for r in range(2):  # a good step of both pool ops
        with torch.cuda.stream(streams[r]):
            pools[r].prefetch(plans[r], layers[r])
    for r in range(2):
        with torch.cuda.stream(streams[r]):
            pools[r].reduce_grad(plans[r], layers[r])
    with torch.cuda.stream(streams[0]):
        pools[0].reduce_grad(plans[0], layers[0])  # rank 1 never comes
    start = time.monotonic()
    streams[0].synchronize()
    assert time.monotonic() - start < 5.0, "the GPU wait is bounded by the timeout"
    with torch.cuda.stream(streams[0]), pytest.raises(RuntimeError, match=r"timeout in reduce_grad \(GPU\): rank 0 "
                                                       r"waited for peer 1"):
        pools[0].prefetch(plans[0], layers[0])
    with torch.cuda.stream(streams[1]):
        pools[1].reduce_grad(plans[1], layers[1])  # the late rank sees rank 0's abort word and gives up at once
    start = time.monotonic()
    streams[1].synchronize()
    assert time.monotonic() - start < 0.5, "the late rank must not wait a second timeout"
    with torch.cuda.stream(streams[1]), pytest.raises(RuntimeError, match="rank 1 gives up: peer 0"):
        pools[1].prefetch(plans[1], layers[1])

