"""benchmarks/common/bench_timing.py, the Python benchmarks' one timer: its host-clock half on the CPU, and on a GPU
the per-rank timing of work on virtual ranks' streams from a gated start (both gate forms) and of a single call.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_bench_timing.py
"""

import os
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks", "common"))

import bench_timing  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_host_clock():
    ms, out = bench_timing.wall_ms(lambda: time.sleep(0.02) or 7)
    assert out == 7 and 15 < ms < 2000
    a = bench_timing.stamp(False)
    time.sleep(0.01)
    assert bench_timing.elapsed_ms(a, bench_timing.stamp(False)) >= 5
    assert bench_timing.summary([3.0, 1.0, 2.0, 10.0]) == dict(median=2.5, min=1.0, max=10.0)
    assert bench_timing.RankTimes([1.0, 4.0, 2.0]).max_ms == 4.0


@cuda
def test_calls_and_ranks_on_a_gpu():
    x = torch.randn(1024, 1024, device="cuda")
    calls = []
    times = bench_timing.time_calls(lambda: x @ x, iters=3, warmup=2, before=lambda: calls.append(1))
    assert len(times) == 3 and len(calls) == 3 and all(t > 0 for t in times)
    streams = [torch.cuda.Stream() for _ in range(3)]
    cycles = bench_timing.gate_cycles(0, 0.005)
    for gate in (None, torch.cuda.Stream()):
        t = bench_timing.ranks_together(streams, lambda r: (x * r).sum(), cycles, gate_stream=gate)
        assert len(t.ms) == 3 and all(ms > 0 for ms in t.ms) and t.max_ms == max(t.ms)
        assert [float(o) for o in t.out] == pytest.approx([float((x * r).sum()) for r in range(3)], rel=1e-4)
    ms, out = bench_timing.time_on_stream(streams[0], lambda: 5)
    assert out == 5 and ms >= 0
