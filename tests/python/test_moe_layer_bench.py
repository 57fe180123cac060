"""benchmarks/layer/moe_layer.py at a tiny size on the CPU (2 gloo processes): it runs FlatEP and the standard EP
baseline on the same routing, writes one CSV row per maxvio x implementation x phase, and its equality check passes (and
fails when the baseline is made to compute something else).

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_moe_layer_bench.py
"""

import csv
import os
import subprocess
import sys

import mp_cases

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAYER = os.path.join(ROOT, "benchmarks", "layer")  # the layer benchmarks
TINY = ["--device", "cpu", "--ranks", "2", "--tokens", "64", "--hidden", "64", "--ffn", "32", "--experts", "8",
        "--topk", "2", "--iters", "2", "--warmup", "1"]
BASELINE_PHASES = {"router_fwd", "plan", "dispatch_fwd", "gemm_fwd", "combine_fwd", "combine_bwd", "gemm_bwd",
                   "dispatch_bwd", "router_bwd", "wgrad_fp32", "sum_phases", "layer"}
# On the CPU FlatEP prefetches once (a GPU run prefetches again before backward: prefetch_bwd).
FLATEP_PHASES = BASELINE_PHASES | {"prefetch", "reduce_grad"}


def run(tmp_path, *extra):
    env = mp_cases.flatep_env()
    cmd = [sys.executable, os.path.join(LAYER, "moe_layer.py"), *TINY, "--out", str(tmp_path), *extra]
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
    assert lines[0].startswith("# command: benchmarks/layer/moe_layer.py --device cpu")
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
    """benchmarks/layer/moe_layer_virtual.py: R=4 virtual ranks in one process, same CSV layout, the equality check
    passes; 'layer' is the sum over phases of the slowest rank."""
    env = mp_cases.flatep_env()
    args = list(TINY)
    args[args.index("--ranks") + 1] = "4"
    args[args.index("--experts") + 1] = "16"
    cmd = [sys.executable, os.path.join(LAYER, "moe_layer_virtual.py"), *args, "--out", str(tmp_path),
           "--no-plot"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equality check passed" in proc.stdout, proc.stdout
    csvs = [f for f in os.listdir(tmp_path) if f.endswith(".csv")]
    assert len(csvs) == 1 and csvs[0].startswith("moe_layer_custom_R4_S64_E16_H64_K2_F32_"), csvs
    assert csvs[0].endswith("-virtual.csv"), csvs
    with open(tmp_path / csvs[0]) as f:
        lines = f.readlines()
    assert lines[0].startswith("# command: benchmarks/layer/moe_layer_virtual.py")
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


def test_moe_layer_virtual_before48_switches_cpu(tmp_path):
    """The A/B switches that replay the issue-48 run's choices (the baseline's weighted-sum backward by autograd,
    FlatEP's local ops under the SM budget and its combine backward rows copied out, gradients overwritten) compute
    the same layer: the equality check passes at both skews."""
    env = mp_cases.flatep_env()
    cmd = [sys.executable, os.path.join(LAYER, "moe_layer_virtual.py"), *TINY, "--out", str(tmp_path),
           "--no-plot", "--maxvio", "0.2", "20", "--baseline-unpermute", "autograd", "--flatep-local-ops", "capped",
           "--flatep-combine-bwd", "copy", "--wgrad-mode", "overwrite"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equality check passed" in proc.stdout, proc.stdout


def test_moe_layer_virtual_check_catches_a_mismatch(tmp_path):
    env = mp_cases.flatep_env()
    cmd = [sys.executable, os.path.join(LAYER, "moe_layer_virtual.py"), *TINY, "--out", str(tmp_path),
           "--no-plot", "--maxvio", "1", "--inject-mismatch"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "EQUALITY CHECK FAILED at maxvio 1: FlatEP vs baseline relative L2 errors" in proc.stderr, proc.stderr


def test_baseline_lean_unpermute_backward_is_autograds():
    """The baseline's chunked weighted-sum backward (moe_layer.weighted_unpermute_backward, no [S*K, H] fp32
    temporaries) gives autograd's bits for the forward expression, in chunks that do not divide S*K."""
    import torch

    sys.path.insert(0, LAYER)
    import moe_layer as ml

    g = torch.Generator().manual_seed(5)
    S, K, H = 13, 3, 40
    token_of = torch.randperm(S * K, generator=g) // K
    back = torch.randn(S * K, H, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.rand(S * K, generator=g).requires_grad_()
    grad_out = torch.randn(S, H, generator=g).to(torch.bfloat16)
    out = torch.zeros(S, H).index_add(0, token_of, back.float() * w.unsqueeze(1)).to(torch.bfloat16)
    out.backward(grad_out)
    for chunk in (4, 7, S * K, 1000):
        grad_back, grad_w = ml.weighted_unpermute_backward(grad_out, token_of, back.detach(), w.detach(), chunk)
        assert grad_back.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
        assert torch.equal(grad_back.view(torch.int16), back.grad.view(torch.int16)), chunk
        assert torch.equal(grad_w.view(torch.int32), w.grad.view(torch.int32)), chunk
    # the autograd.Function the multi-process baseline uses: the same gradients
    b2, w2 = back.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out2 = ml._WeightedSum.apply(b2, w2, token_of, S)
    assert torch.equal(out2.view(torch.int16), out.view(torch.int16))
    out2.backward(grad_out)
    assert torch.equal(b2.grad.view(torch.int16), back.grad.view(torch.int16))
    assert torch.equal(w2.grad.view(torch.int32), w.grad.view(torch.int32))


def test_moe_layer_virtual_profile_baseline_cpu(tmp_path):
    """--profile-baseline DIR --profile-maxvio M: one profiled baseline step at maxvio M (not at the other): its top
    ops table, a range per phase and rank, the step's phase times and a chrome trace; the CSV has the allocator and
    memory columns. A --profile-maxvio that is not one of --maxvio is refused."""
    import gzip
    import json

    env = mp_cases.flatep_env()
    prof = tmp_path / "prof"
    cmd = [sys.executable, os.path.join(LAYER, "moe_layer_virtual.py"), *TINY, "--out", str(tmp_path),
           "--no-plot", "--maxvio", "1", "20", "--profile-baseline", str(prof), "--profile-maxvio", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tag = "baseline_lean_maxvio1"
    assert sorted(os.listdir(prof)) == sorted(f"{tag}_{k}" for k in ("clock.txt", "kernels.txt", "phases.txt",
                                                                       "trace.json.gz"))
    phases = (prof / f"{tag}_phases.txt").read_text()
    for phase in ("router_fwd", "combine_bwd", "gemm_bwd", "wgrad_fp32", "router_bwd"):
        assert f"phase/{phase}/r0 " in phases and f"phase/{phase}/r1 " in phases, (phase, phases)
    clock = (prof / f"{tag}_clock.txt").read_text()
    assert {line.split()[0] for line in clock.splitlines()[1:]} == BASELINE_PHASES - {"sum_phases", "layer"}
    assert "self_cpu_time_total" in (prof / f"{tag}_kernels.txt").read_text()
    with gzip.open(prof / f"{tag}_trace.json.gz") as f:
        trace = json.load(f)
    assert trace["traceEvents"] if isinstance(trace, dict) else trace  # torch 1.13 writes the list alone
    csvs = [f for f in os.listdir(tmp_path) if f.endswith(".csv")]
    with open(tmp_path / csvs[0]) as f:
        header = [l for l in f if not l.startswith("#")][0].strip().split(",")
    assert header[-5:] == ["alloc_retries", "device_allocs", "static_gb", "step_peak_gb", "peak_gb"]
    bad = subprocess.run(cmd[:-1] + ["5"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--profile-maxvio 5 is not one of --maxvio 1 20" in bad.stderr, bad.stderr


def test_grouped_mm_align_layouts_and_csv_cpu(tmp_path):
    """benchmarks/probes/grouped_mm_align.py on the CPU (a loop of mm per group): the layouts it measures hold what they
    say (FlatEP's 2*epn groups padded to align over S*K real rows; the same rows in epn groups; the [E+B] serving view
    with the own groups at rank*epn and the rest in B slots or home rows; the baseline's hottest rank) and the CSV has
    one row per F, maxvio, layout, align and op."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))
    import grouped_mm_align as gma
    from flatep import testing, virtual

    argv = ["--device", "cpu", "--tokens", "64", "--hidden", "64", "--ffn", "32", "--experts", "16", "--ranks", "4",
            "--topk", "2", "--reps", "1", "--warmup", "0", "--aligns", "8", "16", "--slots", "2", "--maxvio", "0.2",
            "20", "--out", str(tmp_path), "--tag", "t"]
    args = gma.parse_args(argv)
    R, E, epn, SK = 4, 16, 4, 64 * 2
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=60)
    for target in (0.2, 20):
        sigma = testing.sigma_for_maxvio(min(target, 0.9 * (E / 2 - 1)), R, E, 64, 2, seed=1)
        lay = gma.layouts(args, ranks, sigma)
        for align in (8, 16):
            groups, rows, note = lay[("flatep_2epn", align)]
            assert len(groups) == 2 * epn and all(n % align == 0 for n in groups)
            assert SK <= sum(groups) <= rows, (groups, rows)
            merged, _, _ = lay[("flatep_epn", align)]
            assert len(merged) == epn and all(n % align == 0 for n in merged) and sum(merged) >= SK
            view, _, _ = lay[("serving_EB", align)]
            r = int(note.split()[1].rstrip(","))
            assert len(view) == E + 2 and view[r * epn:(r + 1) * epn] == groups[:epn]
            assert sum(view) == sum(groups)  # every slot's rows: in one of the B slots or in a home row
            assert sorted(view[E:], reverse=True) == view[E:]  # the slots with most rows first
        base, base_rows, _ = lay[("baseline", 1)]
        assert len(base) == epn and sum(base) == base_rows >= SK
    assert gma.main(argv) == 0
    csvs = [f for f in os.listdir(tmp_path) if f.endswith(".csv")]
    assert csvs == ["grouped_mm_align_R4_S64_E16_H64_K2_t.csv"], csvs
    with open(tmp_path / csvs[0]) as f:
        rows = list(csv.DictReader(l for l in f if not l.startswith("#")))
    keys = {(r["ffn"], r["maxvio_target"], r["layout"], r["align"], r["op"]) for r in rows}
    assert len(keys) == len(rows)
    for m in ("0.2", "20.0"):
        for a in ("8", "16"):
            assert {op for (_, t, lay_, al, op) in keys if t == m and lay_ == "flatep_2epn" and al == a} == \
                set(gma.GEMMS + gma.FFN_OPS)
            assert {op for (_, t, lay_, al, op) in keys if t == m and lay_ == "serving_EB" and al == a} == \
                set(gma.FWD_OPS)
