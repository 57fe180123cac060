"""A whole training step as one CUDA graph per rank (module level, so torch.multiprocessing can import it).

Model: two flatep.nn.MoE layers with RMS norms and residuals between them, a final norm and an MSE loss; backward
through everything (router, norms, experts' main_grad, the input). One step = zero every gradient, forward, loss,
backward, all inside the captured region. Per trial, new tokens, targets and routing (topk_idx at a different skew
per trial and layer) are written into the static inputs; the replayed graph must give bitwise the loss, output and
every gradient of the same step run eagerly, and the same plans.
"""

import json
import os

import torch

import flatep
from flatep import testing

S, H, F, E, K, ALIGN, LAYERS, TRIALS = 128, 256, 128, 32, 4, 8, 2, 20
SIGMAS = (0.0, 0.6, 1.2, 2.0)


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TwoLayerModel(torch.nn.Module):
    def __init__(self, group, device, seed=0):
        super().__init__()
        self.moes = torch.nn.ModuleList(
            flatep.nn.MoE(H, F, E, K, group=group, num_tokens=S, align=ALIGN, seed=seed + 10 * i, device=device)
            for i in range(LAYERS)
        )
        g = torch.Generator().manual_seed(seed + 99)
        self.norms = torch.nn.ParameterList(
            torch.nn.Parameter((1 + 0.1 * torch.randn(H, generator=g)).to(device)) for _ in range(LAYERS + 1)
        )

    def forward(self, x, idx):
        h = x
        for i, moe in enumerate(self.moes):
            h = h + moe(rms_norm(h, self.norms[i]), idx[i])
        return rms_norm(h, self.norms[LAYERS])


class StaticStep:
    """The static inputs and the step of one rank's model (the same code runs eagerly and under capture)."""

    def __init__(self, model, device):
        self.model = model
        self.x = torch.zeros(S, H, device=device, requires_grad=True)
        self.target = torch.zeros(S, H, device=device)
        self.idx = torch.zeros(LAYERS, S, K, dtype=torch.int64, device=device)
        self.params = [p for p in model.parameters() if not hasattr(p, "main_grad")]  # router and norms
        self.names = {id(p): n for n, p in model.named_parameters()}  # what a failure calls each gradient
        self.loss = self.out = None

    def write_inputs(self, rank, trial):
        g = torch.Generator().manual_seed(1000 * trial + rank)
        with torch.no_grad():
            self.x.copy_(torch.randn(S, H, generator=g))
            self.target.copy_(torch.randn(S, H, generator=g))
            for i in range(LAYERS):
                sigma = SIGMAS[(trial + i) % len(SIGMAS)]
                self.idx[i].copy_(testing.sample_topk(E, S, K, rank, sigma=sigma, seed=7 * trial + i).long())

    def step(self):
        """Zero grads, forward, loss, backward. Gradients accumulate into tensors that exist before the step (the
        first eager step allocates .grad), so graph replays and eager steps write the same memory."""
        for p in self.params + [self.x]:
            if p.grad is not None:
                p.grad.zero_()
        for moe in self.model.moes:
            moe.zero_main_grad()
        self.out = self.model(self.x, self.idx)
        self.loss = ((self.out.float() - self.target) ** 2).mean()
        self.loss.backward()

    def results(self, replayed=False):
        """(name, cloned tensor) of the loss, the output, every gradient and the layers' cu_seqlens (call after the
        device is idle; returns once the clones are done): of the last eager step, or with replayed=True of the last
        replay (the captured step's static tensors and plans; the gradients are the same tensors in both)."""
        named = [(self.names[id(p)], p.grad) for p in self.params] + [("x.grad", self.x.grad)]
        experts = [p for moe in self.model.moes for p in moe.expert_parameters()]
        named += [(self.names[id(p)] + ".main_grad", p.main_grad) for p in experts]
        if replayed:
            loss, out, plans = self.captured
        else:
            loss, out, plans = self.loss, self.out, [moe.last_plan for moe in self.model.moes]
        named = [("loss", loss), ("out", out)] + named
        named += [(f"moes.{i}.cu_seqlens", plan.cu_seqlens) for i, plan in enumerate(plans)]
        cloned = [(n, t.detach().clone()) for n, t in named]
        # The clones run on the current stream, the next step on the test's own: without this wait the next step's
        # zeroing of the gradients may run before a clone reads them (a replay's gradients then read as zeros; the
        # whole-step test failed so in about one run in three, 2026-12-02/03).
        torch.cuda.synchronize()
        return cloned


