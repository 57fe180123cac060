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
import torch

import mp_cases
import step_graph_cases as sg

CUDA_SKIP = mp_cases.cuda_unavailable_reason()


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_whole_step_replays_bitwise_on_virtual_ranks():
    from flatep import testing, virtual

    R = 4
    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(R, device, timeout_s=30)
    models = virtual.run_threads(R, lambda r: sg.TwoLayerModel(group[r], device))
    steps = [sg.StaticStep(models[r], device) for r in range(R)]
    streams = [torch.cuda.Stream(device) for _ in range(R)]

    def eager(trial, threads=False):
        for r in range(R):
            steps[r].write_inputs(r, trial)
        torch.cuda.synchronize()

        def run(r):
            with torch.cuda.stream(streams[r]):
                steps[r].step()

        if threads:
            virtual.run_threads(R, run)
        else:
            for r in range(R):  # one thread enqueues every rank's whole step, forward and backward
                run(r)
        torch.cuda.synchronize()

    # Warm-up, one thread per rank: the first step loads torch's kernels (router, norms, grouped GEMMs, ...), and
    # under lazy module loading a load may wait for the kernels running in the context, among them a rank's plan
    # spinning for a peer that only this thread would enqueue next (flatep.virtual's docstring). Afterwards .grad
    # exists and every kernel is loaded, and one thread drives all ranks.
    eager(0, threads=True)
    eager(1)
    graphs = [sg.capture(steps[r], streams[r]) for r in range(R)]
    torch.cuda.synchronize()
    seen = set()
    for trial in range(2, 2 + sg.TRIALS):
        for r in range(R):
            steps[r].write_inputs(r, trial)
        torch.cuda.synchronize()
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        replayed = [steps[r].results(replayed=True) for r in range(R)]
        eager(trial)
        for r in range(R):
            err = sg.compare(replayed[r], steps[r].results(), f"rank {r} trial {trial}")
            assert err is None, err
            err = sg.check_rows(models[r], R)
            assert err is None, f"rank {r} trial {trial}: {err}"
        seen.add(tuple(replayed[0][-1].tolist()))  # rank 0's last layer's cu_seqlens of this replay
    assert len(seen) >= 4, f"the replays ran only {len(seen)} distinct plans: the routing did not change"
    for m in models:
        for moe in m.moes:
            moe.buffer.check_status()
    testing.release_all()


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_whole_step_replays_bitwise_in_processes(tmp_path):
    from flatep import testing

    R = 2
    out = str(tmp_path / "step_graph.json")
    testing.spawn(sg.run_processes, R, out)
    with open(out) as f:
        errors = json.load(f)
    assert errors == [[]] * R, errors
