"""GPU soak through the public API, in the environment a user has (no CUDA_MODULE_LOADING, no other special
variables): many steps of plan + dispatch + combine with a fresh skewed routing each step, then the checks.

    python3 benchmarks/soak/gpu_soak.py --mode virtual --ranks 4 --steps 3000      # R virtual ranks, ONE host thread
    python3 benchmarks/soak/gpu_soak.py --mode processes --ranks 2 --steps 1000    # R processes sharing GPU 0 (ipc)

virtual: R flatep.virtual ranks on one GPU, one stream each, and one thread that enqueues every rank's ops in turn
(the way a benchmark or a single-controller test drives them: no rank waits for the host between its ops). This is
the setting where a lazily loaded kernel, or any other context-wide synchronisation between two ranks' launches,
deadlocks until the timeout while a rank's kernel spins for a peer. FlatEP's own ops launch no such kernel; the soak's
own checks (torch kernels) are enqueued after every rank's ops of the step, as flatep.virtual asks of its users.
processes: R processes (torch.distributed, gloo) sharing GPU 0 through the ipc transport.

Every step draws its routing from a bank of skewed routings (sigma 0.5-2.5, so maxvio 1-20) under a fresh expert
permutation (both on the GPU, no host synchronisation). Checks, all at the end (a failure exits 1 naming it):
  * no op raised, and every Buffer's check_status() is clean;
  * exact mode: every rank received exactly S*K rows at every step (cu_seqlens[-1] with align 1, kept on the GPU);
  * every --replay-every'th step is run a second time with the same inputs right after, and its outputs must be
    bitwise equal to the first run's (determinism, and no stale state between steps), compared on the GPU;
  * device memory is flat: torch's allocated bytes after the warm-up steps and at the end are equal, and (virtual
    mode: one process owns the GPU) free device memory differs by at most 1 MiB;
  * the whole run stays under --max-seconds (a first step that hung until the timeout fails this).
Prints one CSV row (mode, R, S, H, E, K, steps, seconds, ms per step, checked steps, ...) and PASS/FAIL lines.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import flatep  # noqa: E402
from flatep import testing, virtual  # noqa: E402

BF16 = torch.bfloat16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["virtual", "processes"], default="virtual")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=20, help="steps before the memory baseline is taken")
    p.add_argument("--replay-every", type=int, default=50)
    p.add_argument("--bank", type=int, default=16, help="distinct skewed routings the steps draw from")
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--csv", default=None)
    return p.parse_args(argv)


def routing_bank(args, device):
    """[bank, R, S, K] int64 expert ids on the device: skews from sigma 0.5 to 2.5, every rank its own draw."""
    bank = []
    for b in range(args.bank):
        sigma = 0.5 + 2.0 * b / max(1, args.bank - 1)
        bank.append(
            torch.stack(
                [
                    testing.sample_topk(args.experts, args.tokens, args.topk, r, sigma=sigma, seed=100 + b).long()
                    for r in range(args.ranks)
                ]
            )
        )
    return torch.stack(bank).to(device)


class Rank:
    """One rank's state: its Buffer, stream, token rows and what the checks need (all on the device)."""

    def __init__(self, args, group, rank, device):
        self.rank, self.device = rank, device
        self.buffer = flatep.Buffer(group, args.tokens, args.hidden, args.experts, args.topk, align=1, device=device)
        self.stream = torch.cuda.Stream(device)
        g = torch.Generator().manual_seed(rank)
        self.x = torch.randn(args.tokens, args.hidden, generator=g).to(BF16).to(device)
        self.rows = torch.zeros(args.steps, dtype=torch.int32, device=device)  # cu_seqlens[-1] of every step
        self.differs = torch.zeros(args.steps, dtype=torch.bool, device=device)  # replay != first run

    def step(self, idx, weights):
        """One step's FlatEP ops on this rank's stream: (combine output, cu_seqlens)."""
        with torch.cuda.stream(self.stream), torch.no_grad():
            plan = self.buffer.plan(idx)
            recv_x, recv_w, cu = self.buffer.dispatch(plan, self.x, weights)
            return self.buffer.combine(plan, recv_x, recv_w), cu

    def record(self, step, cu, out, first=None):
        """The checks' own torch kernels, enqueued after every rank's ops of the step (see run_loop)."""
        with torch.cuda.stream(self.stream), torch.no_grad():
            self.rows[step].copy_(cu[-1])
            if first is not None:
                self.differs[step].copy_((out.view(torch.int16) != first.view(torch.int16)).any())


def step_inputs(bank, perm_gen, args, step, device):
    """This step's routing of every rank: a bank entry under a fresh expert permutation, and fp32 weights."""
    perm = torch.randperm(args.experts, generator=perm_gen, device=device)
    idx = perm[bank[step % args.bank]]  # [R, S, K]
    weights = torch.rand(args.ranks, args.tokens, args.topk, generator=perm_gen, device=device)
    return idx, weights