def compare(replayed, eager, where):
    """None when every tensor is bitwise equal, else one line naming every tensor that differs."""
    diffs = []
    for (name, a), (_, b) in zip(replayed, eager):
        if a.dtype != b.dtype or a.shape != b.shape:
            diffs.append(f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif not torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b):
            diff = (a.float() - b.float()).abs()
            where_max = divmod(int(diff.argmax()), a.shape[-1]) if a.dim() > 1 else int(diff.argmax())
            diffs.append(
                f"{name} differs in {int((diff > 0).sum())} of {a.numel()} (max |diff| {diff.max().item():g} at "
                f"{where_max}, |replayed| max {a.float().abs().max().item():g}, |eager| max "
                f"{b.float().abs().max().item():g})"
            )
    return f"{where}: " + "; ".join(diffs) if diffs else None


def capture(step, stream, dump_path=None):
    """The step captured as one graph. dump_path: also write the graph's nodes and edges there (Graphviz, CUDA's
    debug dump: which kernels depend on which)."""
    graph = torch.cuda.CUDAGraph()
    if dump_path:
        try:  # torch 2.11 drops the captured graph at instantiation (debug_dump then writes nothing) unless kept
            graph = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:  # older torch: keeps it in debug mode
            pass
        graph.enable_debug_mode()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="global"):
        step.step()
    step.captured = (step.loss, step.out, [moe.last_plan for moe in step.model.moes])  # what replays rewrite
    if dump_path:
        graph.debug_dump(dump_path)
    return graph


def check_rows(model, R):
    """Host accessors (a synchronisation, outside the graphs): every rank computed S*K rows in each layer."""
    for i, moe in enumerate(model.moes):
        loads = moe.last_plan.stats["loads"]
        if loads != [S * K] * R:
            return f"layer {i}: loads {loads}, expected {S * K} on each of {R} ranks"
    return None


def replay_and_eager(st, stream, graph, rank, trial):
    """One trial: its inputs, the graph replayed, then the same step run eagerly: (replayed, eager) results."""
    st.write_inputs(rank, trial)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        graph.replay()
    torch.cuda.synchronize()
    replayed = st.results(replayed=True)
    with torch.cuda.stream(stream):
        st.step()
    torch.cuda.synchronize()
    return replayed, st.results()


def run_processes(rank, R, out_path):
    """One rank per process, every process on cuda:0. FLATEP_STEP_GRAPH_DUMP=DIR: each rank also writes its captured
    graph to DIR/step_graph_rank<r>.dot."""
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    model = TwoLayerModel(None, device)
    st = StaticStep(model, device)
    stream = torch.cuda.Stream(device)
    errors, failed = [], {}
    with torch.cuda.stream(stream):
        for trial in (0, 1):  # warm-up: allocates .grad, loads every kernel
            st.write_inputs(rank, trial)
            st.step()
    torch.cuda.synchronize()
    dump_dir = os.environ.get("FLATEP_STEP_GRAPH_DUMP")
    graph = capture(st, stream, os.path.join(dump_dir, f"step_graph_rank{rank}.dot") if dump_dir else None)
    torch.cuda.synchronize()
    for trial in range(2, 2 + TRIALS):
        replayed, eager = replay_and_eager(st, stream, graph, rank, trial)
        err = compare(replayed, eager, f"rank {rank} trial {trial}") or check_rows(model, R)
        if err:
            errors.append(err)
            failed[trial] = (replayed, eager)
    # A trial that failed on any rank runs once more on every rank (the ops are collective): the failing rank says
    # which of its two results moved, the replay's or the eager step's.
    trials = [None] * R
    torch.distributed.all_gather_object(trials, sorted(failed))
    for trial in sorted({t for ts in trials for t in ts}):
        replayed, eager = replay_and_eager(st, stream, graph, rank, trial)
        if trial in failed:
            first_replayed, first_eager = failed[trial]
            verdicts = [
                f"{what} {compare(a, b, 'differs') or 'equal'}"
                for what, a, b in (("replay again vs first replay:", replayed, first_replayed),
                                   ("eager again vs first eager:", eager, first_eager),
                                   ("replay again vs eager again:", replayed, eager))
            ]
            errors.append(f"rank {rank} trial {trial} run again: " + "; ".join(verdicts))
    for moe in model.moes:
        moe.buffer.check_status()
    gathered = [None] * R
    torch.distributed.all_gather_object(gathered, errors)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


