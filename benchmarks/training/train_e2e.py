#!/usr/bin/env python3
"""End-to-end training: FlatEP against the all-to-all baseline on the same MoE language model, data and init.

    /usr/bin/python3 benchmarks/training/train_e2e.py --preset tiny --out /tmp/e2e    # CPU, 2 virtual ranks, seconds
    python3 benchmarks/training/train_e2e.py --preset h200 --out benchmarks/results/train_e2e_h200  # 8 ranks, 1 GPU
    python3 benchmarks/training/train_e2e.py --preset h200 --router-bias 1 --router-bias-ramp 300 \\
        --out benchmarks/results/train_e2e_h200_bias                                # the imbalance made to grow
    python3 benchmarks/training/train_e2e.py --preset h200 --processes --steps 40 --memory-every 5 \\
        --out benchmarks/results/train_e2e_h200_processes                           # one process per rank, one GPU

The model, data, optimizer and both MoE layers are examples/train_lm.py's (every one of its flags applies; --impl is
both). In one invocation the script trains FlatEP (flatep.nn.MoE), releases its memory, then trains the baseline
(flatep.baseline.AllToAllMoE) for the same steps from the same init on the same windows, and records per step:

* loss (both; the mean over ranks of each rank's cross-entropy + auxiliary loss) and its difference against the
  tolerance below, checked at every step (exit status 1 when a step exceeds it);
* per MoE layer: the router's realised maxvio (flatep.testing.maxvio of the step's [R, E] counts) and the rows each
  rank computed (FlatEP: plan.stats loads, S*K in exact mode; baseline: its experts' entries), max and mean over ranks;
* the slowest rank's step time: CUDA events on each rank's stream from the step's first op to its optimizer step
  (on the CPU: the step's wall time); on virtual ranks also the step's wall time. Virtual ranks share ONE GPU: a
  rank's step time includes the others' work running beside it, so the figures are those of R ranks time-sharing a
  GPU, not of R GPUs;
* memory per rank: virtual ranks: torch.cuda.memory_snapshot() every --memory-every steps, its segments grouped by
  the stream they belong to (each rank's own stream and its Buffer's comm stream): reserved = the segments' size,
  allocated = their allocated bytes, sampled after every rank's forward (the activations' peak) and at the step's
  end, "peak" the larger; plus torch.cuda.max_memory_allocated / memory_reserved of the whole device. Processes:
  torch.cuda.max_memory_allocated (reset every step) and memory_reserved of each process. FlatEP's own memory (Buffer,
  pools: outside torch's allocator) is measured once, from the free memory it took, and reported apart: on virtual
  ranks that is every rank's together (and the CUDA context's growth meanwhile), on processes the largest rank's;
* tokens per second: R * S over the slowest rank's step time.

Outputs in --out: steps.csv (one row per implementation, step and MoE layer), memory.csv (implementation, step, rank),
loss.csv (per step both losses, the difference, the tolerance), trace_flatep.npz / trace_baseline.npz (flatep.trace
routing traces: exact counts of every step and layer, the ids of the first --trace-tokens tokens of each rank),
train_e2e.png (loss, maxvio per layer, step time and memory against step, both implementations on one figure), and
a summary table printed last: per implementation the mean step time of the first and last 50 steps (after
--skip-steps warm-up steps) and their ratio, tokens/s over the last 100 steps and the FlatEP / baseline ratio, peak
memory, the largest loss difference against its tolerance, maxvio per layer first and last.

Loss tolerance (per step t, on |loss_flatep - loss_baseline|; docs/performance.md "End-to-end training"):

    tol(t) = c * u * max(loss_flatep(t), loss_baseline(t)) * sqrt(t + 1),   u = 2^-8, c = --tolerance-scale (1)

The two runs differ only in where bf16 rounding falls: FlatEP's combine rounds each token's per-destination-rank
partial sums to bf16 before adding them (design §6), the baseline sums a token's K terms once; an expert's gradient
is FlatEP's sum of its owner's and replicas' partial gradients (bf16 GEMM outputs on a GPU), the baseline's one GEMM.
Each is a rounding of relative size at most u = 2^-8 (bf16 keeps 8 significant bits) of a value both compute. At
step 0 the weights are equal and the loss moves by the forward's roundings alone, well under u * loss. Every step
after adds an independent perturbation of the same order to the trajectory (the gradients, hence Adam's updates,
differ by such roundings), and independent perturbations add like a random walk: after t + 1 steps the expected
relative difference is about u * sqrt(t + 1). The bound takes c = 1 of that. Checked on the CPU (--spread: the tiny
model with 4 ranks, E=16, K=4 for 300 steps; the baseline against itself with each token's K terms summed in the
reverse order, and FlatEP against the baseline; docs/performance.md has the figures): both stay below 0.3 of it.

Presets (explicit flags override them): tiny (CPU, 2 virtual ranks, 20 steps) and h200, the issue's target: 8 blocks
(4 MoE), hidden 1024, 16 heads, E=64 experts of F=512 (K=4: the active expert size 2048 = the dense blocks' FFN),
seq_len 1024, 4 sequences per rank (S = 4096 tokens per rank, 32768 a step), 8 virtual ranks, 300 steps. How S was
chosen: per token a forward costs 2 * (attention projections 4H^2 + causal attention T*H + dense FFN 3*H*2048 or
experts K*3*H*F + router E*H) per block, with backward 0.56 GFLOP (flops_per_token): 18 TFLOP a step. At a third of
the H200's 990 bf16 TFLOP/s that is 55 ms of GEMMs; with the routing, the communication and the host's launches for 8
ranks a step is estimated at 0.2-0.35 s, 300 steps of both implementations 2-3.5 minutes plus a minute of start-up:
inside the ~7 minutes of one device call. Memory (memory_estimate: weights, gradients and AdamW state, activations
kept for backward with the baseline's hottest rank at twice the even load, the CUDA context): 71 GiB for the preset,
125 GiB at S = 8192 (too close to the H200's 141 GiB for the baseline's fragmentation to show); a configuration that
the estimate says does not fit the free memory is refused before anything is allocated. --estimate prints both
estimates and exits.
"""

