"""A whole training step through the public API (two nn.MoE layers with norms and residuals, a loss, backward
through everything, router and experts included) captured as one torch.cuda.graph per rank under capture_error_mode
"global" (any allocation, synchronising copy or device synchronisation inside a FlatEP op fails the capture), then
replayed 20 times with new tokens and new routing at different skews written into the static inputs: the loss, the
output, every gradient (router, norms, the experts' main_grad, the input) and the plans are bitwise those of the same
step run eagerly. Virtual ranks driven by one thread, and R processes sharing the GPU.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_step_graph.py
"""

import json

import pytest

import mp_cases
import step_graph_cases as sg

CUDA_SKIP = mp_cases.cuda_unavailable_reason()


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_whole_step_replays_bitwise_on_virtual_ranks(tmp_path, monkeypatch):
    from flatep import testing

    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")  # the child's environment from its start (run_virtual says why)
    out = str(tmp_path / "step_graph_virtual.json")
    testing.spawn(sg.run_virtual, 1, out)  # a fresh process: see run_virtual on module loading
    with open(out) as f:
        result = json.load(f)
    assert result["errors"] == [], result["errors"]
    assert result["distinct_plans"] >= 4, f"the replays ran only {result['distinct_plans']} distinct plans"


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_whole_step_replays_bitwise_in_processes(tmp_path):
    R = 2
    errors = sg.errors_in_processes(str(tmp_path / "step_graph.json"), R)
    assert errors == [[]] * R, errors
