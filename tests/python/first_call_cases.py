"""Programs a user writes from the README, each the first FlatEP call of a fresh process (issue 59): no warm-up, CUDA's
module loading as the user has it, every rank on its own thread and stream (virtual ranks) or in its own process,
some rank empty at the first step. Each case checks its outputs against flatep.testing.DenseMoE (the same weights,
every expert in one process) or, for a captured CUDA graph, bitwise against the same step run eagerly.

    python3 tests/python/first_call_cases.py CASE MODE DEVICE OUT_DIR   # exit 0: OUT_DIR/result.json has no errors
    CASE    train_empty | serve_empty_b0 | serve_empty_b1 | serve_empty_b3 | owner_empty | switch_planners | capture
    MODE    virtual (R threads of this process) | processes (R processes joined by gloo)
    DEVICE  cpu | cuda (rank r on GPU r % device count)

tests/python/test_first_call.py runs every case in a fresh interpreter (CPU here; CUDA on a GPU machine).
"""

import json
import os
import sys
import time

import torch

H, F, E, K = 128, 64, 16, 4
TOLERANCE = 2e-2  # relative L2 error against the dense reference (bf16 values)
CASES = {
    # name: (R, num_slots, the steps: (planner, S, tokens per rank))
    "train_empty": (2, None, [("balanced", 32, [32, 0]), ("balanced", 32, [0, 20])]),
    "serve_empty_b0": (4, 0, [("balanced", 32, [32, 0, 17, 5]), ("balanced", 32, [3, 32, 0, 32])]),
    "serve_empty_b1": (4, 1, [("balanced", 32, [32, 0, 17, 5]), ("balanced", 32, [3, 32, 0, 32])]),
    "serve_empty_b3": (4, 3, [("balanced", 32, [32, 0, 17, 5]), ("balanced", 32, [3, 32, 0, 32])]),
    "owner_empty": (4, 1, [("owner", 8, [8, 0, 3, 1]), ("owner", 8, [0, 8, 8, 2])]),
    "switch_planners": (4, 1, [("balanced", 32, [32, 0, 17, 5]), ("owner", 8, [0, 8, 1, 8]),
                               ("balanced", 32, [7, 32, 32, 0]), ("owner", 8, [8, 8, 0, 0])]),
    "capture": (4, 1, [("balanced", 32, [32, 0, 17, 5]), ("balanced", 32, [3, 32, 0, 32])]),
}
REPLAYS = 3  # the capture case: replays with new routing after its two eager steps


def step_inputs(step, rank, tokens, S):
    """Rank `rank`'s tokens [tokens, H] and routing [tokens, K] at `step` (every process draws the same)."""
    g = torch.Generator().manual_seed(1009 * step + rank)
    x = torch.randn(tokens, H, generator=g)
    scores = torch.rand(S, E, generator=g)
    scores[:, :2] += 0.5  # experts 0 and 1 are hot: replicas have something to do
    idx = scores.topk(K, dim=1).indices[:tokens]
    return x, idx


