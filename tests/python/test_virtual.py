"""flatep.virtual: R ranks as threads of one process over the ipc transport (CPU backend here; the same code runs
on one GPU in benchmarks/layer/moe_layer_virtual.py).

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_virtual.py
"""

import time

import pytest
import torch

import flatep
from flatep import _C, testing, virtual

S, H, E, K = 24, 32, 16, 2


@pytest.mark.parametrize("R", [2, 4])
def test_virtual_ranks_run_the_data_plane(R):
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=20)
    assert [(v.rank, v.size) for v in ranks] == [(r, R) for r in range(R)]
    bufs = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, H, E, K, align=8))
    assert [b.rank for b in bufs] == list(range(R))
    idx = [testing.sample_topk(E, S, K, r, sigma=1.5, seed=3).long() for r in range(R)]
    x = [torch.randn(S, H, generator=torch.Generator().manual_seed(r)).bfloat16() for r in range(R)]
    plans = virtual.run_threads(R, lambda r: bufs[r].plan(idx[r]))
    assert plans[0].stats["loads"] == [S * K] * R  # exact mode: every rank computes S*K rows
    with torch.no_grad():
        recv = virtual.run_threads(R, lambda r: bufs[r].dispatch(plans[r], x[r], None))
        # Unweighted combine of the dispatched rows themselves: each token gets its K copies back, summed in fp32:
        # K * x exactly (K = 2 scales a bf16 value exactly).
        out = virtual.run_threads(R, lambda r: bufs[r].combine(plans[r], recv[r][0]))
    for r in range(R):
        assert torch.equal(out[r], (x[r].float() * K).bfloat16()), r
    pools = virtual.run_threads(R, lambda r: flatep.ExpertPools(ranks[r], E // R, [(H, 8)]))
    layers = [p.register_layer() for p in pools]
    epn = E // R
    for r in range(R):
        with torch.no_grad():
            layers[r].own_weights(0).copy_(torch.arange(epn, dtype=torch.float32).view(epn, 1, 1) + 100 * r)
    virtual.run_threads(R, lambda r: pools[r].prefetch(plans[r], layers[r]))
    replicas = 0
    for r in range(R):
        for j, e in enumerate(plans[r].slot_expert.tolist()):
            if e >= 0:  # slot j holds expert e: its owner's weights, whose value encodes (owner, local index)
                replicas += 1
                owner, local = divmod(e, epn)
                assert torch.all(layers[r].weights(0)[epn + j] == 100 * owner + local), (r, j, e)
    assert replicas == plans[0].stats["replicas"] and replicas > 0


def test_same_process_ranks_need_the_opt_in():
    rv = virtual._Rendezvous(2, 10.0)
    with pytest.raises(ValueError, match=r"ranks 1 and 0 are the same process \(pid \d+\); use the local transport"):
        virtual.run_threads(2, lambda r: _C.make_ipc_transport(virtual.ThreadBootstrap(rv, r), "host", 5.0))


def test_virtual_ranks_arguments():
    with pytest.raises(ValueError, match=r"virtual_ranks: num_ranks must be an int in \[1, 64\], got 0"):
        virtual.virtual_ranks(0)
    with pytest.raises(ValueError, match=r"virtual_ranks: device must be 'cpu' or a CUDA device, got meta"):
        virtual.virtual_ranks(2, "meta")
    with pytest.raises(ValueError, match=r"virtual_ranks: 3 ranks cannot be split evenly over devices"):
        virtual.virtual_ranks(3, ["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"virtual_ranks: devices must be one 'cpu' or CUDA devices only"):
        virtual.virtual_ranks(2, ["cpu", "cpu"])
    ranks = virtual.virtual_ranks(1, "cpu")
    with pytest.raises(ValueError, match=r"device cuda:0 differs from the virtual rank's device cpu"):
        flatep.Buffer(ranks[0], S, H, E, K, device="cuda:0")


def test_a_missing_virtual_rank_times_out():
    rv = virtual._Rendezvous(2, 0.5)
    boot = virtual.ThreadBootstrap(rv, 0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"virtual rank 0: all_gather: not every one of 2 ranks arrived within 0.5 s"):
        boot.all_gather(b"x")
    elapsed = time.monotonic() - start
    assert 0.5 <= elapsed < 2.0, f"gave up after {elapsed:.2f} s, timeout 0.5 s"


def test_run_threads_raises_the_first_rank_error_with_the_others_as_notes():
    def fn(r):
        if r == 0:
            return "fine"
        if r == 1:
            raise ValueError("rank one failed\nsecond line")
        raise RuntimeError(f"rank {r} timed out")

    with pytest.raises(ValueError, match="rank one failed") as info:
        virtual.run_threads(4, fn)
    if hasattr(info.value, "add_note"):  # Python >= 3.11
        assert info.value.__notes__ == ["virtual rank 2: RuntimeError: rank 2 timed out",
                                        "virtual rank 3: RuntimeError: rank 3 timed out"]
    assert virtual.run_threads(3, lambda r: r * r) == [0, 1, 4]


def test_importing_virtual_before_cuda_makes_module_loading_eager_unless_set():
    """Read when CUDA starts: flatep.virtual sets CUDA_MODULE_LOADING=EAGER (and CUDA_DEVICE_MAX_CONNECTIONS=32) at
    import when CUDA has not started and the user set nothing; a user's own setting stays."""
    import os
    import subprocess
    import sys

    code = "import os, flatep.virtual; print(os.environ.get('CUDA_MODULE_LOADING'))"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    unset = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert unset.stdout.strip() == "EAGER"
    env["CUDA_MODULE_LOADING"] = "LAZY"
    kept = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert kept.stdout.strip() == "LAZY"


def test_lazy_module_loading_is_named_once_in_one_line(monkeypatch):
    import warnings

    monkeypatch.setattr(virtual, "_warned_lazy", False)
    monkeypatch.setattr(virtual, "cuda_module_loading", lambda: "EAGER")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        virtual._warn_if_lazy()  # eager: nothing to say
    monkeypatch.setattr(virtual, "cuda_module_loading", lambda: "LAZY")
    with pytest.warns(RuntimeWarning) as record:
        virtual._warn_if_lazy()
        virtual._warn_if_lazy()
    assert len(record) == 1
    text = str(record[0].message)
    assert "\n" not in text and text.startswith("flatep.virtual: CUDA loads modules lazily")
    assert "set CUDA_MODULE_LOADING=EAGER" in text


def test_pools_and_layers_build_on_fresh_threads():
    """Every ExpertPools and register_layer call on a thread of its own (the CPU half of test_gpu_virtual.py)."""
    R, epn = 3, 2
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=20)
    pools = virtual.run_threads(R, lambda r: flatep.ExpertPools(ranks[r], epn, [(8, 16), (16, 8)]))
    layers = virtual.run_threads(R, lambda r: pools[r].register_layer())
    for r in range(R):
        view = layers[r].weights(0)
        assert view.shape == (2 * epn, 8, 16) and torch.count_nonzero(view) == 0
        layers[r].own_weights(0)[1, 2, 3] = 5.0
        assert view[1, 2, 3] == 5.0  # own part of the view
        view[epn, 0, 0] = 7.0
        assert pools[r].slot_pool(0)[0, 0, 0] == 7.0  # slot 0 of the pool, right after the own experts



def test_create_destroy_cycles_leak_no_descriptors_or_mappings():
    """The CPU twin of test_gpu_virtual.py's leak check: virtual ranks, Buffers, ExpertPools and a layer built and
    dropped 30 times leave this process's open files and memory mappings as they were after the first cycle."""
    import gc
    import os

    def cycle():
        ranks = virtual.virtual_ranks(3, "cpu", timeout_s=20)
        bufs = virtual.run_threads(3, lambda r: flatep.Buffer(ranks[r], S, H, 6, K, align=8))
        pools = virtual.run_threads(3, lambda r: flatep.ExpertPools(ranks[r], 2, [(H, 8), (8, H)]))
        layers = virtual.run_threads(3, lambda r: pools[r].register_layer())
        del layers, pools, bufs, ranks
        gc.collect()

    def counts():
        with open("/proc/self/maps") as maps:
            return len(os.listdir("/proc/self/fd")), sum(1 for _ in maps)

    cycle()
    first = counts()
    for _ in range(29):
        cycle()
    assert counts() == first


def test_each_rank_runs_on_the_same_thread_for_the_life_of_the_process():
    """What a rank leaves on its thread (thread-local state, like a current CUDA stream or cuBLAS's handle) is there
    at its next call: run_threads keeps one thread per rank."""
    import threading

    local = threading.local()
    first = virtual.run_threads(3, lambda r: (threading.get_ident(), setattr(local, "mine", r * 10)))
    again = virtual.run_threads(3, lambda r: (threading.get_ident(), getattr(local, "mine", None)))
    assert [t for t, _ in again] == [t for t, _ in first]
    assert [m for _, m in again] == [0, 10, 20]
    assert len({t for t, _ in first}) == 3 and threading.get_ident() not in {t for t, _ in first}


def test_run_threads_inside_run_threads_is_refused():
    with pytest.raises(RuntimeError, match=r"run_threads: called on virtual rank thread 1, inside another"):
        virtual.run_threads(2, lambda r: virtual.run_threads(2, lambda q: q) if r == 1 else None)
    with pytest.raises(ValueError, match=r"run_threads: num_ranks must be in \[1, 64\], got 0"):
        virtual.run_threads(0, lambda r: r)


def _rows(r, n, seed=0):
    return torch.randn(n, 5, generator=torch.Generator().manual_seed(100 * seed + r))


def test_collectives_give_torch_distributed_results():
    R = 4
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=20)
    values = [_rows(r, 7) for r in range(R)]
    summed = virtual.run_threads(R, lambda r: ranks[r].all_reduce(values[r].clone()))
    expected = values[0].clone()
    for v in values[1:]:
        expected += v  # rank order: every rank gets these bits
    for r in range(R):
        assert torch.equal(summed[r], expected), r
    # all_to_all_single: rank r sends (r + p) % 3 rows to rank p
    send = [[(r + p) % 3 for p in range(R)] for r in range(R)]
    inputs = [_rows(r, sum(send[r]), seed=1) for r in range(R)]

    def a2a(r):
        recv = [send[p][r] for p in range(R)]
        out = torch.full((sum(recv), 5), float("nan"))
        return ranks[r].all_to_all_single(out, inputs[r], recv, send[r])

    got = virtual.run_threads(R, a2a)
    for r in range(R):
        parts = []
        for p in range(R):
            lo = sum(send[p][:r])
            parts.append(inputs[p][lo:lo + send[p][r]])
        assert torch.equal(got[r], torch.cat(parts)), r
    gathered = virtual.run_threads(R, lambda r: ranks[r].all_gather(values[r]))
    assert all(torch.equal(g, v) for g, v in zip(gathered[2], values))
    sent = virtual.run_threads(R, lambda r: ranks[r].broadcast(values[r].clone(), 2))
    assert all(torch.equal(s, values[2]) for s in sent)
    assert virtual.run_threads(R, lambda r: ranks[r].all_gather_object({"r": r})) == [[{"r": p} for p in range(R)]] * R


def test_collectives_refuse_disagreeing_ranks_on_every_rank():
    R = 3
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=20)

    def mixed(r):
        if r == 2:
            return ranks[r].barrier()
        return ranks[r].all_reduce(torch.ones(2))

    with pytest.raises(RuntimeError, match=r"virtual rank 0: all_reduce #1 met rank 2's barrier #1: every rank must "
                                           r"call the same collectives in the same order") as info:
        virtual.run_threads(R, mixed)
    if hasattr(info.value, "__notes__"):  # every rank refuses, none waits
        assert [n.split(":")[0] for n in info.value.__notes__] == ["virtual rank 1", "virtual rank 2"]
        assert all("every rank must call the same collectives" in n for n in info.value.__notes__)

    def sizes(r):  # rank 1 expects 2 rows from rank 0, which sends it 1
        send = [1, 1, 1]
        recv = [2 if (r, p) == (1, 0) else 1 for p in range(R)]
        return ranks[r].all_to_all_single(torch.zeros(sum(recv)), torch.ones(3), recv, send)

    with pytest.raises(ValueError, match=r"virtual rank 1: all_to_all_single: rank 0 sends 1 rows here, "
                                         r"output_split_sizes\[0\] is 2"):
        virtual.run_threads(R, sizes)
    # the world still works after those failures
    assert [t.tolist() for t in virtual.run_threads(R, lambda r: ranks[r].all_reduce(torch.ones(1)))] == [[3.0]] * 3


def test_a_rank_that_fails_before_a_collective_is_named_by_the_others():
    R = 3
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=20)

    def step(r):
        if r == 1:
            raise KeyError("rank one broke")
        return ranks[r].all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises(KeyError) as info:
        virtual.run_threads(R, step)
    assert time.monotonic() - start < 10, "the peers waited for the timeout instead of failing at once"
    if hasattr(info.value, "__notes__"):
        assert info.value.__notes__ == [f"virtual rank {r}: PeerFailed: virtual rank {r}: all_reduce: rank 1 "
                                        f"(KeyError: 'rank one broke') failed" for r in (0, 2)]


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    R = 2
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"virtual rank 0: barrier \(posting\): rank 1 did not arrive within 0.5 s"):
        virtual.run_threads(R, lambda r: ranks[r].barrier() if r == 0 else None)
    assert time.monotonic() - start < 5


