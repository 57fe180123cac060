"""examples/train_moe.py runs across 2 processes (on the CPU, and on CUDA where available: both processes on cuda:0),
prints per-step loss and rank loads, and its loss curve matches the dense reference.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 examples/train_moe.py --steps 4 [--device cuda]
"""

import os
import subprocess
import sys

import pytest

import flatep
import mp_cases

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CUDA_SKIP = mp_cases.cuda_unavailable_reason()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")]
        ),
    ],
)
def test_train_moe_example_runs_and_matches_reference(device):
    # The directories this process imports flatep from (the source package and the compiled extension).
    paths = [os.path.dirname(p) for p in flatep.__path__] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    steps = 4
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_moe.py"), "--steps", str(steps), "--ranks", "2",
         "--experts", "8", "--tokens", "32", "--device", device],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    step_lines = [l for l in lines if l.startswith("step ") and "rank loads [64, 64]" in l]
    assert len(step_lines) == steps, proc.stdout  # exact mode: 32 tokens * K=2 rows on each rank, every step
    assert lines[-1].endswith(": OK"), proc.stdout