class Rank:
    """One rank's part of a case: its layer, stream and results."""

    def __init__(self, case, rank, group, device):
        import flatep

        R, slots, steps = CASES[case]
        self.case, self.rank, self.device = case, rank, device
        self.virtual = group is not None
        self.training = case == "train_empty"
        planner, S, _ = steps[0]
        self.moe = flatep.nn.MoE(H, F, E, K, group=group, num_tokens=S, num_slots=slots, planner=planner, align=8,
                                 seed=3, device=device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.results = []

    def _stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else _Null()

    def step(self, i):
        planner, S, tokens = CASES[self.case][2][i]
        if self.moe.planner != planner or self.moe.num_tokens != S:
            self.moe.use_planner(planner, S)
        x, idx = step_inputs(i, self.rank, tokens[self.rank], S)
        with self._stream():
            if self.training:
                xd = x.to(self.device).requires_grad_()
                self.moe.zero_main_grad()
                self.moe.router.weight.grad = None
                out = self.moe(xd, idx.to(self.device))
                (out.float() ** 2).sum().backward()
                result = dict(out=out, x_grad=xd.grad, router_grad=self.moe.router.weight.grad,
                              w1_grad=self.moe.w1.main_grad, w2_grad=self.moe.w2.main_grad)
            else:
                with torch.inference_mode():
                    result = dict(out=self.moe(x.to(self.device), idx.to(self.device)))
            if self.stream is not None:
                self.stream.synchronize()
        self.results.append({k: (v.detach().cpu().clone() if v is not None else None) for k, v in result.items()})

    def capture(self):
        """One inference forward captured as a CUDA graph on the rank's stream, from this (the rank's) thread, the way
        a user writes it; then REPLAYS replays with new inputs and routing, each against the same step run eagerly."""
        _, S, tokens = CASES[self.case][2][-1]
        x, idx = step_inputs(0, self.rank, tokens[self.rank], S)
        static_x, static_idx = x.to(self.device), idx.to(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            if self.virtual:  # the ranks of one process capture one at a time (flatep.virtual.graph says why)
                from flatep import virtual

                capture = virtual.graph(graph, stream=self.stream, capture_error_mode="thread_local")
            else:
                capture = torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local")
            with capture:
                static_out = self.moe(static_x, static_idx)
        self.graph, self.static = graph, (static_x, static_idx, static_out)

    def replay(self, i):
        _, S, tokens = CASES[self.case][2][-1]
        static_x, static_idx, static_out = self.static
        x, idx = step_inputs(100 + i, self.rank, tokens[self.rank], S)
        with self._stream():
            static_x.copy_(x)
            static_idx.copy_(idx)
            self.graph.replay()
            replayed = static_out.clone()
            with torch.inference_mode():
                eager = self.moe(x.to(self.device), idx.to(self.device))
            self.stream.synchronize()
        self.results.append(dict(replayed=replayed.cpu(), eager=eager.cpu()))


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def phases(case, device):
    """The case as a list of (name, fn(rank_obj)) run on every rank in order (one run_threads call each on virtual
    ranks: a rank's thread is the same for all of them)."""
    steps = CASES[case][2]
    out = [("step", lambda rk, i=i: rk.step(i)) for i in range(len(steps))]
    if case == "capture" and device.type == "cuda":
        out.append(("capture", lambda rk: rk.capture()))
        out += [("replay", lambda rk, i=i: rk.replay(i)) for i in range(REPLAYS)]
    return out


def rank_device(rank):
    if DEVICE == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def run_virtual(case, out_dir):
    from flatep import virtual

    R = CASES[case][0]
    devices = [rank_device(r) for r in range(R)]
    ranks = virtual.virtual_ranks(R, devices if DEVICE == "cuda" else "cpu")
    objs = virtual.run_threads(R, lambda r: Rank(case, r, ranks[r], devices[r]))
    for _, fn in phases(case, devices[0]):
        virtual.run_threads(R, lambda r: fn(objs[r]))
    for r in range(R):
        torch.save(objs[r].results, os.path.join(out_dir, f"rank{r}.pt"))


def process_main(rank, world_size, case, out_dir):
    """One rank's process (flatep.testing.spawn): the case's phases in order."""
    if DEVICE == "cuda":
        torch.cuda.set_device(rank_device(rank))
    obj = Rank(case, rank, None, rank_device(rank))
    for _, fn in phases(case, rank_device(rank)):
        fn(obj)
    torch.save(obj.results, os.path.join(out_dir, f"rank{rank}.pt"))


def relative_error(a, b):
    a, b = a.float(), b.float()
    if b.numel() == 0 and a.numel() == 0:
        return 0.0
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp(min=1e-12)).item()


def check(case, out_dir):
    """Errors (a list of one-line strings) of every rank's results against the dense reference or eager replay."""
    from flatep import testing

    R, _, steps = CASES[case]
    results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(R)]
    errors = []
    dense = testing.DenseMoE(H, F, E, K, seed=3)
    worst = 0.0
    for i, (planner, S, tokens) in enumerate(steps):
        inputs = [step_inputs(i, r, tokens[r], S) for r in range(R)]
        xs = torch.cat([x for x, _ in inputs]).requires_grad_()
        ref = dense(xs, torch.cat([idx for _, idx in inputs]), chunks=tokens)
        out = torch.cat([results[r][i]["out"] for r in range(R)])
        if out.shape != ref.shape:
            errors.append(f"step {i} ({planner}): output {list(out.shape)}, reference {list(ref.shape)}")
            continue
        pairs = [("output", out, ref.detach())]
        if case == "train_empty":
            dense.zero_grad()
            (ref.float() ** 2).sum().backward()
            pairs += [
                ("x grad", torch.cat([results[r][i]["x_grad"] for r in range(R)]), xs.grad),
                ("router grad", sum(results[r][i]["router_grad"] for r in range(R)), dense.router_weight.grad),
                ("w1 main_grad", torch.cat([results[r][i]["w1_grad"] for r in range(R)]), dense.w1.grad),
                ("w2 main_grad", torch.cat([results[r][i]["w2_grad"] for r in range(R)]), dense.w2.grad),
            ]
        for what, got, want in pairs:
            err = relative_error(got, want)
            worst = max(worst, err)
            if not err <= TOLERANCE:
                errors.append(f"step {i} ({planner}, tokens {tokens}): {what} error {err:.2e} > {TOLERANCE:.0e}")
    replays = 0
    for r in range(R):
        for j, res in enumerate(results[r][len(steps):]):
            replays += 1
            if not torch.equal(res["replayed"], res["eager"]):
                bad = (res["replayed"] != res["eager"]).nonzero()
                errors.append(f"rank {r} replay {j}: the graph's output differs from eager at {len(bad)} values, "
                              f"first {bad[0].tolist()}")
    return errors, worst, replays


DEVICE = "cpu"


def main(argv):
    global DEVICE
    if len(argv) != 4 or argv[0] not in CASES or argv[1] not in ("virtual", "processes") or argv[2] not in (
            "cpu", "cuda"):
        sys.exit(f"usage: first_call_cases.py CASE MODE DEVICE OUT_DIR (CASE one of {', '.join(CASES)}), got {argv}")
    case, mode, DEVICE, out_dir = argv
    if mode == "virtual":
        from flatep import virtual  # noqa: F401  (before CUDA starts, as the README's programs do)
    os.makedirs(out_dir, exist_ok=True)
    start = time.monotonic()
    if mode == "virtual":
        run_virtual(case, out_dir)
    else:
        from flatep import testing

        os.environ["FLATEP_FIRST_CALL_DEVICE"] = DEVICE
        testing.spawn(process_entry, CASES[case][0], case, out_dir)
    seconds = time.monotonic() - start
    errors, worst, replays = check(case, out_dir)
    result = dict(case=case, mode=mode, device=DEVICE, seconds=seconds, errors=errors, worst_error=worst,
                  replays=replays)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)
    print(json.dumps(result))
    return 1 if errors else 0


def process_entry(rank, world_size, case, out_dir):
    global DEVICE
    DEVICE = os.environ["FLATEP_FIRST_CALL_DEVICE"]
    process_main(rank, world_size, case, out_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