import argparse
import copy
import csv
import gc
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))

import train_lm as lm  # noqa: E402  (imports flatep.virtual before CUDA starts)
import torch  # noqa: E402

import flatep  # noqa: E402
from flatep.trace import RoutingTrace  # noqa: E402

IMPLS = ("flatep", "baseline")
BF16_UNIT_ROUNDOFF = 2.0 ** -8
GIB = float(1 << 30)
PRESETS = {
    "tiny": dict(device="cpu", virtual=True, ranks=2, steps=20, blocks=4, hidden=64, heads=4, ffn=32, experts=8,
                 topk=2, seq_len=32, batch=2, warmup=5, memory_every=5, trace_tokens=None, skip_steps=1),
    "h200": dict(device="cuda", virtual=True, ranks=8, steps=300, blocks=8, hidden=1024, heads=16, ffn=512,
                 experts=64, topk=4, seq_len=1024, batch=4, lr=1e-3, warmup=30, memory_every=10, trace_tokens=256,
                 skip_steps=5),
}


def build_parser():
    p = lm.build_parser(prog="train_e2e")
    p.description = __doc__.split("\n\n")[0]
    a = p.add_argument
    a("--preset", choices=sorted(PRESETS), default=None, help="a configuration (explicit flags override it)")
    a("--out", default=None, help="folder of the CSVs, traces and figure (default: a temporary folder)")
    a("--processes", action="store_true", help="one process per rank (all on one GPU) instead of virtual ranks")
    a("--memory-every", type=int, default=10, help="steps between memory snapshots (virtual ranks)")
    a("--trace-tokens", type=int, default=None, help="token ids kept per rank and step in the trace (default: all)")
    a("--skip-steps", type=int, default=5, help="warm-up steps left out of the first-steps mean")
    a("--tolerance-scale", type=float, default=1.0, help="c of the loss tolerance (module docstring)")
    a("--spread", action="store_true",
      help="the tolerance's check: the baseline against itself with reversed summation order, and FlatEP")
    a("--estimate", action="store_true", help="print the memory and FLOP estimates and exit")
    a("--no-plot", action="store_true")
    a("--inject-mismatch", action="store_true", help=argparse.SUPPRESS)  # tests: the loss check must fail
    return p