def test_a_call_after_failed_calls_names_only_its_own_failures():
    """A world reused after failed calls (run_threads resets its meeting first): what a later call's collective reports
    comes from that call alone. Rank 1 fails a call, then rank 0 fails the next one: rank 1's PeerFailed names rank 0
    only; then rank 1 just stays away: rank 0's is a PeerTimeout (not a PeerFailed) naming it; then both are there."""
    R = 2
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=0.5)
    seen = {}

    def step(bad, fail):
        def run(r):
            if r == bad:
                if fail:
                    raise KeyError(f"rank {r} broke")
                return None
            try:
                ranks[r].barrier()
            except virtual.PeerTimeout as e:
                seen[r] = (type(e), str(e))
                raise
        return run

    for bad in (1, 0):
        seen.clear()
        with pytest.raises(KeyError):
            virtual.run_threads(R, step(bad, fail=True))
        other = 1 - bad
        assert seen == {other: (virtual.PeerFailed,
                                f"virtual rank {other}: barrier: rank {bad} (KeyError: 'rank {bad} broke') failed")}
    seen.clear()
    with pytest.raises(virtual.PeerTimeout):
        virtual.run_threads(R, step(1, fail=False))
    assert seen == {0: (virtual.PeerTimeout, "virtual rank 0: barrier (posting): rank 1 did not arrive within 0.5 s")}
    assert [t.tolist() for t in virtual.run_threads(R, lambda r: ranks[r].all_reduce(torch.ones(1)))] == [[2.0]] * 2


