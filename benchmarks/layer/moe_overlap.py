#!/usr/bin/env python3
"""nn.MoE's overlap on R virtual ranks of one GPU (issue 20, item 2): the overlapped layer forward against the serial
sum of its parts, measured in the same run, with a figure and a CSV.

    # H200, MoonEP's per-rank sizes (S=8192, epn=48, H=7168, K=8, F=2048) and a shared expert of F_s=2048 on 2
    # virtual ranks (~25 GB each); about a minute of device time:
    python3 benchmarks/layer/moe_overlap.py --device cuda --out benchmarks/results/moe_overlap_h200
    # CPU smoke run (its numbers are not results):
    /usr/bin/python3 benchmarks/layer/moe_overlap.py --device cpu --ranks 2 --tokens 64 --hidden 64 --ffn 32 \\
        --shared-ffn 48 --experts-per-rank 4 --topk 2 --iters 2 --warmup 1 --out /tmp/moe_overlap

Two modes, each forward only (torch.no_grad), every rank's layer with a shared expert:
* shared: MoE.forward on S tokens: the shared expert on the compute stream while plan + dispatch run on the Buffer's
  comm_stream;
* microbatch2: MoE.forward_microbatches on two micro-batches of S/2 tokens: also the dispatch of the second during
  the expert GEMMs of the first, and the combine of the first during the second's shared expert and GEMMs.

Per mode and iteration, all ranks at once (each on its own stream; a GATE_S spin on every stream first so that the
host enqueues every rank's work before any starts, as in benchmarks/layer/moe_layer_virtual.py; the communication
kernels on --num-sms blocks per launch, the GEMMs on the rest of the GPU):
* overlapped: the layer with overlap=True, from the gate's end to the end of the rank's compute stream;
* serial layer: the same with overlap=False (every op on the compute stream, one after the other);
* parts: each part on its own, the exact calls the layer makes (flatep.nn.route; Buffer.plan / dispatch / combine;
  flatep.nn.shared_expert_ffn; ExpertPools.prefetch + flatep.nn.grouped_ffn; flatep.nn.add_shared), per micro-batch.
A time is the slowest rank's; the CSV reports the median over --iters. serial_sum = the sum of the parts' medians;
ratio = overlapped / serial_sum (target: at most 0.8). Before timing, the overlapped outputs are checked bitwise
against the serial layer's on every rank.
"""

import argparse
import csv
import os
import statistics
import sys
import time

# Before CUDA starts: every rank's streams on their own hardware queues (a spinning kernel must not block a peer's),
# and every torch kernel loaded eagerly (a lazy load between two ranks' ops may wait for a peer's spinning kernel).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "common"))

import bench_timing  # noqa: E402
import flatep  # noqa: E402
from flatep import testing, virtual  # noqa: E402
from flatep.nn import add_shared, grouped_ffn, route, shared_expert_ffn  # noqa: E402

BF16 = torch.bfloat16
GATE_S = 0.04
PARTS = ("route", "plan", "dispatch", "shared", "experts", "combine", "add")
MODES = ("shared", "microbatch2")


