#!/usr/bin/env python3
"""The serving FFN's cost against its receive capacity (issue 47): flatep.ffn.grouped_ffn under torch.no_grad() on
the same real rows (the rows of `--groups` own experts, `--rows` in all, at the front of the buffer) in receive
buffers of several capacities NvS, over an [E+B] view of `--view` groups. The owner planner's buffer holds R*S*K rows
plus padding (8672 at DeepEP's decode shape) where the balanced one holds about S*K (1984): what the extra capacity
costs the FFN, phase by phase (first grouped GEMM, activation, second grouped GEMM, zeroing past the end), on one GPU.

    python3 benchmarks/serving/owner_ffn_probe.py                # DeepEP's decode shape, F=1536, NvS 1061/1984/8672
    python3 benchmarks/serving/owner_ffn_probe.py --capacity 1061 1984 8672 --ffn 1536 --reps 50
"""

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from flatep import ffn  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "common"))
import bench_timing  # noqa: E402

BF16 = torch.bfloat16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--view", type=int, default=260, help="groups of the weights view (E + B)")
    p.add_argument("--groups", type=int, default=32, help="groups holding rows (the rank's own experts)")
    p.add_argument("--first-group", type=int, default=0, help="view row of the first group with rows")
    p.add_argument("--rows", type=int, default=1061, help="real rows (the busiest owner rank's at s = 128)")
    p.add_argument("--capacity", type=int, nargs="+", default=[1061, 1984, 8672], help="receive rows NvS")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    return p.parse_args(argv)


def timed(fn, reps, warmup):
    """Median of `reps` CUDA-event timings of fn() in microseconds, after `warmup` calls."""
    return statistics.median(bench_timing.time_calls(fn, reps, warmup)) * 1e3


def main(argv=None):
    a = parse_args(argv)
    if not (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")):
        print("SKIP: needs a CUDA device and torch._grouped_mm")
        return 0
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    w1 = (torch.randn(a.view, a.hidden, 2 * a.ffn, device=dev, generator=gen) * 0.02).to(BF16)
    w2 = (torch.randn(a.view, a.ffn, a.hidden, device=dev, generator=gen) * 0.02).to(BF16)
    # rows spread evenly over the groups [first, first + groups); every other group empty
    sizes = torch.zeros(a.view, dtype=torch.int64)
    per, extra = divmod(a.rows, a.groups)
    for g in range(a.groups):
        sizes[a.first_group + g] = per + (1 if g < extra else 0)
    cu = torch.cumsum(sizes, 0).to(torch.int32).to(dev)
    print(f"H={a.hidden} F={a.ffn} view={a.view} groups with rows={a.groups} real rows={a.rows}")
    print(f"{'NvS':>6} {'gemm1_us':>10} {'activate_us':>12} {'gemm2_us':>10} {'zero_us':>9} {'grouped_ffn_us':>15}")
    base = None
    for m in a.capacity:
        if m < a.rows:
            raise SystemExit(f"--capacity {m}: below --rows {a.rows}")
        x = (torch.randn(m, a.hidden, device=dev, generator=gen)).to(BF16)
        with torch.no_grad():
            h = ffn.grouped_mm(x, w1, cu)
            act = ffn.activate_rows(h, cu, "swiglu")
            y = ffn.grouped_mm(act, w2, cu)
            t1 = timed(lambda: ffn.grouped_mm(x, w1, cu), a.reps, a.warmup)
            ta = timed(lambda: ffn.activate_rows(h, cu, "swiglu", out=act), a.reps, a.warmup)
            t2 = timed(lambda: ffn.grouped_mm(act, w2, cu), a.reps, a.warmup)
            tz = timed(lambda: ffn.zero_rows_from_end(y, cu), a.reps, a.warmup)
            tf = timed(lambda: ffn.grouped_ffn(x, w1, w2, cu, "swiglu"), a.reps, a.warmup)
        base = tf if base is None else base
        print(f"{m:>6} {t1:>10.1f} {ta:>12.1f} {t2:>10.1f} {tz:>9.1f} {tf:>15.1f}   ({tf / base:.3f}x the first)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