def run_virtual(rank, world_size, out_path, R=4):
    """R virtual ranks on cuda:0 driven by one host thread, in a process of its own with CUDA_MODULE_LOADING=EAGER:
    the model's own torch kernels (norms, router, grouped GEMMs, loss, their backward) would otherwise load at
    their first launch between two ranks' ops, and a lazy load may wait for the kernels running in the context,
    among them a rank's plan spinning for a peer this thread has yet to enqueue (flatep.virtual's docstring).
    FlatEP's own kernels need no such help (tests/python/test_gpu_robustness.py runs them under lazy loading)."""
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"  # before CUDA starts in this process
    from flatep import virtual

    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(R, device, timeout_s=60)
    models = virtual.run_threads(R, lambda r: TwoLayerModel(group[r], device))
    steps = [StaticStep(models[r], device) for r in range(R)]
    streams = [torch.cuda.Stream(device) for _ in range(R)]

    def eager(trial):
        for r in range(R):
            steps[r].write_inputs(r, trial)
        torch.cuda.synchronize()
        for r in range(R):  # one thread enqueues every rank's whole step, forward and backward
            with torch.cuda.stream(streams[r]):
                steps[r].step()
        torch.cuda.synchronize()

    eager(0)
    eager(1)  # warm-up: .grad exists
    graphs = [capture(steps[r], streams[r]) for r in range(R)]
    torch.cuda.synchronize()
    errors, seen = [], set()
    for trial in range(2, 2 + TRIALS):
        for r in range(R):
            steps[r].write_inputs(r, trial)
        torch.cuda.synchronize()
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        replayed = [steps[r].results(replayed=True) for r in range(R)]
        seen.add(tuple(replayed[0][-1][1].tolist()))  # rank 0's last layer's cu_seqlens of this replay
        eager(trial)
        for r in range(R):
            err = compare(replayed[r], steps[r].results(), f"rank {r} trial {trial}") or check_rows(models[r], R)
            if err:
                errors.append(err)
    for m in models:
        for moe in m.moes:
            moe.buffer.check_status()
    with open(out_path, "w") as f:
        json.dump({"errors": errors, "distinct_plans": len(seen)}, f)


def errors_in_processes(out_path, R=2):
    """run_processes on R processes (one rank each, all on cuda:0): every rank's list of errors, [[]] * R when every
    replay matched its eager step."""
    testing.spawn(run_processes, R, out_path)
    with open(out_path) as f:
        return json.load(f)


def main():
    """The in-processes test's body from a plain python3 parent (no pytest): `python3 tests/python/step_graph_cases.py`
    prints `pass`, or `FAIL` and the errors (exit status 1). scripts/device.sh step_graph_repeat runs it and
    the pytest test alternately (benchmarks/results/LOG.md: a race of results() once made it flaky)."""
    import tempfile

    import step_graph_cases as cases  # by its module name, so that the spawned processes import the same functions

    R = 2
    with tempfile.TemporaryDirectory() as tmp:
        errors = cases.errors_in_processes(os.path.join(tmp, "step_graph.json"), R)
    if errors == [[]] * R:
        print("pass")
        return 0
    print("FAIL " + json.dumps(errors))
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
