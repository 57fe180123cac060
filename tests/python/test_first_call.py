"""A plain program from the README, run as a user runs it: every case of tests/python/first_call_cases.py in a fresh
interpreter, FlatEP's first call of that process, no warm-up, CUDA's module loading and connections as the user has
them (unset), FLATEP_TIMEOUT_S=30 so that a first step that hangs fails within the test's limit. Virtual ranks (one
persistent thread and stream per rank) and processes (one per rank); some rank empty at the first step; a serving
step captured as a CUDA graph per rank from the rank's own thread and replayed with new routing, bitwise against
eager (CUDA only).

On the CPU backend (CI) the same programs check the cases themselves against the dense reference; on a GPU
(`python3 -m pytest -q tests/python/test_first_call.py -m cuda`, scripts/device.sh first_call) they are
the issue's failures: an empty rank's first step and a capture from user code.
"""

import json
import os
import subprocess
import sys

import pytest

import first_call_cases
import mp_cases

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_SKIP = mp_cases.cuda_unavailable_reason()
CPU_PROCESS_CASES = ("train_empty", "switch_planners")  # spawning 4 processes costs ~12 s a case on the CPU


def user_env():
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [HERE] + sys.path if p)
    env["FLATEP_TIMEOUT_S"] = "30"
    return env


def run_case(case, mode, device, tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "first_call_cases.py"), case, mode, device,
                           str(tmp_path)], env=user_env(), capture_output=True, text=True, timeout=300)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"{case} {mode} {device}: exit {proc.returncode}:\n{tail}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["errors"] == [], result["errors"]
    assert "[flatep warning]" not in proc.stderr, tail
    return result


@pytest.mark.parametrize("case", sorted(first_call_cases.CASES))
def test_first_call_on_virtual_ranks_cpu(case, tmp_path):
    run_case(case, "virtual", "cpu", tmp_path)


@pytest.mark.parametrize("case", CPU_PROCESS_CASES)
def test_first_call_on_processes_cpu(case, tmp_path):
    run_case(case, "processes", "cpu", tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
@pytest.mark.parametrize("mode", ["virtual", "processes"])
@pytest.mark.parametrize("case", sorted(first_call_cases.CASES))
def test_first_call_on_cuda(case, mode, tmp_path):
    result = run_case(case, mode, "cuda", tmp_path)
    if case == "capture":
        assert result["replays"] == first_call_cases.CASES[case][0] * first_call_cases.REPLAYS, result
