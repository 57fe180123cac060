"""Issue 58's end-to-end training on the CPU backend: the all-to-all baseline layer against flatep.nn.MoE, the
language-model example (examples/train_lm.py) and the benchmark (benchmarks/training/train_e2e.py) as a user runs
them, the routing trace (flatep.trace), bitwise resume, the data loader, and one-line errors.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_train_lm.py
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import flatep
from flatep import virtual
from flatep.baseline import AllToAllMoE, backward, collectives
from flatep.trace import RoutingTrace, synthesise_topk

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "training"))
import train_lm  # noqa: E402
import train_e2e  # noqa: E402

S, H, F, E, K, FS = 24, 32, 16, 16, 3, 8


def env_with_flatep():
    paths = [os.path.dirname(p) for p in flatep.__path__] + [os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def run_script(script, *argv, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *argv], env=env_with_flatep(),
                          capture_output=True, text=True, timeout=timeout)


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


# ---- AllToAllMoE against nn.MoE ----


def layer_case(rank, R, group, shared_ffn):
    """Both layers on this rank's tokens with the same skewed routing, forward and backward; returns (flatep, baseline)
    results: output, input gradient, router and shared-expert gradients, the experts' main_grad, rows per rank."""
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(R, S, H, generator=g)
    gout = torch.randn(R, S, H, generator=g)
    idx = flatep.testing.sample_topk(E, S, K, rank, sigma=1.5, seed=3).long()
    layers = [flatep.nn.MoE(H, F, E, K, group=group, num_tokens=S, align=8, seed=5, shared_ffn=shared_ffn),
              AllToAllMoE(H, F, E, K, group=group, num_tokens=S, seed=5, shared_ffn=shared_ffn)]
    out = []
    for layer in layers:
        x = xs[rank].clone().requires_grad_()
        y = layer(x, idx)
        loss = (y.float() * gout[rank]).sum()
        out.append(dict(y=y, x=x, loss=loss, layer=layer))
    return out


def results(case):
    layer = case["layer"]
    grads = dict(y=case["y"], grad_x=case["x"].grad, router=layer.router.weight.grad, w1=layer.w1.main_grad,
                 w2=layer.w2.main_grad)
    if layer.shared_ffn is not None:
        grads.update(shared_w1=layer.shared_w1.grad, shared_w2=layer.shared_w2.grad)
    return grads


def check_layers_agree(per_rank, R):
    """Same output and gradients within bf16 tolerance (the combine's partial rounding: outputs and input gradients
    2^-6 relative L2; the expert and router gradients, fp32 sums in another order, 1e-4), and the baseline's rows per
    rank are the home ranks' entries: FlatEP's loads_before."""
    for rank, (flat, base) in enumerate(per_rank):
        a, b = results(flat), results(base)
        for name in a:
            limit = 2.0 ** -6 if name in ("y", "grad_x") else 1e-4
            assert rel(a[name], b[name]) <= limit, (rank, name, rel(a[name], b[name]))
        assert rel(a["y"], b["y"]) > 0  # they do round differently: the comparison is not vacuous
        assert base["layer"].last_loads == flat["layer"].last_plan.stats["loads_before"]
        assert torch.equal(base["layer"].last_counts, flat["layer"].last_plan.tpe_all.long())
        assert sum(base["layer"].last_loads) == R * S * K


@pytest.mark.parametrize("R,shared_ffn", [(2, None), (4, FS)])
def test_alltoall_moe_matches_nn_moe_on_virtual_ranks(R, shared_ffn):
    ranks = virtual.virtual_ranks(R)
    cases = virtual.run_threads(R, lambda r: layer_case(r, R, ranks[r], shared_ffn))
    virtual.run_threads(R, lambda r: cases[r][0]["loss"].backward())  # FlatEP: each rank's own backward
    virtual.run_threads(R, lambda r: backward([c[1]["loss"] for c in cases]) if r == 0 else None)  # baseline: one
    check_layers_agree(cases, R)