class Timer:
    """Runs fn(r) for every rank at once and returns the slowest rank's time (ms)."""

    def __init__(self, R, device):
        self.R, self.device, self.cuda = R, device, device.type == "cuda"
        self.streams = [torch.cuda.Stream(device) for _ in range(R)] if self.cuda else [None] * R
        if self.cuda:
            self.gate_cycles = bench_timing.gate_cycles(device, GATE_S)

    def run(self, fn):
        if not self.cuda:  # CPU backend: ops block until every rank arrives, so the ranks run on threads
            return bench_timing.wall_ms(lambda: virtual.run_threads(self.R, fn))
        torch.cuda.synchronize(self.device)
        # one thread enqueues every rank's work, each on its own stream
        t = bench_timing.ranks_together(self.streams, fn, self.gate_cycles,
                                        sync=lambda: torch.cuda.synchronize(self.device))
        return t.max_ms, t.out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192, help="S per rank (microbatch2: two of S/2)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--shared-ffn", type=int, default=2048)
    ap.add_argument("--experts-per-rank", type=int, default=48)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--align", type=int, default=128)
    ap.add_argument("--sigma", type=float, default=0.0, help="routing imbalance (flatep.testing.sample_topk)")
    ap.add_argument("--num-sms", type=int, default=None,
                    help="blocks per launch of the communication kernels (default: SMs / (2 R) on a GPU)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/moe_overlap")
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    R, S, H, K = args.ranks, args.tokens, args.hidden, args.topk
    E = R * args.experts_per_rank
    num_sms = args.num_sms
    if num_sms is None and device.type == "cuda":
        num_sms = max(1, torch.cuda.get_device_properties(device).multi_processor_count // (2 * R))
    group = virtual.virtual_ranks(R, device) if device.type == "cuda" else virtual.virtual_ranks(R)
    t0 = time.perf_counter()
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(
        H, args.ffn, E, K, group=group[r], num_tokens=S, align=args.align, seed=1, device=device,
        shared_ffn=args.shared_ffn))
    if num_sms is not None:
        for m in moes:
            m.buffer.num_sms = m.pools.num_sms = num_sms
    print(f"built {R} ranks in {time.perf_counter() - t0:.1f} s: S={S} H={H} E={E} K={K} F={args.ffn} "
          f"F_s={args.shared_ffn} num_sms={num_sms} on {device}", flush=True)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(S, H, generator=g).to(device) for _ in range(R)]
    idx = [testing.sample_topk(E, S, K, r, sigma=args.sigma, seed=3).long().to(device) for r in range(R)]
    split = {"shared": [S], "microbatch2": [S // 2, S - S // 2]}
    timer = Timer(R, device)

    def pieces(r, mode):
        sizes, at, out = split[mode], 0, []
        for s in sizes:
            out.append((xs[r][at:at + s], idx[r][at:at + s]))
            at += s
        return out

    def layer(mode, overlap):
        def fn(r):
            m = moes[r]
            m.overlap = overlap
            ps = pieces(r, mode)
            if mode == "shared":
                return [m(ps[0][0], ps[0][1])]
            return m.forward_microbatches([p[0] for p in ps], [p[1] for p in ps])
        return fn

    def part_times(mode):
        """The parts of every micro-batch, each timed on its own (all ranks at once), summed per part."""
        total = dict.fromkeys(PARTS, 0.0)
        for j in range(len(split[mode])):
            st = [dict() for _ in range(R)]

            def step(name, fn):
                ms, _ = timer.run(lambda r: st[r].__setitem__(name, fn(r, moes[r], st[r])))
                total[name] += ms

            def _route(r, m, d):
                x, i = pieces(r, mode)[j]
                w, i = route(x, m.router.weight, m.topk, i)
                return x.to(BF16), w, i
            step("route", _route)
            step("plan", lambda r, m, d: m.buffer.plan(d["route"][2]))
            step("dispatch", lambda r, m, d: m.buffer.dispatch(d["plan"], d["route"][0], d["route"][1]))
            step("shared", lambda r, m, d: shared_expert_ffn(d["route"][0], m.shared_w1, m.shared_w2, m.activation))

            def _experts(r, m, d):
                layer_ = m.expert_layer
                m.pools.prefetch(d["plan"], layer_)
                return grouped_ffn(d["dispatch"][0], layer_.weights(0), layer_.weights(1), d["plan"].cu_seqlens,
                                   m.activation)
            step("experts", _experts)
            step("combine", lambda r, m, d: m.buffer.combine(d["plan"], d["experts"], d["dispatch"][1]))
            step("add", lambda r, m, d: add_shared(d["combine"], d["shared"]))
        return total

    rows = []
    with torch.no_grad():
        for mode in MODES:
            _, serial_out = timer.run(layer(mode, False))
            _, over_out = timer.run(layer(mode, True))
            for r in range(R):
                for a, b in zip(over_out[r], serial_out[r]):
                    if not torch.equal(a, b):
                        raise SystemExit(f"{mode}: rank {r}: the overlapped output differs from the serial one")
            del serial_out, over_out
            samples = {k: [] for k in PARTS + ("serial_layer", "overlapped")}
            for it in range(args.warmup + args.iters):
                parts = part_times(mode)
                serial_ms, _ = timer.run(layer(mode, False))
                over_ms, _ = timer.run(layer(mode, True))
                if it >= args.warmup:
                    for k in PARTS:
                        samples[k].append(parts[k])
                    samples["serial_layer"].append(serial_ms)
                    samples["overlapped"].append(over_ms)
            med = {k: statistics.median(v) for k, v in samples.items()}
            serial_sum = sum(med[k] for k in PARTS)
            row = {"mode": mode, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "ranks": R, "tokens": S, "hidden": H, "experts": E, "topk": K, "ffn": args.ffn,
                   "shared_ffn": args.shared_ffn, "num_sms": num_sms, "sigma": args.sigma, "iters": args.iters}
            row.update({f"{k}_ms": round(med[k], 4) for k in PARTS})
            row.update({"serial_sum_ms": round(serial_sum, 4), "serial_layer_ms": round(med["serial_layer"], 4),
                        "overlapped_ms": round(med["overlapped"], 4),
                        "ratio": round(med["overlapped"] / serial_sum, 4),
                        "ratio_vs_serial_layer": round(med["overlapped"] / med["serial_layer"], 4)})
            rows.append(row)
            print(f"{mode}: parts " + ", ".join(f"{k} {med[k]:.3f}" for k in PARTS)
                  + f" | serial sum {serial_sum:.3f} ms, serial layer {med['serial_layer']:.3f} ms, overlapped "
                  f"{med['overlapped']:.3f} ms: ratio {row['ratio']:.3f}", flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, args.out + ".png")
    print(f"wrote {args.out}.csv and {args.out}.png")
    testing.release_all()


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.get_cmap("tab10").colors
    for i, row in enumerate(rows):
        base = 3.5 * i
        bottom = 0.0
        for j, part in enumerate(PARTS):
            v = row[f"{part}_ms"]
            ax.bar(base, v, bottom=bottom, color=colors[j], label=part if i == 0 else None, width=0.9)
            bottom += v
        ax.bar(base + 1, row["serial_layer_ms"], color="0.6", width=0.9, label="serial layer" if i == 0 else None)
        ax.bar(base + 2, row["overlapped_ms"], color="black", width=0.9, label="overlapped" if i == 0 else None)
        ax.hlines(0.8 * row["serial_sum_ms"], base + 1.5, base + 2.5, colors="red", linestyles="--",
                  label="0.8 x serial sum" if i == 0 else None)
        ax.text(base + 2, row["overlapped_ms"], f"{row['ratio']:.2f}x", ha="center", va="bottom")
    ax.set_xticks([3.5 * i + 1 for i in range(len(rows))])
    ax.set_xticklabels([f"{r['mode']}\n(sum of parts | serial | overlapped)" for r in rows])
    ax.set_ylabel("forward time, slowest rank (ms)")
    r0 = rows[0]
    ax.set_title(f"nn.MoE overlap, {r0['ranks']} virtual ranks on {r0['device']}: S={r0['tokens']} H={r0['hidden']} "
                 f"E={r0['experts']} K={r0['topk']} F={r0['ffn']} F_s={r0['shared_ffn']}", fontsize=9)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
