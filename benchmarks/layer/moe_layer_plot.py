#!/usr/bin/env python3
"""Figures of a benchmarks/layer/moe_layer.py CSV.

    python3 benchmarks/layer/moe_layer_plot.py benchmarks/results/moe_layer_<...>.csv

Writes <prefix>.png (2x2: dispatch fwd/bwd, combine fwd/bwd, expert GEMM fwd/bwd, stacked comm / planning /
prefetch per maxvio and implementation) and <prefix>_layer.png (end-to-end layer time against maxvio), with the
command and device of the CSV header as the title. Times are the slowest rank per phase (median over iterations).
"""

import csv
import os
import sys

COLORS = {"baseline": "tab:red", "flatep": "tab:blue"}
STACK = [
    ("comm", ["dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd"], None),
    ("planning", ["plan"], "//"),
    ("prefetch + reduce_grad", ["prefetch", "prefetch_bwd", "reduce_grad"], ".."),
    ("fp32 weight grads", ["wgrad_fp32"], "xx"),
]


def read(csv_path):
    header, rows = [], []
    with open(csv_path) as f:
        lines = f.readlines()
    header = [l[1:].strip() for l in lines if l.startswith("#")]
    rows = list(csv.DictReader(l for l in lines if not l.startswith("#")))
    return header, rows


def plot(csv_path, prefix=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix = prefix or os.path.splitext(csv_path)[0]
    header, rows = read(csv_path)
    title = "\n".join(header[:2])
    t = {}
    for r in rows:
        t[(float(r["maxvio_target"]), r["impl"], r["phase"])] = float(r["median_ms"])
    targets = sorted({k[0] for k in t})
    realised = {float(r["maxvio_target"]): float(r["maxvio"]) for r in rows}
    impls = [i for i in COLORS if any(k[1] == i for k in t)]
    xs = range(len(targets))
    labels = [f"{m:g}\n({realised[m]:.2f})" for m in targets]

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    panels = [
        (axes[0][0], "dispatch", ["dispatch_fwd", "dispatch_bwd"]),
        (axes[0][1], "combine", ["combine_fwd", "combine_bwd"]),
        (axes[1][0], "expert GEMM", ["gemm_fwd", "gemm_bwd"]),
    ]
    for ax, name, phases in panels:
        for impl in impls:
            for phase, style in zip(phases, ["-o", "--s"]):
                ys = [t.get((m, impl, phase), float("nan")) for m in targets]
                ax.plot(xs, ys, style, color=COLORS[impl], label=f"{impl} {phase.split('_')[1]}")
        ax.set_title(f"{name} (slowest rank)")
        ax.set_ylabel("ms")
        ax.set_xticks(list(xs), labels)
        ax.set_xlabel("maxvio target (realised)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    ax = axes[1][1]
    width = 0.38
    for j, impl in enumerate(impls):
        bottom = [0.0] * len(targets)
        for name, phases, hatch in STACK:
            h = [sum(t.get((m, impl, p), 0.0) for p in phases) for m in targets]
            pos = [x + (j - 0.5) * width for x in xs]
            ax.bar(pos, h, width, bottom=bottom, color=COLORS[impl], hatch=hatch, edgecolor="black",
                   alpha=0.5 if hatch else 0.85, label=f"{impl}: {name}")
            bottom = [b + v for b, v in zip(bottom, h)]
    ax.set_ylim(0, 1.45 * max([1e-9] + [p.get_y() + p.get_height() for p in ax.patches]))  # room for the legend
    ax.set_title("comm / planning / prefetch / fp32 wgrad (stacked)")
    ax.set_ylabel("ms")
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("maxvio target (realised)")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    out1 = prefix + ".png"
    fig.savefig(out1, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in impls:
        ax.plot(xs, [t.get((m, impl, "layer"), float("nan")) for m in targets], "-o", color=COLORS[impl],
                label=f"{impl}: layer fwd+bwd")
        ax.plot(xs, [t.get((m, impl, "sum_phases"), float("nan")) for m in targets], ":", color=COLORS[impl],
                label=f"{impl}: sum of per-phase slowest ranks")
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("maxvio target (realised)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title("MoE layer forward + backward (slowest rank)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    out2 = prefix + "_layer.png"
    fig.savefig(out2, dpi=110)
    plt.close(fig)
    return [out1, out2]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for path in plot(sys.argv[1]):
        print(f"wrote {path}")