def _layers_in_processes(rank, R, out_path):
    flat, base = layer_case(rank, R, None, FS)
    for case in (flat, base):
        case["loss"].backward()
        for p in case["layer"].replicated_parameters():  # compared per rank: no all-reduce needed
            assert p.grad is not None
    per_rank = [[{k: v.detach().clone() for k, v in results(c).items()} for c in (flat, base)]]
    loads = [flat["layer"].last_plan.stats["loads_before"], base["layer"].last_loads]
    everyone = collectives(None).all_gather_object((per_rank, loads))
    if rank == 0:
        errors = []
        for r, ((pair,), (before, baseline_loads)) in enumerate(everyone):
            for name in pair[0]:
                limit = 2.0 ** -6 if name in ("y", "grad_x") else 1e-4
                err = rel(pair[0][name], pair[1][name])
                if not err <= limit:
                    errors.append(f"rank {r} {name}: {err:.3g} > {limit:g}")
            if before != baseline_loads:
                errors.append(f"rank {r} loads {baseline_loads} != {before}")
        with open(out_path, "w") as f:
            json.dump(errors, f)


def test_alltoall_moe_matches_nn_moe_on_processes(tmp_path):
    path = str(tmp_path / "errors.json")
    flatep.testing.spawn(_layers_in_processes, 2, path)
    with open(path) as f:
        assert json.load(f) == []


def test_alltoall_moe_bad_input_fails_on_every_rank():
    R = 2
    ranks = virtual.virtual_ranks(R)
    layers = virtual.run_threads(R, lambda r: AllToAllMoE(H, F, E, K, group=ranks[r]))

    def call(r):
        idx = torch.zeros(S, K, dtype=torch.long) + torch.arange(K)
        if r == 1:
            idx[3, 0] = E  # one rank's bad expert id
        try:
            layers[r](torch.randn(S, H), idx)
        except ValueError as e:
            return str(e)
        return None

    messages = virtual.run_threads(R, call)
    assert messages == [f"AllToAllMoE: topk_idx of rank(s) [1] holds expert ids outside [0, {E})"] * R
    with pytest.raises(ValueError, match=r"x must be a \[s, H=32\] tensor, got \[4, 8\]"):
        layers[0](torch.randn(4, 8))
    with pytest.raises(ValueError, match="num_experts must be a multiple of the group size R=2, got 15"):
        virtual.run_threads(R, lambda r: AllToAllMoE(H, F, 15, K, group=ranks[r]))


# ---- the routing trace ----


def test_synthesised_routing_has_exactly_the_counts():
    g = torch.Generator().manual_seed(1)
    for trial in range(50):
        S_, K_, E_ = 1 + trial % 13, 1 + trial % 4, 4 + trial % 9
        ids = torch.stack([torch.randperm(E_, generator=g)[:K_] for _ in range(S_)])
        counts = torch.bincount(ids.flatten(), minlength=E_)
        out = synthesise_topk(counts, K_)
        assert out.shape == (S_, K_)
        assert torch.equal(torch.bincount(out.flatten(), minlength=E_), counts)
        assert (out[:, 1:] > out[:, :-1]).all()  # K distinct experts per token, ascending
    with pytest.raises(ValueError, match=r"every count must be in \[0, S=2\]"):
        synthesise_topk([3, 1], 2)