def test_collective_ops_of_rank_threads_meet_on_the_host_first():
    """flatep._bootstrap.arrive (every collective op calls it): on a CUDA device, an op on a virtual rank's own thread
    waits on the host until every rank reached its op, so no rank's kernel can wait on the device for a peer whose
    thread is still in work that blocks on the GPU (a cuBLAS handle, a kernel's first load); elsewhere it returns at
    once. The CPU stands in for the device here: a group that says "cuda"."""
    import threading
    import types

    from flatep import _bootstrap

    R = 3
    meeting = virtual._Meeting(R, 5.0)
    groups = [types.SimpleNamespace(rank=r, device=torch.device("cuda", 0), _meeting=meeting) for r in range(R)]
    order = []
    lock = threading.Lock()

    def op(r):
        if r == 2:
            time.sleep(0.3)  # the late rank: the others must not get past their op before it arrives
        with lock:
            order.append(("at", r))
        _bootstrap.arrive(groups[r], "plan")
        with lock:
            order.append(("past", r))

    virtual.run_threads(R, op)
    assert [kind for kind, _ in order[:R]] == ["at"] * R, order
    # off a rank thread (one thread enqueueing every rank's op, autograd's backward thread): no wait at all
    start = time.monotonic()
    _bootstrap.arrive(groups[0], "plan")
    cpu_group = types.SimpleNamespace(rank=0, device=torch.device("cpu"), _meeting=meeting)
    virtual.run_threads(1, lambda r: _bootstrap.arrive(cpu_group, "plan"))
    assert time.monotonic() - start < 1.0