def parse_args(argv=None):
    p = build_parser()
    first, _ = p.parse_known_args(argv)
    if first.preset:
        p.set_defaults(**PRESETS[first.preset])
    args = p.parse_args(argv)
    args.virtual = not args.processes
    try:
        lm.check_args(args)
        for name in ("memory_every",):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        S = args.batch * args.seq_len
        if args.trace_tokens is not None and not 0 <= args.trace_tokens <= S:
            raise ValueError(f"--trace-tokens must be in [0, S={S}], got {args.trace_tokens}")
        if args.skip_steps < 0 or args.skip_steps >= args.steps:
            raise ValueError(f"--skip-steps must be in [0, --steps), got {args.skip_steps}")
        if not args.tolerance_scale > 0:
            raise ValueError(f"--tolerance-scale must be positive, got {args.tolerance_scale}")
        if args.resume or args.save:
            raise ValueError("--resume / --save are train_lm.py's: this benchmark trains from the init")
    except ValueError as e:
        p.error(str(e))
    return args


# ---- estimates ----


def flops_per_token(args):
    """Training FLOPs per token (forward 2 per multiply-add, backward twice the forward): attention projections,
    causal attention (half of T), the dense FFN or the K experts and the router, the head."""
    H, T = args.hidden, args.seq_len
    attention = 4 * H * H + T * H  # qkv + proj; QK^T and AV over T/2 keys on average
    dense = 3 * H * args.dense_ffn
    moe = 3 * H * args.ffn * args.topk + H * args.experts + (3 * H * args.shared_ffn if args.shared_ffn else 0)
    blocks = args.blocks // 2
    forward = (args.blocks * attention + (args.blocks - blocks) * dense + blocks * moe + lm.VOCAB * H)
    return 3 * 2 * forward