def run_loop(args, ranks, device, my_ranks):
    """The soak loop over the ranks this thread drives (all R in virtual mode, one in processes mode)."""
    bank = routing_bank(args, device)
    perm_gen = torch.Generator(device=device).manual_seed(7)  # the same sequence on every process
    torch.cuda.synchronize(device)
    free_base = alloc_base = None
    start = time.perf_counter()
    checked = 0
    for step in range(args.steps):
        if step == args.warmup:
            torch.cuda.synchronize(device)
            free_base, alloc_base = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_allocated(device)
        idx, weights = step_inputs(bank, perm_gen, args, step, device)
        for r in my_ranks:  # the inputs are made on the default stream: each rank's stream waits for them
            ranks[r].stream.wait_stream(torch.cuda.current_stream(device))
        # FlatEP's ops of every rank first, the checks' torch kernels after them: a torch kernel loaded lazily (its
        # first launch) may wait for every running kernel, so it must not come between two ranks' collectives.
        outs = {r: ranks[r].step(idx[r], weights[r]) for r in my_ranks}
        replay = args.replay_every > 0 and step % args.replay_every == 0
        again = {r: ranks[r].step(idx[r], weights[r]) for r in my_ranks} if replay else {}
        for r in my_ranks:
            ranks[r].record(step, outs[r][1], outs[r][0])
            if replay:
                ranks[r].record(step, again[r][1], again[r][0], first=outs[r][0])
        checked += int(replay)
        for r in my_ranks:
            torch.cuda.current_stream(device).wait_stream(ranks[r].stream)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    failures = []
    for r in my_ranks:
        try:
            ranks[r].buffer.check_status()
        except Exception as e:  # noqa: BLE001 - reported as a failure below
            failures.append(f"rank {r}: check_status: {e}")
        bad = (ranks[r].rows != args.tokens * args.topk).nonzero().flatten()
        if bad.numel():
            s = int(bad[0])
            failures.append(f"rank {r}: step {s} received {int(ranks[r].rows[s])} rows, expected S*K")
        differs = ranks[r].differs.nonzero().flatten()
        if differs.numel():
            failures.append(f"rank {r}: replayed step {int(differs[0])} differs bitwise from its first run")
    free_end, alloc_end = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_allocated(device)
    if free_base is not None:
        if alloc_end != alloc_base:
            failures.append(f"torch's allocated device memory changed by {alloc_end - alloc_base} bytes")
        # Free device memory is the whole GPU's: only this process's in virtual mode (processes share the GPU).
        if args.mode == "virtual" and abs(free_base - free_end) > (1 << 20):
            failures.append(f"free device memory changed by {free_end - free_base} bytes (limit 1 MiB)")
    return seconds, checked, failures


def report(args, seconds, checked, failures, extra=""):
    ms = 1e3 * seconds / max(1, args.steps)
    row = (
        f"{args.mode},{args.ranks},{args.tokens},{args.hidden},{args.experts},{args.topk},{args.steps},"
        f"{seconds:.2f},{ms:.3f},{checked},{os.environ.get('CUDA_MODULE_LOADING', '(unset)')}{extra}"
    )
    print("mode,R,S,H,E,K,steps,seconds,ms_per_step,replayed_steps,CUDA_MODULE_LOADING")
    print(row)
    if args.csv:
        with open(args.csv, "a") as f:
            f.write(row + "\n")
    if seconds > args.max_seconds:
        failures.append(f"the run took {seconds:.1f} s, over --max-seconds {args.max_seconds:g}")
    for f in failures:
        print("FAIL", f)
    if not failures:
        print(f"PASS {args.mode}: {args.steps} steps, {checked} replayed bitwise, S*K rows every step, status ok")
    return 0 if not failures else 1


def main_virtual(args):
    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(args.ranks, device)
    ranks = virtual.run_threads(args.ranks, lambda r: Rank(args, group[r], r, device))
    seconds, checked, failures = run_loop(args, ranks, device, list(range(args.ranks)))
    return report(args, seconds, checked, failures)


def process_body(rank, world_size, args):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ranks = {rank: Rank(args, None, rank, device)}
    seconds, checked, failures = run_loop(args, ranks, device, [rank])
    with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"seconds": seconds, "checked": checked, "failures": failures}, f)


def main_processes(args):
    with tempfile.TemporaryDirectory() as tmp:
        args.result_dir = tmp
        try:
            testing.spawn(process_body, args.ranks, args)
        except Exception as e:  # noqa: BLE001 - a rank that raised: reported as a failure
            return report(args, 0.0, 0, [f"a rank process failed: {str(e).splitlines()[-1] if str(e) else e!r}"])
        results = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.ranks)]
    seconds = max(r["seconds"] for r in results)
    failures = [f for r in results for f in r["failures"]]
    return report(args, seconds, results[0]["checked"], failures)


if __name__ == "__main__":
    a = parse_args()
    sys.exit(main_virtual(a) if a.mode == "virtual" else main_processes(a))
