"""Issue 46's user model on virtual ranks, run as a user would: a fresh python3 with CUDA_MODULE_LOADING unset
(module level, so that tests/python/test_gpu_virtual.py can start it as a script).

Model: two layers of x + flatep.nn.MoE(RMSNorm(x)) (torch.nn.RMSNorm where torch has it, else the same norm by
hand), a final norm, an MSE loss, backward through everything. R virtual ranks on cuda:0, one thread enqueuing every
rank's step on the rank's own stream. The very first step is eager, with the model's own torch kernels launched for
the first time between two ranks' ops: it must not hang (flatep.virtual makes module loading eager when imported
before CUDA starts). Then a whole step is captured as one CUDA graph per rank and replayed with new inputs: output,
input gradient, router and norm gradients and every expert main_grad bitwise equal to the same step run eagerly.

    python3 tests/python/virtual_gpu_cases.py OUT.json      # writes {"errors": [...], ...}; exit 1 on errors
"""

import json
import sys
import time

import torch

import flatep
from flatep import virtual
import step_graph_cases as sg

R, TRIALS = 4, 3


class HandRMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm(H, eps) for torch versions without it (torch < 2.4)."""

    def __init__(self, hidden, eps, device):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden, device=device))

    def forward(self, x):
        return sg.rms_norm(x, self.weight, self.eps)


def rms_norm_module(hidden, device, eps=1e-6):
    if hasattr(torch.nn, "RMSNorm"):
        return torch.nn.RMSNorm(hidden, eps=eps, device=device)
    return HandRMSNorm(hidden, eps, device)


class NormMoEModel(torch.nn.Module):
    """The issue's model: per layer h = h + MoE(RMSNorm(h)); then a final RMSNorm. step_graph_cases.StaticStep drives
    it (same sizes, same inputs)."""

    def __init__(self, group, device, seed=0):
        super().__init__()
        self.norms = torch.nn.ModuleList(rms_norm_module(sg.H, device) for _ in range(sg.LAYERS + 1))
        self.moes = torch.nn.ModuleList(
            flatep.nn.MoE(sg.H, sg.F, sg.E, sg.K, group=group, num_tokens=sg.S, align=sg.ALIGN, seed=seed + 10 * i,
                          device=device)
            for i in range(sg.LAYERS)
        )
        with torch.no_grad():  # norm weights away from 1, so that their gradients matter
            g = torch.Generator().manual_seed(seed + 99)
            for norm in self.norms:
                norm.weight.copy_(1 + 0.1 * torch.randn(sg.H, generator=g))

    def forward(self, x, idx):
        h = x
        for i, moe in enumerate(self.moes):
            h = h + moe(self.norms[i](h), idx[i])
        return self.norms[sg.LAYERS](h)


def run(out_path):
    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(R, device, timeout_s=30)
    models = virtual.run_threads(R, lambda r: NormMoEModel(group[r], device))
    steps = [sg.StaticStep(models[r], device) for r in range(R)]
    streams = [torch.cuda.Stream(device) for _ in range(R)]

    def eager(trial):
        for r in range(R):
            steps[r].write_inputs(r, trial)
        torch.cuda.synchronize()
        for r in range(R):  # one thread enqueues every rank's whole step, forward and backward
            with torch.cuda.stream(streams[r]):
                steps[r].step()
        torch.cuda.synchronize()

    start = time.monotonic()
    eager(0)  # the first step: every torch kernel of the model launches here for the first time
    first_step_s = time.monotonic() - start
    eager(1)
    graphs = [sg.capture(steps[r], streams[r]) for r in range(R)]
    torch.cuda.synchronize()
    errors = []
    for trial in range(2, 2 + TRIALS):
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
            err = sg.compare(replayed[r], steps[r].results(), f"rank {r} trial {trial}") or sg.check_rows(models[r], R)
            if err:
                errors.append(err)
    for m in models:
        for moe in m.moes:
            moe.buffer.check_status()
    with open(out_path, "w") as f:
        json.dump({"errors": errors, "first_step_s": first_step_s, "module_loading": virtual.cuda_module_loading(),
                   "rms_norm": type(models[0].norms[0]).__name__}, f)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1]))
