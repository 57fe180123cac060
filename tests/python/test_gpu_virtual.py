"""Virtual ranks and pools that just work on a GPU (issue 46), in the environment a user has:

* a user's two-layer model (RMSNorm, residuals, two nn.MoE, loss, backward) on 4 virtual ranks in a fresh python3
  with CUDA_MODULE_LOADING unset: the first eager step does not hang, a whole step captured as one CUDA graph per rank
  replays bitwise equal to eager, and nothing on stderr says "[flatep warning]" (the interpreter's exit included);
* when CUDA started lazily before flatep.virtual was imported, virtual_ranks says so in one line, once;
* ExpertPools built and a layer registered on fresh threads of virtual ranks (no torch call on those threads), then
  prefetch and reduce_grad bitwise equal to the CPU backend's;
* 30 create/destroy cycles of virtual ranks, Buffer, ExpertPools and a layer leave device memory flat and print no
  warning.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_virtual.py   (scripts/device.sh virtual_gpu)
"""

import gc
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import flatep
import mp_cases
from flatep import _C, virtual

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_SKIP = mp_cases.cuda_unavailable_reason()
cuda = pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
WARNING = "[flatep warning]"


def user_env():
    """This process's environment without the CUDA settings a user does not have (flatep.virtual picks them)."""
    env = dict(os.environ)
    for name in ("CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [HERE] + sys.path if p)
    env["FLATEP_TIMEOUT_S"] = "30"  # a hung first step fails in 30 s, not 100
    return env


@pytest.mark.cuda
@cuda
def test_user_model_first_step_and_graph_replays_in_a_fresh_interpreter(tmp_path):
    out = tmp_path / "virtual_gpu.json"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.join(HERE, "virtual_gpu_cases.py"), str(out)], env=user_env(),
                          capture_output=True, text=True, timeout=240)
    seconds = time.monotonic() - start
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"exit {proc.returncode} after {seconds:.1f} s:\n{tail}"
    result = json.loads(out.read_text())
    assert result["errors"] == [], result["errors"]
    assert result["module_loading"] in ("EAGER", None), result
    assert WARNING not in proc.stderr, proc.stderr[-4000:]
    assert "RuntimeWarning" not in proc.stderr, proc.stderr[-4000:]
    print(f"first step {result['first_step_s']:.2f} s, whole run {seconds:.1f} s, {result['rms_norm']}")


LAZY_SCRIPT = """
import warnings, torch
torch.zeros(1, device="cuda:0")  # CUDA starts (lazily: torch's default) before flatep.virtual is imported
from flatep import virtual
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    virtual.virtual_ranks(2, "cuda:0")
    virtual.virtual_ranks(2, "cuda:0")
print(virtual.cuda_module_loading())
for w in caught:
    print(w.category.__name__, str(w.message))
"""


