"""benchmarks/serving/serving_step.py (issue 43: a whole serving step through nn.MoE, expert GEMM included) at its tiny
--quick shape on the CPU backend: every mode's row in the CSV with positive, ordered times, the plan's columns
consistent with the layout (receive rows, rows per rank, no replica for the owner planner), the ratio columns the
quotient of the times; the memory check refuses before allocating anything; the graph check's comparison is bitwise.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_serving_step_bench.py
"""

import csv
import os
import subprocess
import sys

import torch

import flatep

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "benchmarks", "serving", "serving_step.py")
# --quick: R=4, S=256, E=32 (epn 8), H=64, K=4, F=32; B=4; decode s=128; align 16 (nn.MoE's default)
R, S, E, H, K, F, EPN, B, DECODE, ALIGN = 4, 256, 32, 64, 4, 32, 8, 4, 128, 16
MODES = {("balanced_b4", S), ("balanced_bepn", S), ("balanced_b4", DECODE), ("balanced_bepn", DECODE),
         ("owner", DECODE)}


def run(*extra):
    paths = [os.path.dirname(p) for p in flatep.__path__] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    cmd = [sys.executable, SCRIPT, "--quick", "--device", "cpu", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def round_up(v, m):
    return (v + m - 1) // m * m


def test_quick_cpu_rows_columns_and_ratios(tmp_path):
    out = tmp_path / "serving_step.csv"
    proc = run("--iters", "3", "--warmup", "1", "--csv", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning" not in proc.stdout, proc.stdout  # e.g. the memory estimate's receive rows differ from the Buffer's
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert {(r["mode"], int(r["s"])) for r in rows} == MODES and len(rows) == len(MODES)
    by = {(r["mode"], int(r["s"])): r for r in rows}
    for (mode, s), r in by.items():
        assert (r["preset"], r["device"], r["timing"]) == ("quick", "cpu", "eager")
        assert [int(r[c]) for c in ("R", "S", "E", "H", "K", "F")] == [R, S, E, H, K, F]
        assert int(r["iters"]) == 3
        lo, med, hi = float(r["min_us"]), float(r["median_us"]), float(r["max_us"])
        assert 0 < lo <= med <= hi, r
        assert r["planner"] == ("owner" if mode == "owner" else "balanced")
        assert int(r["B"]) == (EPN if mode == "balanced_bepn" else B)
        loads = int(r["rows_max"])
        if mode == "owner":  # no replica; receive rows R*s*K + epn*(align-1), rounded up
            assert int(r["replicas"]) == 0
            assert int(r["recv_rows"]) == round_up(R * s * K + EPN * (ALIGN - 1), ALIGN)
            assert s * K // R <= loads <= R * s * K
        else:  # exact mode: every rank computes s*K rows
            assert loads == s * K, r
            assert int(r["recv_rows"]) == round_up(s * K + 2 * EPN * (ALIGN - 1), ALIGN)
        # the weights view: training [2*epn]; serving [R*Q + B] with Q >= epn
        assert int(r["view_rows"]) == 2 * EPN if mode == "balanced_bepn" else int(r["view_rows"]) >= R * EPN + B
        assert float(r["maxvio"]) > 0  # --quick routes with skew (maxvio 1 at s = S)
    for (mode, s), r in by.items():
        vs = {"balanced_b4": "balanced_bepn", "owner": "balanced_b4"}.get(mode)
        assert r["vs"] == (vs or "")
        if vs is None:
            assert r["ratio"] == ""
            continue
        want = float(r["median_us"]) / float(by[(vs, s)]["median_us"])
        assert abs(float(r["ratio"]) - want) <= 1e-4 * max(1.0, want), (r, want)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ratio ")]
    assert len(lines) == 3, proc.stdout
    assert f"ratio owner / balanced_b4 at s={DECODE}:" in proc.stdout


def test_memory_check_refuses_before_allocating(tmp_path):
    out = tmp_path / "never.csv"
    proc = run("--memory-gib", "0.01", "--csv", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "memory estimate, B=4 (serving: own + 4 slots)" in proc.stdout
    assert f"memory estimate, B={EPN} (training layout" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("serving_step: does not fit: B=4 needs ") and "--memory-gib" in last, proc.stderr
    assert "layers built" not in proc.stdout and not out.exists()


def test_bad_arguments_name_the_flag():
    proc = run("--slots", str(EPN))
    assert proc.returncode == 2 and f"--slots must be in [0, epn={EPN}), got {EPN}" in proc.stderr, proc.stderr
    proc = run("--decode-tokens", str(S + 1))
    assert proc.returncode == 2 and f"--decode-tokens must be in [1, S={S}], got {S + 1}" in proc.stderr


def bench_module():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "serving"))
    import serving_step

    return serving_step


def test_layers_built_without_host_init_get_distinct_experts_of_the_library_scale():
    from flatep import testing, virtual

    serving_step = bench_module()
    library = flatep.nn.init_expert_weights
    ranks = virtual.virtual_ranks(2, "cpu", timeout_s=30)
    h, f, e = 128, 64, 8
    with serving_step.no_host_init(torch.device("cpu")):
        assert flatep.nn.init_expert_weights is not library
        moes = virtual.run_threads(2, lambda r: flatep.nn.MoE(h, f, e, 2, ranks[r], num_tokens=8, num_slots=1))
    assert flatep.nn.init_expert_weights is library  # restored
    for m in moes:
        assert not m.w1.any() and not m.w2.any()  # the swapped init wrote zeros, nothing drawn on the host
        w1_before = m.w1.data_ptr()
        serving_step.fill_experts(m, 42)
        assert m.w1.data_ptr() == w1_before and m.w1.data_ptr() == m.expert_layer.own_weights(0).data_ptr()
        for param, fan_in in ((m.w1, h), (m.w2, f)):
            values = param.float()
            assert abs(values.std().item() * fan_in**0.5 - 1) < 0.05
            assert not torch.equal(values[0], values[1])  # distinct experts
    assert not torch.equal(moes[0].w1, moes[1].w1)  # and distinct ranks
    testing.release_all()


def test_mismatches_compares_bits():
    serving_step = bench_module()

    a = torch.tensor([[1.0, 0.0], [float("nan"), 2.0]], dtype=torch.bfloat16)
    same = a.clone()
    signed = a.clone()
    signed[0, 1] = -0.0  # equal as numbers, different bits
    moved = a.clone()
    moved[1, 1] = 2.015625  # the next bf16 after 2
    assert serving_step.mismatches([a, a], [same, same]) == []  # NaN equals itself bitwise
    assert serving_step.mismatches([a, a, a], [same, signed, moved]) == [(1, 1), (2, 1)]
    assert serving_step.mismatches([a], [a[:1]]) == [(0, 4)]