def memory_estimate(args, num_ranks):
    """(bytes per rank, a one-line account) of training this model: weights with their gradients and AdamW state,
    activations kept for backward, the MoE layer's buffers (the baseline's hottest rank at twice the even load), and
    the CUDA context."""
    H, E, K, F, R = args.hidden, args.experts, args.topk, args.ffn, num_ranks
    S, L = args.batch * args.seq_len, args.blocks
    moe_blocks, dense_blocks = L // 2, L - L // 2
    shared = 3 * H * args.shared_ffn if args.shared_ffn else 0
    replicated = 2 * lm.VOCAB * H + L * (4 * H * H + 2 * H) + dense_blocks * 3 * H * args.dense_ffn + \
        moe_blocks * (E * H + shared) + H
    experts = moe_blocks * (E // R) * 3 * H * F
    weights = 20 * replicated + 18 * experts + 6 * (E // R) * 3 * H * F  # fp32 + grad + AdamW + all-reduce; bf16
    # expert + main_grad + master + AdamW; the slot pool (bf16 weights, fp32 gradients) of one layer's size
    attention = 40 * H + (4 * args.heads * args.seq_len if not hasattr(torch.nn.functional,
                                                                      "scaled_dot_product_attention") else 0)
    dense = 18 * args.dense_ffn + 6 * H
    moe = 2 * K * (18 * F + 12 * H) + 12 * E + 8 * H + (18 * args.shared_ffn if args.shared_ffn else 0)
    activations = S * (L * attention + dense_blocks * dense + moe_blocks * moe + 12 * lm.VOCAB + 8 * H)
    context = (1 << 30) if args.device == "cuda" else 0
    per_rank = weights + activations + context // (R if args.virtual else 1)
    text = (f"{weights / GIB:.2f} GiB weights and optimizer state + {activations / GIB:.2f} GiB activations per rank"
            f" (S={S}), {R} ranks, + {context / GIB:.0f} GiB CUDA context and modules per process")
    return per_rank, text


def check_fits(args, num_ranks):
    """Refuses (SystemExit, one line) before anything is allocated on the GPU when the estimate exceeds its free
    memory."""
    per_rank, text = memory_estimate(args, num_ranks)
    need = per_rank * num_ranks
    if args.device != "cuda":
        return need, text
    free, _ = torch.cuda.mem_get_info()
    if need > free:
        sys.exit(f"train_e2e: error: this configuration needs about {need / GIB:.1f} GiB of GPU memory ({text}), "
                 f"the GPU has {free / GIB:.1f} GiB free; lower --batch or --seq-len, or use fewer --ranks")
    return need, text


# ---- the loss tolerance ----


def loss_tolerance(step, loss_a, loss_b, scale=1.0):
    """The per-step tolerance of |loss_a - loss_b| (module docstring): scale * u * max(loss) * sqrt(step + 1)."""
    return scale * BF16_UNIT_ROUNDOFF * max(abs(loss_a), abs(loss_b)) * math.sqrt(step + 1)


# ---- memory ----


def rank_streams(state):
    """The CUDA stream handles whose memory is rank `state`'s: its own stream and its Buffer's comm stream."""
    handles = [state.stream.cuda_stream]
    for m in state.model.moe_layers:
        comm = getattr(getattr(m.moe, "buffer", None), "comm_stream", None)
        if comm is not None and comm.cuda_stream not in handles:
            handles.append(comm.cuda_stream)
    return handles


def memory_by_rank(streams):
    """[(allocated, reserved) bytes] per rank from torch.cuda.memory_snapshot(), segments grouped by stream."""
    owner = {h: r for r, handles in enumerate(streams) for h in handles}
    out = [[0, 0] for _ in streams]
    for segment in torch.cuda.memory_snapshot():
        r = owner.get(segment.get("stream"))
        if r is not None:
            out[r][0] += segment["allocated_size"]
            out[r][1] += segment["total_size"]
    return out


# ---- one implementation's run ----


class Recorder:
    """Collects one implementation's steps: rows for the CSVs and its routing trace."""

    def __init__(self, impl, args, num_ranks):
        self.impl, self.args, self.R = impl, args, num_ranks
        S = args.batch * args.seq_len
        self.trace = RoutingTrace(
            num_ranks, args.experts, args.topk, S, args.blocks // 2,
            record_tokens=S if args.trace_tokens is None else args.trace_tokens, seed=args.seed,
            meta=dict(impl=impl, hidden=args.hidden, heads=args.heads, blocks=args.blocks, ffn=args.ffn,
                      dense_ffn=args.dense_ffn, shared_ffn=args.shared_ffn, seq_len=args.seq_len, batch=args.batch,
                      lr=args.lr, aux_loss=args.aux_loss, router_bias=args.router_bias,
                      router_temperature=args.router_temperature, command=args.command))
        self.steps, self.memory, self.static_bytes = [], [], 0

    def add(self, record, memory=None, device_peak=None):
        S, R = self.args.batch * self.args.seq_len, self.R
        times = record.rank_ms if record.rank_ms and None not in record.rank_ms else [record.wall_ms] * R
        slowest = max(times)
        for layer, (counts, ids, loads) in enumerate(zip(record.counts, record.ids, record.loads)):
            self.trace.record(record.step, layer, ids, counts=counts)
            self.steps.append(dict(
                impl=self.impl, step=record.step, layer=layer, loss=record.loss, ce=record.ce, lr=record.lr,
                grad_norm=record.grad_norm, maxvio=record.maxvio[layer], rows_max=max(loads),
                rows_mean=sum(loads) / len(loads), step_ms=slowest, step_ms_mean=sum(times) / len(times),
                wall_ms=record.wall_ms, tokens_per_s=R * S / slowest * 1e3,
                device_peak_gib=None if device_peak is None else device_peak[0] / GIB,
                device_reserved_gib=None if device_peak is None else device_peak[1] / GIB))
        for r, m in enumerate(memory or []):
            self.memory.append(dict(impl=self.impl, step=record.step, rank=r, **{k: v / GIB for k, v in m.items()}))

    def per_step(self):
        """The layer-0 row of every step (the per-step columns)."""
        return [row for row in self.steps if row["layer"] == 0]


def _free_bytes(device):
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def run_virtual(args, impl, corpus):
    """Trains `impl` on virtual ranks in this process; returns its Recorder."""
    args = copy.copy(args)
    args.impl = impl
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    before, reserved = _free_bytes(device), (torch.cuda.memory_reserved(device) if cuda else 0)
    states = lm.make_virtual(args, corpus)
    R = len(states)
    if args.inject_mismatch and impl == "baseline":  # a wrong layer: the experts' W2 half again too large
        for st in states:
            for m in st.model.moe_layers:
                with torch.no_grad():
                    m.moe.w2.mul_(1.5)
                st.opt_experts.load_state_dict(st.opt_experts.state_dict() | {"masters": [
                    p.detach().float() for p in st.experts]})
    rec = Recorder(impl, args, R)
    if cuda:
        torch.cuda.synchronize(device)
        rec.static_bytes = max(0, before - _free_bytes(device) - (torch.cuda.memory_reserved(device) - reserved))
    streams = [rank_streams(st) for st in states] if cuda else None
    T = rec.trace.record_tokens
    print(lm.banner(args, R, corpus, "virtual ranks"), flush=True)
    for step in range(args.steps):
        sample = cuda and (step % args.memory_every == 0 or step == args.steps - 1)
        after_forward = {}
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

        def snapshot():
            after_forward["at"] = memory_by_rank(streams)

        record = lm.virtual_step(states, step, record_tokens=T, timed=True,
                                 after_forward=snapshot if sample else None)
        memory = device_peak = None
        if cuda:
            device_peak = (torch.cuda.max_memory_allocated(device), torch.cuda.memory_reserved(device))
        if sample:
            end = memory_by_rank(streams)
            memory = [dict(allocated_forward=f[0], allocated_end=e[0], peak=max(f[0], e[0]), reserved=e[1])
                      for f, e in zip(after_forward["at"], end)]
        rec.add(record, memory, device_peak)
        print(f"{impl:>8} " + record.line(args), flush=True)
    del states
    release(device)
    return rec


def release(device):
    """Frees what a run left: FlatEP's shared Buffers, pools and transports, torch's cached blocks."""
    flatep.testing.release_all()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _process_body(rank, R, args, result_path):
    """One rank of --processes: both implementations in turn; rank 0 writes the records."""
    device = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
        device = torch.device("cuda", 0)
    corpus = lm.Corpus(args.data, args.data_pattern)
    out = {}
    for impl in IMPLS:
        run_args = copy.copy(args)
        run_args.impl = impl
        before = _free_bytes(device)
        reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        state = lm.RankState(run_args, rank, R, None, device, corpus)
        rec = Recorder(impl, run_args, R)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            mine = max(0, before - _free_bytes(device) - (torch.cuda.memory_reserved(device) - reserved))
            rec.static_bytes = max(state.coll.all_gather_object(mine))  # ranks share the GPU: approximate
        if rank == 0:
            print(lm.banner(run_args, R, corpus, "processes, one GPU"), flush=True)
        for step in range(args.steps):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            record = lm.process_step(state, step, record_tokens=rec.trace.record_tokens, timed=True)
            memory = None
            if device.type == "cuda":
                mine = (torch.cuda.max_memory_allocated(device), torch.cuda.memory_reserved(device))
                memory = [dict(peak=p, reserved=q) for p, q in state.coll.all_gather_object(mine)]
            rec.add(record, memory)
            if rank == 0:
                print(f"{impl:>8} " + record.line(run_args), flush=True)
        del state
        release(device)
        out[impl] = rec
    if rank == 0:
        for impl, rec in out.items():
            rec.trace.save(result_path + f".{impl}.npz")
        with open(result_path, "w") as f:
            json.dump({impl: dict(steps=rec.steps, memory=rec.memory, static_bytes=rec.static_bytes)
                       for impl, rec in out.items()}, f)


def run_processes(args):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.json")
        flatep.testing.spawn(_process_body, args.ranks, args, path)
        with open(path) as f:
            data = json.load(f)
        out = {}
        for impl in IMPLS:
            rec = Recorder(impl, args, args.ranks)
            rec.steps, rec.memory = data[impl]["steps"], data[impl]["memory"]
            rec.static_bytes = data[impl]["static_bytes"]
            rec.trace = RoutingTrace.load(path + f".{impl}.npz")
            out[impl] = rec
    return out


# ---- outputs ----


def write_csv(path, rows, comment):
    if not rows:
        return
    fields = list(rows[0].keys())
    with open(path, "w", newline="") as f:
        f.write(comment)
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v)) for k, v in row.items()})