def test_trace_records_reloads_and_replays_through_plan(tmp_path):
    """A trace of skewed routings: counts exact after reload, ids exact where kept, and Buffer.plan of the replayed
    routing (recorded ids, and the routing synthesised from the counts) gives the plan of the original routing."""
    R, L, steps = 4, 2, 3
    full = RoutingTrace(R, E, K, S, L, seed=9, meta={"what": "test"})
    part = RoutingTrace(R, E, K, S, L, record_tokens=5)
    routings = {}
    for step in range(steps):
        for layer in range(L):
            idx = torch.stack([flatep.testing.sample_topk(E, S, K, r, sigma=2.0, seed=10 * step + layer).long()
                               for r in range(R)])
            routings[step, layer] = idx
            full.record(step, layer, list(idx))
            counts = torch.stack([torch.bincount(idx[r].flatten(), minlength=E) for r in range(R)])
            part.record(step, layer, idx[:, :5], counts=counts)
    full.save(tmp_path / "full.npz")
    part.save(tmp_path / "part.npz")
    full, part = RoutingTrace.load(tmp_path / "full.npz"), RoutingTrace.load(tmp_path / "part.npz")
    assert (full.num_steps, full.num_layers, full.meta, full.seed) == (steps, L, {"what": "test"}, 9)
    ranks = virtual.virtual_ranks(R)
    buffers = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, H, E, K, align=8))
    for (step, layer), idx in routings.items():
        counts = torch.stack([torch.bincount(idx[r].flatten(), minlength=E) for r in range(R)])
        assert torch.equal(full.counts(step, layer), counts) and torch.equal(part.counts(step, layer), counts)
        assert full.maxvio(step, layer) == pytest.approx(flatep.testing.maxvio(counts), abs=1e-6)
        assert torch.equal(part.topk_idx(step, layer, 2, 5), idx[2, :5])
        plans = {}
        for name, source in (("original", lambda r: idx[r]), ("recorded", lambda r: full.topk_idx(step, layer, r)),
                             ("synthesised", lambda r: part.topk_idx(step, layer, r))):
            plans[name] = virtual.run_threads(R, lambda r: buffers[r].plan(source(r)))
        for name in ("recorded", "synthesised"):
            for r in range(R):
                got, want = plans[name][r], plans["original"][r]
                assert got.stats["loads"] == want.stats["loads"] == [S * K] * R
                assert got.stats["loads_before"] == want.stats["loads_before"] == full.loads(step, layer).tolist()
                assert torch.equal(got.alloc, want.alloc) and torch.equal(got.slot_expert, want.slot_expert)
    assert full.maxvio().shape == (steps, L)
    with pytest.raises(ValueError, match=r"num_tokens must be at most the 5 recorded tokens, or S=24"):
        part.topk_idx(0, 0, 0, 10)
    with pytest.raises(ValueError, match="counts must be"):
        part.record(steps, 0, routings[0, 0][:, :5], counts=torch.zeros(R, E))


# ---- the data ----


