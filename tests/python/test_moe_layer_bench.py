"""benchmarks/moe_layer.py at a tiny size on the CPU (2 gloo processes): it runs FlatEP and the standard EP baseline
on the same routing, writes one CSV row per maxvio x implementation x phase, and its equality check passes (and
fails when the baseline is made to compute something else).

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_moe_layer_bench.py
"""

import csv
import os
import subprocess
import sys

import flatep

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY = ["--device", "cpu", "--ranks", "2", "--tokens", "64", "--hidden", "64", "--ffn", "32", "--experts", "8",
        "--topk", "2", "--iters", "2", "--warmup", "1"]
BASELINE_PHASES = {"router_fwd", "plan", "dispatch_fwd", "gemm_fwd", "combine_fwd", "combine_bwd", "gemm_bwd",
                   "dispatch_bwd", "router_bwd", "wgrad_fp32", "sum_phases", "layer"}
# On the CPU FlatEP prefetches once (a GPU run prefetches again before backward: prefetch_bwd).
FLATEP_PHASES = BASELINE_PHASES | {"prefetch", "reduce_grad"}


def run(tmp_path, *extra):
    paths = [os.path.dirname(p) for p in flatep.__path__] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "moe_layer.py"), *TINY, "--out", str(tmp_path), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_moe_layer_bench_tiny_cpu(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equality check passed" in proc.stdout, proc.stdout
    csvs = [f for f in os.listdir(tmp_path) if f.endswith(".csv")]
    assert len(csvs) == 1, csvs
    name = csvs[0][: -len(".csv")]
    assert name.startswith("moe_layer_custom_R2_S64_E8_H64_K2_F32_")
    assert {name + ".png", name + "_layer.png"} <= set(os.listdir(tmp_path))
    with open(tmp_path / csvs[0]) as f:
        lines = f.readlines()
    assert lines[0].startswith("# command: benchmarks/moe_layer.py --device cpu")
    assert lines[1].startswith("# device: ")
    rows = list(csv.DictReader(l for l in lines if not l.startswith("#")))
    phases = {}
    for r in rows:
        phases.setdefault((float(r["maxvio_target"]), r["impl"]), []).append(r["phase"])
        assert float(r["median_ms"]) > 0 and float(r["min_rank_ms"]) <= float(r["median_ms"]), r
    assert sorted(phases) == sorted((m, i) for m in (0.2, 1, 10, 20) for i in ("baseline", "flatep"))
    for (_, impl), got in phases.items():
        assert len(got) == len(set(got)), got  # one row per config/maxvio/impl/phase
        assert set(got) == (FLATEP_PHASES if impl == "flatep" else BASELINE_PHASES), (impl, sorted(got))
    by = {(float(r["maxvio_target"]), r["impl"], r["phase"]): r for r in rows}
    for m in (0.2, 1, 10, 20):
        # Exact mode: FlatEP computes S*K = 128 rows on every rank; the baseline's hottest rank at least that.
        assert int(by[(m, "flatep", "layer")]["rows_max"]) == 128
        assert int(by[(m, "baseline", "layer")]["rows_max"]) >= 128
    assert int(by[(20, "baseline", "layer")]["rows_max"]) > 128  # skewed routing overloads a rank
    assert float(by[(1, "flatep", "layer")]["maxvio"]) > float(by[(0.2, "flatep", "layer")]["maxvio"])


def test_moe_layer_bench_equality_check_fails_loudly(tmp_path):
    proc = run(tmp_path, "--maxvio", "1", "--inject-mismatch", "--no-plot")
    assert proc.returncode != 0
    assert "EQUALITY CHECK FAILED" in proc.stdout + proc.stderr
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".csv")]


def test_moe_layer_virtual_tiny_cpu(tmp_path):
    """benchmarks/moe_layer_virtual.py: R=4 virtual ranks in one process, same CSV layout, the equality check passes;
    'layer' is the sum over phases of the slowest rank."""
    paths = [os.path.dirname(p) for p in flatep.__path__] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    args = list(TINY)
    args[args.index("--ranks") + 1] = "4"
    args[args.index("--experts") + 1] = "16"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "moe_layer_virtual.py"), *args, "--out", str(tmp_path),
           "--no-plot"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equality check passed" in proc.stdout, proc.stdout
    csvs = [f for f in os.listdir(tmp_path) if f.endswith(".csv")]
    assert len(csvs) == 1 and csvs[0].startswith("moe_layer_custom_R4_S64_E16_H64_K2_F32_"), csvs
    assert csvs[0].endswith("-virtual.csv"), csvs
    with open(tmp_path / csvs[0]) as f:
        lines = f.readlines()
    assert lines[0].startswith("# command: benchmarks/moe_layer_virtual.py")
    assert "4 virtual ranks in one process" in lines[1]
    rows = list(csv.DictReader(l for l in lines if not l.startswith("#")))
    by = {(float(r["maxvio_target"]), r["impl"], r["phase"]): float(r["median_ms"]) for r in rows}
    for m in (0.2, 1, 10, 20):
        for impl, phases in (("baseline", BASELINE_PHASES), ("flatep", FLATEP_PHASES)):
            got = {p for (t, i, p) in by if t == m and i == impl}
            want = phases | ({"prefetch_bwd"} if impl == "flatep" else set())
            assert got == want, (m, impl, sorted(got ^ want))
            assert by[(m, impl, "layer")] == by[(m, impl, "sum_phases")]
            assert by[(m, impl, "layer")] >= max(by[(m, impl, p)] for p in got if p not in ("layer", "sum_phases"))


def test_moe_layer_virtual_check_catches_a_mismatch(tmp_path):
    paths = [os.path.dirname(p) for p in flatep.__path__] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "moe_layer_virtual.py"), *TINY, "--out", str(tmp_path),
           "--no-plot", "--maxvio", "1", "--inject-mismatch"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "EQUALITY CHECK FAILED at maxvio 1: FlatEP vs baseline relative L2 errors" in proc.stderr, proc.stderr