def compare_losses(recs, args):
    """Per step: both losses, |difference|, the tolerance and whether it holds."""
    rows = []
    for a, b in zip(recs["flatep"].per_step(), recs["baseline"].per_step()):
        tol = loss_tolerance(a["step"], a["loss"], b["loss"], args.tolerance_scale)
        diff = abs(a["loss"] - b["loss"])
        rows.append(dict(step=a["step"], loss_flatep=a["loss"], loss_baseline=b["loss"], diff=diff, tolerance=tol,
                         ok=int(diff <= tol)))
    return rows


def plot(recs, compare, path, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 8.5))
    colors = {"flatep": "tab:blue", "baseline": "tab:red"}
    for impl, rec in recs.items():
        steps = rec.per_step()
        x = [r["step"] for r in steps]
        ax[0][0].plot(x, [r["loss"] for r in steps], color=colors[impl], label=impl, lw=1)
        ax[1][0].plot(x, [r["step_ms"] for r in steps], color=colors[impl], label=f"{impl} (slowest rank)", lw=1)
        for layer in range(args.blocks // 2):
            rows = [r for r in rec.steps if r["layer"] == layer]
            ax[0][1].plot([r["step"] for r in rows], [r["maxvio"] for r in rows], color=colors[impl], lw=1,
                          ls="-" if impl == "flatep" else "--", alpha=0.4 + 0.6 * (layer + 1) / (args.blocks // 2),
                          label=f"{impl} MoE layer {layer}")
        mem = {}
        for m in rec.memory:
            entry = mem.setdefault(m["step"], [0.0, 0.0])
            entry[0], entry[1] = max(entry[0], m["peak"]), max(entry[1], m["reserved"])
        if mem:
            xs = sorted(mem)
            ax[1][1].plot(xs, [mem[s][0] for s in xs], color=colors[impl], marker=".", label=f"{impl} peak")
            ax[1][1].plot(xs, [mem[s][1] for s in xs], color=colors[impl], ls="--", label=f"{impl} reserved")
    twin = ax[0][0].twinx()
    twin.plot([c["step"] for c in compare], [c["diff"] for c in compare], color="gray", lw=0.7, label="|difference|")
    twin.plot([c["step"] for c in compare], [c["tolerance"] for c in compare], color="black", ls=":",
              label="tolerance")
    twin.set_ylabel("loss difference")
    twin.legend(loc="upper center", fontsize=8)
    titles = [["loss (mean over ranks)", "router maxvio per MoE layer"],
              ["step time, slowest rank (ms)", "memory per rank, largest rank (GiB)"]]
    for i in range(2):
        for j in range(2):
            ax[i][j].set_title(titles[i][j])
            ax[i][j].set_xlabel("step")
            if ax[i][j].get_legend_handles_labels()[0]:
                ax[i][j].legend(fontsize=7)
            else:  # the CPU: no device memory to show
                ax[i][j].text(0.5, 0.5, "no GPU memory on the CPU backend", ha="center", transform=ax[i][j].transAxes)
    mode = "processes" if args.processes else "virtual ranks"
    fig.suptitle(f"{args.command}\nR={args.ranks} ({mode}, {args.device}), {args.blocks} blocks, H={args.hidden}, "
                 f"E={args.experts}, K={args.topk}, F={args.ffn}, S={args.batch * args.seq_len} per rank", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(recs, compare, args):
    n = args.steps
    window = min(50, max(1, (n - args.skip_steps) // 2))
    last_window = min(100, n)
    lines = [f"\nsummary: {n} steps, R={args.ranks} ({'processes' if args.processes else 'virtual ranks'} on "
             f"{args.device}); step time = the slowest rank's; first {window} steps after {args.skip_steps} warm-up "
             f"step(s), last {window}; tokens/s over the last {last_window} steps (wall: the steps' wall time, the "
             f"host's work included); memory per rank, the largest rank"]
    lines.append(f"{'impl':>9} {'first ms':>9} {'last ms':>9} {'last/first':>10} {'tok/s':>10} {'tok/s wall':>10} "
                 f"{'peak GiB':>9} {'reserved':>9} {'FlatEP own':>10}")
    own = "every rank's together" if not args.processes else "the largest rank's"
    lines[0] += f"; FlatEP own (outside torch's allocator): {own}"
    tokens = {}
    for impl, rec in recs.items():
        steps = rec.per_step()
        first = steps[args.skip_steps:args.skip_steps + window]
        last = steps[-window:]
        tail = steps[-last_window:]
        mean = lambda rows: sum(r["step_ms"] for r in rows) / len(rows)  # noqa: E731
        tokens[impl] = args.ranks * args.batch * args.seq_len * len(tail) / sum(r["step_ms"] for r in tail) * 1e3
        wall = args.ranks * args.batch * args.seq_len * len(tail) / sum(r["wall_ms"] for r in tail) * 1e3
        peak = max((m["peak"] for m in rec.memory), default=float("nan"))
        reserved = max((m["reserved"] for m in rec.memory), default=float("nan"))
        lines.append(f"{impl:>9} {mean(first):9.1f} {mean(last):9.1f} {mean(last) / mean(first):10.3f} "
                     f"{tokens[impl]:10.0f} {wall:10.0f} {peak:9.2f} {reserved:9.2f} {rec.static_bytes / GIB:10.2f}")
    lines.append(f"tokens/s FlatEP / baseline over the last {last_window} steps: "
                 f"{tokens['flatep'] / tokens['baseline']:.3f}")
    worst = max(compare, key=lambda c: c["diff"] / c["tolerance"])
    failed = [c["step"] for c in compare if not c["ok"]]
    lines.append(f"loss: largest |FlatEP - baseline| / tolerance = {worst['diff'] / worst['tolerance']:.3f} at step "
                 f"{worst['step']} ({worst['diff']:.3g} against {worst['tolerance']:.3g}); "
                 + ("every step within tolerance" if not failed else f"OUT OF TOLERANCE at steps {failed[:10]}"))
    for impl, rec in recs.items():
        vio = rec.trace.maxvio()
        cells = ", ".join(f"layer {l}: {vio[0, l]:.2f} -> {vio[-1, l]:.2f} (max {vio[:, l].max():.2f})"
                          for l in range(vio.shape[1]))
        lines.append(f"maxvio {impl}: {cells}")
    return "\n".join(lines), not failed


def spread(args, corpus):
    """The tolerance's empirical check (module docstring): the baseline, the baseline with reversed combine order,
    FlatEP; prints the largest |difference| / (u * loss * sqrt(t + 1)) of each pair and returns it."""
    losses = {}
    for name, impl, order in (("baseline", "baseline", None), ("reversed", "baseline", "reversed"),
                              ("flatep", "flatep", None)):
        run_args = copy.copy(args)
        run_args.impl = impl
        states = lm.make_virtual(run_args, corpus)
        for st in states:
            for m in st.model.moe_layers:
                if order:
                    m.moe.combine_order = order
        losses[name] = [lm.virtual_step(states, step).loss for step in range(args.steps)]
        del states
        release(torch.device(args.device))
    out = {}
    u = BF16_UNIT_ROUNDOFF
    edges = [e for e in (0, 1, 10, 50, 100, 200, 300, 500, 1000) if e < args.steps] + [args.steps]
    for name in ("reversed", "flatep"):
        pairs = list(zip(losses["baseline"], losses[name]))
        ratios = [abs(a - b) / loss_tolerance(t, a, b) for t, (a, b) in enumerate(pairs)]
        growth = [abs(a - b) / (u * max(a, b)) for a, b in pairs]
        out[name] = max(ratios)
        print(f"spread: baseline vs {name}: largest |difference| / (u * loss * sqrt(t + 1)) = {max(ratios):.3f} "
              f"(step {ratios.index(max(ratios))}), mean {sum(ratios) / len(ratios):.3f}", flush=True)
        cells = []
        for lo, hi in zip(edges, edges[1:]):
            part = growth[lo:hi]
            cells.append(f"steps {lo}-{hi - 1}: mean {sum(part) / len(part):.3f} max {max(part):.3f}")
        print("  |difference| / (u * loss): " + "; ".join(cells), flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    args.command = "benchmarks/training/train_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv)
    R = args.ranks
    need, text = memory_estimate(args, R)
    flops = flops_per_token(args)
    print(f"train_e2e: {flops / 1e9:.3f} GFLOP per token, {flops * R * args.batch * args.seq_len / 1e12:.2f} TFLOP "
          f"per step; memory estimate {need * R / GIB:.1f} GiB ({text})", flush=True)
    if args.estimate:
        return 0
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    check_fits(args, R)
    corpus = lm.Corpus(args.data, args.data_pattern)
    if corpus.num_bytes <= args.seq_len:
        sys.exit(f"train_e2e: error: the data has {corpus.num_bytes} bytes, fewer than --seq-len + 1")
    if args.spread:
        spread(args, corpus)
        return 0
    out = args.out or tempfile.mkdtemp(prefix="train_e2e_")
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    recs = run_processes(args) if args.processes else {impl: run_virtual(args, impl, corpus) for impl in IMPLS}
    compare = compare_losses(recs, args)
    header = f"# {args.command}\n# device: " + (torch.cuda.get_device_name() if args.device == "cuda" else "CPU") + \
        f"; {'processes' if args.processes else 'virtual ranks'}; {corpus.describe()}\n"
    write_csv(os.path.join(out, "steps.csv"), [r for rec in recs.values() for r in rec.steps], header)
    write_csv(os.path.join(out, "memory.csv"), [m for rec in recs.values() for m in rec.memory], header)
    write_csv(os.path.join(out, "loss.csv"), compare, header)
    for impl, rec in recs.items():
        rec.trace.save(os.path.join(out, f"trace_{impl}.npz"))
    if not args.no_plot:
        plot(recs, compare, os.path.join(out, "train_e2e.png"), args)
    text, ok = summary(recs, compare, args)
    print(f"wrote {out}/steps.csv, memory.csv, loss.csv, trace_flatep.npz, trace_baseline.npz"
          + ("" if args.no_plot else ", train_e2e.png") + f" ({time.perf_counter() - started:.0f} s)")
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