@pytest.mark.cuda
@cuda
def test_lazy_loading_is_named_once_in_one_line_with_the_fix():
    proc = subprocess.run([sys.executable, "-c", LAZY_SCRIPT], env=user_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "LAZY", lines
    assert len(lines) == 2, lines  # one warning for two virtual_ranks calls
    assert lines[1].startswith("RuntimeWarning flatep.virtual: CUDA loads modules lazily"), lines[1]
    assert "CUDA_MODULE_LOADING=EAGER" in lines[1], lines[1]


def _pools_step(device, R, epn, shapes, S, H, K):
    """ExpertPools built and a layer registered on fresh threads, then one prefetch and one reduce_grad: per rank and
    projection, (weights view after prefetch, grads view after reduce_grad) on the CPU."""
    E = R * epn
    group = virtual.virtual_ranks(R, device, timeout_s=30)
    # The C++ objects straight from fresh threads: nothing on these threads touched torch or CUDA before.
    raw = virtual.run_threads(R, lambda r: _C.ExpertPools(group[r].transport, epn, shapes))
    raw_layers = virtual.run_threads(R, lambda r: raw[r].register_layer())
    assert all(raw_layers[r].weights(0) != 0 for r in range(R))
    del raw_layers, raw
    # The documented way, each call on fresh threads too.
    pools = virtual.run_threads(R, lambda r: flatep.ExpertPools(group[r], epn, shapes, device=device))
    layers = virtual.run_threads(R, lambda r: pools[r].register_layer())
    buffers = virtual.run_threads(R, lambda r: flatep.Buffer(group[r], S, H, E, K, align=1, device=device))
    gen = torch.Generator().manual_seed(46)
    idx = [flatep.testing.sample_topk(E, S, K, r, sigma=2.0, seed=5).long() for r in range(R)]
    with torch.no_grad():
        for r in range(R):
            for p, (rows, cols) in enumerate(shapes):
                layers[r].own_weights(p).copy_(torch.randn(epn, rows, cols, generator=gen).to(torch.bfloat16))
                layers[r].grads(p).copy_(torch.randn(2 * epn, rows, cols, generator=gen))
    if device == "cpu":
        plans = virtual.run_threads(R, lambda r: buffers[r].plan(idx[r]))
        virtual.run_threads(R, lambda r: pools[r].prefetch(plans[r], layers[r]))
        weights = [[layers[r].weights(p).detach().clone() for p in range(len(shapes))] for r in range(R)]
        virtual.run_threads(R, lambda r: pools[r].reduce_grad(plans[r], layers[r]))
    else:
        streams = [torch.cuda.Stream(device) for _ in range(R)]
        idx = [i.to(device) for i in idx]
        torch.cuda.synchronize()
        plans = []
        for r in range(R):  # one thread enqueues every rank's ops, each on its own stream
            with torch.cuda.stream(streams[r]):
                plans.append(buffers[r].plan(idx[r]))
                pools[r].prefetch(plans[r], layers[r])
        torch.cuda.synchronize()
        weights = [[layers[r].weights(p).cpu() for p in range(len(shapes))] for r in range(R)]
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                pools[r].reduce_grad(plans[r], layers[r])
        torch.cuda.synchronize()
    grads = [[layers[r].grads(p).detach().cpu().clone() for p in range(len(shapes))] for r in range(R)]
    replicas = plans[0].stats["replicas"]
    return weights, grads, replicas


@pytest.mark.cuda
@cuda
def test_pools_built_on_fresh_threads_match_the_cpu_backend(capfd):
    R, epn, shapes, S, H, K = 4, 2, [(16, 24), (24, 8)], 64, 32, 2
    want_w, want_g, replicas = _pools_step("cpu", R, epn, shapes, S, H, K)
    got_w, got_g, gpu_replicas = _pools_step("cuda:0", R, epn, shapes, S, H, K)
    assert replicas > 0 and gpu_replicas == replicas
    for r in range(R):
        for p in range(len(shapes)):
            assert torch.equal(got_w[r][p].view(torch.int16), want_w[r][p].view(torch.int16)), f"weights r{r} p{p}"
            assert torch.equal(got_g[r][p].view(torch.int32), want_g[r][p].view(torch.int32)), f"grads r{r} p{p}"
    gc.collect()
    torch.cuda.synchronize()
    assert WARNING not in capfd.readouterr().err


def _cycle(device):
    group = virtual.virtual_ranks(4, device, timeout_s=30)
    buffers = virtual.run_threads(4, lambda r: flatep.Buffer(group[r], 64, 256, 8, 2, align=8, device=device))
    pools = virtual.run_threads(4, lambda r: flatep.ExpertPools(group[r], 2, [(256, 128), (128, 256)], device=device))
    layers = virtual.run_threads(4, lambda r: pools[r].register_layer())
    del layers, pools, buffers, group
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.cuda
@cuda
def test_create_destroy_cycles_leave_device_memory_flat(capfd):
    device = "cuda:0"
    granularity = 2 << 20  # the VMM allocation granularity on H100/H200 (every allocation rounds up to it)
    _cycle(device)
    first = torch.cuda.mem_get_info(0)[0]
    for _ in range(29):
        _cycle(device)
    last = torch.cuda.mem_get_info(0)[0]
    assert abs(first - last) <= granularity, f"free device memory {first} after the first cycle, {last} after 30"
    assert WARNING not in capfd.readouterr().err