def test_data_default_is_the_stdlib_sources_and_windows_are_deterministic(tmp_path):
    files = train_lm.corpus_files(train_lm.default_data_path())
    assert files == sorted(files, key=lambda p: os.path.relpath(p, train_lm.default_data_path()))
    assert files and all(p.endswith(".py") and "site-packages" not in p and "dist-packages" not in p for p in files)
    assert os.path.join(train_lm.default_data_path(), "os.py") in files
    corpus = train_lm.Corpus()
    with open(files[0], "rb") as f:
        head = f.read()
    assert bytes(corpus.data[: len(head)].tolist()) == head  # the files in order, concatenated
    args = train_lm.parse_args(["--seq-len", "16", "--batch", "3"])
    a = train_lm.batch_of(corpus, args, 5, 1)
    assert torch.equal(a[0], train_lm.batch_of(corpus, args, 5, 1)[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are the next bytes
    others = [train_lm.batch_of(corpus, args, s, r)[0] for s, r in ((5, 0), (6, 1))]
    assert all(not torch.equal(a[0], o) for o in others)
    # A fresh process (what a resumed run is) draws the same windows; a folder with --data-pattern reads its files.
    (tmp_path / "b.txt").write_bytes(b"0123456789" * 5)
    (tmp_path / "a.txt").write_bytes(b"abcdefghij" * 5)
    (tmp_path / "skip.py").write_bytes(b"#" * 50)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import train_lm; "
            "c = train_lm.Corpus(sys.argv[2], '*.txt'); a = train_lm.parse_args(['--seq-len', '8']); "
            "print(c.num_files, bytes(c.data[:12].tolist()).decode(), train_lm.window_starts(0, 5, 1, 3, 10**9))")
    proc = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "examples"), str(tmp_path)],
                          env=env_with_flatep(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(" ", 2)[:2] == ["2", "abcdefghijab"]
    assert proc.stdout.strip().endswith(str(train_lm.window_starts(0, 5, 1, 3, 10**9)))


# ---- train_lm.py: resume, one-line errors ----


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def checkpoint_tensors(path):
    state = torch.load(path, weights_only=False)  # our own checkpoint (see train_lm.load_rank)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)

    walk("", {k: v for k, v in state.items() if k != "rng"})
    return flat


TINY_LM = ["--ranks", "2", "--blocks", "4", "--hidden", "32", "--heads", "2", "--ffn", "16", "--experts", "4",
           "--seq-len", "16", "--batch", "2", "--warmup", "2", "--shared-ffn", "8", "--router-bias", "0.5",
           "--aux-loss", "0.01"]


@pytest.mark.parametrize("mode,impl", [("virtual", "flatep"), ("virtual", "baseline"), ("processes", "flatep"),
                                       ("processes", "baseline")])
def test_resume_is_bitwise(tmp_path, mode, impl):
    """6 steps with checkpoints at 3 and 6, then steps 4-6 again from the step-3 checkpoint in a fresh process: the
    same losses and the same final weights and optimizer state, bit for bit."""
    flags = TINY_LM + ["--impl", impl, "--steps", "6"] + (["--virtual"] if mode == "virtual" else [])
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    proc = run_script("examples/train_lm.py", *flags, "--save", str(whole), "--save-every", "3", "--log",
                      str(tmp_path / "whole.jsonl"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len([l for l in proc.stdout.splitlines() if l.startswith("step ")]) == 6
    proc = run_script("examples/train_lm.py", *flags, "--resume", str(whole / "step_000003"), "--save", str(resumed),
                      "--log", str(tmp_path / "resumed.jsonl"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = read_log(tmp_path / "whole.jsonl"), read_log(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in b] == [3, 4, 5]
    assert [r["rank_losses"] for r in a[3:]] == [r["rank_losses"] for r in b]
    assert a[0]["loss"] != a[5]["loss"]
    for rank in range(2):
        x = checkpoint_tensors(whole / "step_000006" / f"rank_{rank}.pt")
        y = checkpoint_tensors(resumed / "step_000006" / f"rank_{rank}.pt")
        assert x.keys() == y.keys() and any(".w1" in k for k in x) and any("masters" in k for k in x)
        different = [k for k in x if not torch.equal(x[k], y[k])]
        assert not different, different
    with open(whole / "latest") as f:
        assert f.read().strip() == "step_000006"


def test_resume_refuses_another_shape(tmp_path):
    flags = TINY_LM + ["--virtual", "--steps", "2"]
    proc = run_script("examples/train_lm.py", *flags, "--save", str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_script("examples/train_lm.py", *(flags[:-1] + ["3", "--ffn", "24"]), "--resume", str(tmp_path / "ck"))
    assert proc.returncode != 0
    assert "the checkpoint has ffn=16, this run 24" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,message", [
    (["--experts", "10", "--ranks", "4"], "--experts 10 must be a multiple of --ranks 4"),
    (["--topk", "0"], "--topk must be >= 1, got 0"),
    (["--hidden", "60", "--heads", "2"], "--hidden must be a multiple of 8 (FlatEP's rows), got 60"),
    (["--router-temperature", "0"], "--router-temperature must be a positive number, got 0.0"),
    (["--save-every", "5"], "--save-every needs --save DIR"),
    (["--resume", "/nonexistent/ck"], "--resume /nonexistent/ck: no such folder"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--impl", "deepep"], "argument --impl: invalid choice: 'deepep'"),
])
def test_bad_flags_give_one_line_errors(argv, message):
    proc = run_script("examples/train_lm.py", *argv, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_lm: error: ") and message in lines[0], proc.stderr


# ---- the benchmark ----


@pytest.mark.parametrize("mode", ["virtual", "processes"])
def test_train_e2e_tiny_runs_both_and_checks_the_loss(tmp_path, mode):
    proc = run_script("benchmarks/training/train_e2e.py", "--preset", "tiny", "--steps", "8", "--out", str(tmp_path),
                      *(["--processes"] if mode == "processes" else []))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every step within tolerance" in proc.stdout
    assert "tokens/s FlatEP / baseline over the last 8 steps" in proc.stdout
    assert f"R=2 ({mode if mode == 'processes' else 'virtual ranks'} on cpu)" in proc.stdout
    assert {"steps.csv", "memory.csv", "loss.csv", "trace_flatep.npz", "trace_baseline.npz", "train_e2e.png"} - {
        "memory.csv"} <= set(os.listdir(tmp_path))
    import csv

    def rows(name):
        with open(tmp_path / name) as f:
            return list(csv.DictReader(l for l in f if not l.startswith("#")))

    loss = rows("loss.csv")
    assert len(loss) == 8 and all(r["ok"] == "1" for r in loss)
    assert 0 < max(float(r["diff"]) for r in loss)  # the two really are two runs
    steps = rows("steps.csv")
    assert len(steps) == 2 * 8 * 2  # impl x step x MoE layer
    for impl in ("flatep", "baseline"):
        trace = RoutingTrace.load(tmp_path / f"trace_{impl}.npz")
        assert (trace.num_steps, trace.num_layers, trace.num_ranks) == (8, 2, 2)
        mine = [r for r in steps if r["impl"] == impl]
        for r in mine:
            step, layer = int(r["step"]), int(r["layer"])
            assert float(r["maxvio"]) == pytest.approx(trace.maxvio(step, layer), rel=1e-5)
            if impl == "flatep":
                assert int(r["rows_max"]) == 2 * 32 * 2  # S*K on every rank: FlatEP's exact mode
            else:  # the baseline computes its experts' entries: the counts' home-rank sums
                assert int(r["rows_max"]) == int(trace.loads(step, layer).max())
    a, b = [RoutingTrace.load(tmp_path / f"trace_{i}.npz") for i in ("flatep", "baseline")]
    assert torch.equal(a.counts(0, 0), b.counts(0, 0))  # the same init routes the first step alike


def test_train_e2e_fails_when_the_losses_part(tmp_path):
    proc = run_script("benchmarks/training/train_e2e.py", "--preset", "tiny", "--steps", "6", "--out", str(tmp_path),
                      "--no-plot", "--inject-mismatch")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "OUT OF TOLERANCE" in proc.stdout


def test_loss_tolerance_formula():
    u = 2.0 ** -8
    assert train_e2e.loss_tolerance(0, 4.0, 3.0) == 4.0 * u
    assert train_e2e.loss_tolerance(99, 2.0, 2.5, scale=2) == pytest.approx(2 * u * 2.5 * 10)


def test_train_e2e_refuses_what_does_not_fit_before_allocating(monkeypatch, capsys):
    args = train_e2e.build_parser().parse_args(["--preset", "h200"])
    args.device, args.virtual = "cuda", True
    for k, v in train_e2e.PRESETS["h200"].items():
        setattr(args, k, v)
    args.dense_ffn = args.topk * args.ffn
    per_rank, _ = train_e2e.memory_estimate(args, 8)
    assert 40 * 2**30 < 8 * per_rank < 100 * 2**30  # the preset's 71 GiB: fits a 141 GiB H200
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (16 * 2**30, 141 * 2**30))
    with pytest.raises(SystemExit) as e:
        train_e2e.check_fits(args, 8)
    assert str(e.value).startswith("train_e2e: error: this configuration needs about ")
    assert "the GPU has 16.0 GiB free" in str(e.value) and "\n" not in str(e.value)


def test_train_e2e_on_cpu_refuses_the_gpu_preset():
    proc = run_script("benchmarks/training/train_e2e.py", "--preset", "h200", timeout=120)
    if flatep._C.has_cuda and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "train_e2e: error: --device cuda is not available here (FlatEP was built without CUDA); use --device cpu"
        if not flatep._C.has_cuda else
        "train_e2e: error: --device cuda is not available here (torch sees no CUDA device); use --device cpu"]


def test_spread_of_summation_order_is_inside_the_tolerance():
    """The tolerance's empirical check, short: the baseline against itself with reversed summation order, and FlatEP
    against the baseline, at K=4 (where the order of a token's terms matters)."""
    proc = run_script("benchmarks/training/train_e2e.py", "--preset", "tiny", "--steps", "12", "--topk", "4", "--spread")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ratios = [float(l.split("= ")[1].split()[0]) for l in proc.stdout.splitlines() if l.startswith("spread:")]
    assert len(ratios) == 2 and all(0 <= r < 1 for r in ratios), proc.stdout
    assert not math.isnan(sum(ratios))


def documented_commands():
    """Every command line of train_lm.py / train_e2e.py that the scripts' docstrings and docs/performance.md show."""
    texts = [train_lm.__doc__, train_e2e.__doc__]
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        texts.append(f.read())
    found = []
    for text in texts:
        for line in text.replace("\\\n", " ").split("\n"):
            for script in ("train_lm.py", "train_e2e.py"):
                if f"{script} " in line and ("python3 " in line or "torchrun " in line):
                    argv = line.split(f"{script} ", 1)[1].split("#")[0].split("`")[0].split()
                    found.append((script, [a for a in argv if a != "..."]))
    return found


def test_documented_commands_use_flags_that_exist():
    commands = documented_commands()
    assert len([c for c in commands if c[0] == "train_e2e.py"]) >= 6 and len(commands) >= 12, commands
    for script, argv in commands:
        parser = train_lm.build_parser() if script == "train_lm.py" else train_e2e.build_parser()
        parser.parse_args(argv)  # argparse exits on an unknown flag or a bad value
