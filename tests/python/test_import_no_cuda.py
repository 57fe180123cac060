"""Importing flatep (every module) must not start CUDA: CUDA_MODULE_LOADING and CUDA_DEVICE_MAX_CONNECTIONS take
effect only when set before the driver starts, and flatep.virtual and the virtual-rank tests set them after their
imports (a module that called torch.cuda.is_available() at import made both settings dead, and virtual ranks driven
by one thread then deadlocked at a torch kernel's lazy load).

Two checks in a fresh interpreter: torch's entry points that start the driver raise if called during the imports
(every machine); and where the CUDA driver library exists, cuDeviceGetCount still answers
CUDA_ERROR_NOT_INITIALIZED after the imports (the driver itself was never initialised, whatever called it)."""

import ctypes.util
import os
import subprocess
import sys

import pytest

import flatep

MODULES = ["flatep", "flatep.nn", "flatep.optim", "flatep.testing", "flatep.virtual", "flatep.distributed",
           "flatep.ops", "flatep.fp8", "flatep.integrations", "flatep.integrations.megatron",
           "flatep.integrations.torchtitan", "flatep.integrations.vllm"]

GUARD = """
import sys, torch
def refuse(name):
    def call(*a, **k):
        raise RuntimeError(f"{name} called while importing flatep")
    return call
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_capability"):
    setattr(torch.cuda, name, refuse(f"torch.cuda.{name}"))
torch._C._cuda_getDeviceCount = refuse("torch._C._cuda_getDeviceCount")
for m in sys.argv[1:]:
    __import__(m)
print("imported", len(sys.argv) - 1)
"""

DRIVER = """
import ctypes, sys
try:
    lib = ctypes.CDLL(sys.argv[1])
except OSError as e:
    print("unloadable", str(e).replace(" ", "_"))
    sys.exit(0)
v = ctypes.c_int(0)
print("cuDriverGetVersion", lib.cuDriverGetVersion(ctypes.byref(v)))  # 0 from a real driver (no init needed)
for m in sys.argv[2:]:
    __import__(m)
n = ctypes.c_int(0)
print("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(n)))
"""

CUDA_ERROR_NOT_INITIALIZED = 3


def _run(code, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)


def test_importing_flatep_calls_no_torch_cuda_entry_point():
    proc = _run(GUARD, *MODULES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["imported", str(len(MODULES))], proc.stdout


@pytest.mark.cuda
def test_importing_flatep_leaves_the_cuda_driver_uninitialised():
    lib = ctypes.util.find_library("cuda")
    if lib is None or not flatep._C.has_cuda:
        pytest.skip(f"no CUDA driver library here (find_library('cuda') = {lib}) or FlatEP built without CUDA")
    proc = _run(DRIVER, lib, *MODULES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    if words[:1] == ["unloadable"] or words[:2] != ["cuDriverGetVersion", "0"]:
        pytest.skip(f"the CUDA driver library {lib} is not a working driver here: {proc.stdout.strip()}")
    assert words[2:] == ["cuDeviceGetCount", str(CUDA_ERROR_NOT_INITIALIZED)], proc.stdout
