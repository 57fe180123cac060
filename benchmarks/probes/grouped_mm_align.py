#!/usr/bin/env python3
"""The expert GEMMs of the MoE layer against FlatEP's group padding (align) and group count: torch._grouped_mm in
bf16 with nn.py's operand layouts, on the rows per group FlatEP's planner gives (issue 48), and the same rows over a
mostly-empty [E+B] view of groups against the compact [2*epn] one (issue 43's serving layout).

    python3 benchmarks/probes/grouped_mm_align.py                 # MoonEP's shape, F 512 and 2048, maxvio 0.2 / 20
    /usr/bin/python3 benchmarks/probes/grouped_mm_align.py --device cpu --tokens 64 --hidden 64 --ffn 32 --experts 16 \\
        --ranks 4 --topk 2 --reps 2 --warmup 1 --out /tmp/gmm     # CPU smoke run (a loop of mm per group)

Rows per group: the routing generator's routing at each maxvio (flatep.testing, the layer benchmark's seed), planned
by FlatEP's host planner on R virtual CPU ranks (a Buffer with H=8: the plan does not depend on H) once per align;
the rank measured is the one with the most padded rows (FlatEP) and the hottest rank (the baseline). Layouts:

  flatep_2epn   the plan's 2*epn groups (own experts, then replica slots), each non-empty group padded to `align`,
                over a receive buffer of NvS = round_up(S*K + 2*epn*(align-1), align) rows (what nn.MoE runs)
  flatep_epn    the same rows in epn groups (slot j's rows with own group j, padded once): the cost of the group count
  baseline      the all-to-all baseline's hottest rank: its rows per local expert, epn groups, no padding
  serving_EB    (forward only) flatep_2epn's groups placed in an [E+B] view: own experts at rows rank*epn..,
                the B slots with most rows at [E, E+B), the other slots' rows in their expert's home row; the weight
                view is local memory here (no NVLink): this measures the empty groups alone; compare with
                flatep_2epn's forward at the same align (target within 1.05x)

Ops (nn.py's calls): gemm1_fwd x @ W1, gemm2_fwd a @ W2, gemm2_wgrad a^T @ dy, gemm2_dgrad dy @ W2^T, gemm1_wgrad
x^T @ dh, gemm1_dgrad dh @ W1^T (silu: W1 [H, F], W2 [F, H], as benchmarks/layer/moe_layer*.py), and the layer's whole
expert FFN as the benchmarks' gemm_fwd / gemm_bwd phases run it (flatep.nn.grouped_ffn: GEMMs, activation, rows past
the end zeroed; its autograd backward): ffn_fwd, ffn_bwd. Each: median of --reps CUDA-event timings after --warmup.

Before timing, a correctness probe runs the four GEMM forms at align 1, 8, 16, 32, 64, 128 (groups of those
multiples, empty groups included) against a loop of fp32 matmuls, and asks whether torch._grouped_mm takes
out_dtype=float32 for bf16 operands (which would let the weight-gradient GEMM write fp32 itself).

What torch._grouped_mm requires (PyTorch source, cited in the output): operands bf16 (or fp16/fp32) 2-D/3-D, 16-byte
aligned base pointers, strides a multiple of 16 bytes (H and F multiples of 8 in bf16), offs a 1-D int32 tensor of
inclusive group ends, fewer than 1024 groups, out_dtype equal to mat_a's dtype; group sizes must be multiples of 16
bytes along a dynamic dimension only where that dimension is contiguous in memory (and > 0 for 2-D x 2-D unless A is
column-major and B row-major): with nn.py's layouts (x row-major for the 2-D x 3-D forms, x^T / a^T column-major with
dh / dy row-major for the weight gradients) no group size constraint applies.
"""

import argparse
import csv
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import flatep  # noqa: E402
from flatep import testing, virtual  # noqa: E402
from flatep.nn import grouped_ffn  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "common"))
import bench_timing  # noqa: E402

BF16 = torch.bfloat16
GEMMS = ["gemm1_fwd", "gemm2_fwd", "gemm2_wgrad", "gemm2_dgrad", "gemm1_wgrad", "gemm1_dgrad"]
FWD_OPS = ["gemm1_fwd", "gemm2_fwd"]
FFN_OPS = ["ffn_fwd", "ffn_bwd"]
PROBE_ALIGNS = [1, 8, 16, 32, 64, 128]
SOURCES = [
    "aten/src/ATen/native/GroupedMMUtils.h (pytorch/pytorch 2295ac79): check_valid_strides_and_return_transposed "
    "(data_ptr and strides 16-byte aligned), _grouped_mm_validate_inputs (offs 1-D int32), "
    "_resolve_grouped_mm_out_dtype (out_dtype must equal mat_a's dtype; fp32 output for bf16 inputs is a TODO)",
    "aten/src/ATen/native/cuda/GroupMMCommon.cuh (pytorch/pytorch 187e65ad): prepare_grouped_gemm_data asserts group "
    "sizes > 0 for 2-D x 2-D unless A column-major and B row-major, and multiples of 16 bytes only along a contiguous "
    "dynamic dimension",
    "aten/src/ATen/native/cuda/GroupMM.cu (pytorch/pytorch 06c0cf01): fewer than 1024 groups; tile 128x256x64 "
    "(cooperative) unless rows per group or N <= 128 (64x128x128 ping-pong), chosen from the average group size",
    "pytorch/ao#2678: torchtitan's token group alignment went from 16 to 8, 'the minimum for bf16' in its layout",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="S tokens per rank")
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ffn", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--maxvio", type=float, nargs="+", default=[0.2, 20.0])
    p.add_argument("--aligns", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--slots", type=int, default=4, help="B, the serving view's local slots")
    p.add_argument("--seed", type=int, default=1, help="routing seed (the layer benchmark's default)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--out", default=os.path.join(HERE, "..", "results"))
    p.add_argument("--tag", default=None, help="file name suffix (default: from the device)")
    args = p.parse_args(argv)
    if args.experts % args.ranks:
        p.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    if not 0 <= args.slots <= args.experts // args.ranks:
        p.error(f"--slots {args.slots} must be in [0, epn={args.experts // args.ranks}]")
    args.command = " ".join(["benchmarks/probes/grouped_mm_align.py"] + (sys.argv[1:] if argv is None else list(argv)))
    return args


# ---- the grouped GEMM (torch._grouped_mm, or a loop of mm where it is missing) ----


def has_grouped_mm(t):
    return t.is_cuda and hasattr(torch, "_grouped_mm")


def grouped_mm(a, b, offs):
    """torch._grouped_mm(a, b, offs=offs) on a GPU that has it; elsewhere the same result from a loop of fp32 mm per
    group (2-D x 3-D: a's rows split by offs; 2-D x 2-D: the contraction split by offs -> [G, M, N])."""
    if has_grouped_mm(a):
        return torch._grouped_mm(a, b, offs=offs)
    ends = [int(e) for e in offs.tolist()]
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                out[s:e] = (a[s:e].float() @ b[g].float()).to(a.dtype)
        return out
    out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            out[g] = (a[:, s:e].float() @ b[s:e].float()).to(a.dtype)
    return out


def gemm_ops(x, w1, w2, a, dy, dh, offs):
    """{op: thunk}: the six GEMMs of the expert FFN with nn.py's operand layouts."""
    return {
        "gemm1_fwd": lambda: grouped_mm(x, w1, offs),
        "gemm2_fwd": lambda: grouped_mm(a, w2, offs),
        "gemm2_wgrad": lambda: grouped_mm(a.transpose(-2, -1), dy, offs),
        "gemm2_dgrad": lambda: grouped_mm(dy, w2.transpose(-2, -1), offs),
        "gemm1_wgrad": lambda: grouped_mm(x.transpose(-2, -1), dh, offs),
        "gemm1_dgrad": lambda: grouped_mm(dh, w1.transpose(-2, -1), offs),
    }


def probe(device):
    """[(align, result)] of the correctness probe, then a line: whether out_dtype=float32 is accepted."""
    g = torch.Generator(device="cpu").manual_seed(3)
    H, F, G = 64, 48, 6
    out = []
    for align in PROBE_ALIGNS:
        sizes = [align * m for m in (3, 0, 1, 5, 0, 2)]  # empty groups included (unused slots)
        offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
        n = int(sum(sizes))
        x, dy = (torch.randn(n, H, generator=g).to(BF16).to(device) for _ in range(2))
        a, dh = (torch.randn(n, F, generator=g).to(BF16).to(device) for _ in range(2))
        w1, w2 = torch.randn(G, H, F, generator=g).to(BF16).to(device), torch.randn(G, F, H, generator=g).to(BF16)
        w2 = w2.to(device)
        f32 = lambda t: t.float()  # noqa: E731
        try:
            got = {k: f() for k, f in gemm_ops(x, w1, w2, a, dy, dh, offs).items()}
            worst = 0.0
            starts = [0] + offs.tolist()[:-1]
            for gi, (s, e) in enumerate(zip(starts, offs.tolist())):
                if e == s:  # an empty group's weight gradient is not written: write_grads' contract zeroes it
                    continue
                ref = {"gemm1_fwd": f32(x[s:e]) @ f32(w1[gi]), "gemm2_fwd": f32(a[s:e]) @ f32(w2[gi]),
                       "gemm2_wgrad": f32(a[s:e]).t() @ f32(dy[s:e]), "gemm2_dgrad": f32(dy[s:e]) @ f32(w2[gi]).t(),
                       "gemm1_wgrad": f32(x[s:e]).t() @ f32(dh[s:e]), "gemm1_dgrad": f32(dh[s:e]) @ f32(w1[gi]).t()}
                for k, r in ref.items():
                    v = got[k][gi] if k.endswith("wgrad") else got[k][s:e]
                    worst = max(worst, float((f32(v).cpu() - r.cpu()).norm() / r.norm().clamp_min(1e-30)))
            out.append((align, "ok" if worst < 1e-2 else f"WRONG (rel err {worst:.2e})"))
        except Exception as e:  # noqa: BLE001 - the probe reports what torch raises
            out.append((align, f"error: {str(e).splitlines()[0][:120]}"))
    fp32 = "no torch._grouped_mm here"
    if device.type == "cuda" and hasattr(torch, "_grouped_mm"):
        x = torch.randn(64, 32, device=device).to(BF16)
        d = torch.randn(64, 16, device=device).to(BF16)
        offs = torch.tensor([32, 64], dtype=torch.int32, device=device)
        try:
            r = torch._grouped_mm(x.t(), d, offs=offs, out_dtype=torch.float32)
            fp32 = f"accepted (out dtype {r.dtype})"
        except Exception as e:  # noqa: BLE001
            fp32 = f"refused: {str(e).splitlines()[0][:120]}"
    return out, fp32


# ---- rows per group ----


def round_up(n, a):
    return (n + a - 1) // a * a


def plans_of(args, ranks, idx, align):
    """Per rank (cu_seqlens [2*epn] list, slot_expert [epn] list) of FlatEP's host planner at this align (virtual
    CPU ranks `ranks`, routing idx[r]), and the Buffer's receive rows NvS."""
    R = args.ranks
    bufs = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], args.tokens, 8, args.experts, args.topk, align))
    plans = virtual.run_threads(R, lambda r: bufs[r].plan(idx[r]))
    return [(p.cu_seqlens.tolist(), p.slot_expert.tolist()) for p in plans], bufs[0].num_recv_rows


def lengths(cu):
    return [e - s for s, e in zip([0] + cu[:-1], cu)]


def layouts(args, ranks, sigma):
    """{(layout, align): (group lengths, buffer rows, per-layout note)} at this routing."""
    R, E, epn = args.ranks, args.experts, args.experts // args.ranks
    idx = [testing.sample_topk(E, args.tokens, args.topk, r, sigma=sigma, seed=args.seed).long() for r in range(R)]
    real, _ = plans_of(args, ranks, idx, 1)  # align 1: the real rows of every group
    out = {}
    for align in args.aligns:
        plans, nvs = plans_of(args, ranks, idx, align)
        r = max(range(R), key=lambda q: plans[q][0][-1])  # the rank with the most padded rows
        pad = lengths(plans[r][0])
        real_r = lengths(real[r][0])
        if pad != [round_up(n, align) if n else 0 for n in real_r]:
            print(f"note: align {align}: the plan's groups are not align 1's padded (the planner depends on align); "
                  "flatep_epn uses align 1's rows", flush=True)
        merged = [round_up(real_r[j] + real_r[epn + j], align) for j in range(epn)]
        out[("flatep_2epn", align)] = (pad, nvs, f"rank {r}")
        out[("flatep_epn", align)] = (merged, nvs, f"rank {r}")
        slot_expert = plans[r][1]
        view = [0] * (E + args.slots)
        view[r * epn:(r + 1) * epn] = pad[:epn]
        by_rows = sorted(range(epn), key=lambda j: (-pad[epn + j], j))
        for rank_of_slot, j in enumerate(by_rows):
            if pad[epn + j] == 0:
                continue
            if rank_of_slot < args.slots:
                view[E + rank_of_slot] = pad[epn + j]
            else:
                view[slot_expert[j]] += pad[epn + j]
        out[("serving_EB", align)] = (view, nvs, f"rank {r}, B={args.slots}")
    counts = testing.generate_counts(R, E, args.tokens, args.topk, sigma=sigma, seed=args.seed)
    per_rank = counts.sum(0).view(R, epn)
    hot = int(per_rank.sum(1).argmax())
    base = [int(v) for v in per_rank[hot].tolist()]
    out[("baseline", 1)] = (base, sum(base), f"rank {hot} (hottest)")
    return out


# ---- timing ----


def time_op(fn, device, reps, warmup):
    """Median ms of fn() over `reps` runs after `warmup` (CUDA events on a GPU, the host clock elsewhere)."""
    if device.type == "cuda":
        return statistics.median(bench_timing.time_calls(fn, reps, warmup))
    for _ in range(warmup):
        fn()
    return statistics.median(bench_timing.wall_ms(fn)[0] for _ in range(reps))


class Tensors:
    """One F's operands, allocated once at the largest size needed and sliced per layout."""

    def __init__(self, args, F, max_rows, max_groups, device):
        H = args.hidden
        g = torch.Generator(device=device).manual_seed(7)
        rnd = lambda *s: torch.randn(*s, device=device, generator=g, dtype=BF16).mul_(0.05)  # noqa: E731
        self.x, self.dy = rnd(max_rows, H), rnd(max_rows, H)
        self.a, self.dh = rnd(max_rows, F), rnd(max_rows, F)
        self.w1, self.w2 = rnd(max_groups, H, F), rnd(max_groups, F, H)


def measure(args, t, groups, rows, ops, device):
    """{op: median ms} of `ops` over these group lengths and buffer rows (offs on the device)."""
    G = len(groups)
    offs = torch.tensor(groups, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    x, dy, a, dh = t.x[:rows], t.dy[:rows], t.a[:rows], t.dh[:rows]
    w1, w2 = t.w1[:G], t.w2[:G]
    fns = gemm_ops(x, w1, w2, a, dy, dh, offs)

    def ffn_fwd():
        with torch.no_grad():
            return grouped_ffn(x, w1, w2, offs, "silu")

    leaf = x.detach().requires_grad_()
    w1l, w2l = w1.detach().requires_grad_(), w2.detach().requires_grad_()

    def ffn_bwd():  # the benchmarks' gemm_bwd: the forward's graph kept, its backward timed
        return torch.autograd.grad(y_graph[0], [w1l, w2l, leaf], dy)

    def ffn_graph():
        with torch.enable_grad():
            y_graph[0] = grouped_ffn(leaf, w1l, w2l, offs, "silu")

    y_graph = [None]
    fns["ffn_fwd"] = ffn_fwd
    out = {}
    for op in ops:
        if op == "ffn_bwd":
            samples = []
            for i in range(args.warmup + args.reps):
                ffn_graph()
                ms = time_op(ffn_bwd, device, 1, 0)
                if i >= args.warmup:
                    samples.append(ms)
            out[op] = statistics.median(samples)
            y_graph[0] = None
        else:
            out[op] = time_op(fns[op], device, args.reps, args.warmup)
    return out


def run(args):
    device = torch.device(args.device)
    epn = args.experts // args.ranks
    probes, fp32 = probe(device)
    records = []
    per_maxvio = {}
    ranks = virtual.virtual_ranks(args.ranks, "cpu", timeout_s=120)  # the host planner's world
    for target in args.maxvio:
        goal = min(target, 0.9 * (args.experts / args.topk - 1))
        sigma = 0.0 if target == 0 else testing.sigma_for_maxvio(goal, args.ranks, args.experts, args.tokens,
                                                                  args.topk, seed=args.seed)
        realised = testing.maxvio(testing.generate_counts(args.ranks, args.experts, args.tokens, args.topk,
                                                          sigma=sigma, seed=args.seed))
        per_maxvio[target] = (realised, layouts(args, ranks, sigma))
    for F in args.ffn:
        max_rows = max(max(rows, sum(g)) for _, lay in per_maxvio.values() for g, rows, _ in lay.values())
        max_groups = max(args.experts + args.slots, 2 * epn)
        t = Tensors(args, F, max_rows, max_groups, device)
        for target, (realised, lay) in per_maxvio.items():
            for (layout, align), (groups, rows, note) in sorted(lay.items()):
                ops = FWD_OPS if layout == "serving_EB" else GEMMS + FFN_OPS
                if layout == "flatep_epn":
                    ops = GEMMS
                times = measure(args, t, groups, rows, ops, device)
                for op, ms in times.items():
                    flops = 2.0 * sum(groups) * args.hidden * F if op.startswith("gemm") else float("nan")
                    records.append(dict(ffn=F, maxvio_target=target, maxvio=round(realised, 4), layout=layout,
                                        align=align, groups=len(groups), groups_nonempty=sum(1 for n in groups if n),
                                        rows=sum(groups), buffer_rows=rows, op=op, median_ms=round(ms, 4),
                                        tflops=round(flops / ms / 1e9, 1) if ms > 0 and flops == flops else "",
                                        rank=note))
        del t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records, probes, fp32


def summarise(args, records, probes, fp32):
    """The short tables; returns the align chosen (fastest flatep_2epn gemm+ffn total summed over F and maxvio)."""
    print("torch._grouped_mm correctness probe (the six GEMM forms against fp32 loops, empty groups included):")
    print("  " + ", ".join(f"align {a}: {r}" for a, r in probes))
    print(f"  out_dtype=float32 for bf16 operands: {fp32}")
    print("what it requires (sources):")
    for s in SOURCES:
        print(f"  - {s}")
    by = {}
    for r in records:
        by.setdefault((r["ffn"], r["maxvio_target"], r["layout"], r["align"]), {})[r["op"]] = r["median_ms"]
    totals = {}
    for F in args.ffn:
        for target in args.maxvio:
            base = by.get((F, target, "baseline", 1), {})
            bsum = lambda ops: sum(base.get(o, 0.0) for o in ops)  # noqa: E731
            print(f"\nF={F} maxvio {target:g}: ms (GEMMs fwd / bwd, whole expert FFN fwd / bwd as the layer runs it)")
            print(f"{'layout':>12} {'align':>5} {'groups':>6} {'rows':>7} {'gemm fwd':>9} {'gemm bwd':>9} "
                  f"{'ffn fwd':>8} {'ffn bwd':>8} {'ffn vs base':>11}")
            rows_of = {(r["layout"], r["align"]): (r["groups_nonempty"], r["rows"]) for r in records
                       if r["ffn"] == F and r["maxvio_target"] == target}
            for (f, t, layout, align), ops in sorted(by.items()):
                if f != F or t != target or layout == "serving_EB":
                    continue
                fwd = sum(ops.get(o, 0.0) for o in FWD_OPS)
                bwd = sum(ops.get(o, 0.0) for o in GEMMS if o not in FWD_OPS)
                ffn = [ops.get(o) for o in FFN_OPS]
                ratio = ""
                if None not in ffn and bsum(FFN_OPS) > 0:
                    ratio = f"{sum(ffn) / bsum(FFN_OPS):.3f}"
                if layout == "flatep_2epn" and None not in ffn:
                    totals[align] = totals.get(align, 0.0) + sum(ffn)
                cells = " ".join(f"{v:8.3f}" if v is not None else f"{'-':>8}" for v in ffn)
                ne, rows = rows_of[(layout, align)]
                print(f"{layout:>12} {align:>5} {ne:>6} {rows:>7} {fwd:9.3f} {bwd:9.3f} {cells} {ratio:>11}")
            for align in args.aligns:
                eb, cp = by.get((F, target, "serving_EB", align)), by.get((F, target, "flatep_2epn", align))
                if eb and cp:
                    r = sum(eb[o] for o in FWD_OPS) / sum(cp[o] for o in FWD_OPS)
                    print(f"  serving [E+B={args.experts}+{args.slots}] / compact [2*epn] forward GEMMs, "
                          f"align {align}: {r:.3f} ({'within' if r <= 1.05 else 'ABOVE'} the 1.05 target)")
    chosen = min(totals, key=totals.get) if totals else None
    if chosen is not None:
        spread = max(totals.values()) / min(totals.values()) - 1
        print("\nflatep_2epn expert FFN fwd+bwd summed over F and maxvio, per align: "
              + ", ".join(f"{a}: {v:.3f} ms" for a, v in sorted(totals.items()))
              + f"\nchosen align {chosen} (spread {spread * 100:.1f}%): set DEFAULT_ALIGN = {chosen} in "
              "python/flatep/nn.py")
    return chosen


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("grouped_mm_align: --device cuda needs a GPU; use --device cpu")
    records, probes, fp32 = run(args)
    tag = args.tag or (torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")
    tag = "".join(c if c.isalnum() else "-" for c in tag.lower()).strip("-")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"grouped_mm_align_R{args.ranks}_S{args.tokens}_E{args.experts}_H{args.hidden}_"
                                  f"K{args.topk}_{tag}.csv")
    fields = ["ffn", "maxvio_target", "maxvio", "layout", "align", "groups", "groups_nonempty", "rows", "buffer_rows",
              "op", "median_ms", "tflops", "rank"]
    with open(path, "w", newline="") as f:
        f.write(f"# command: {args.command}\n# device: {tag}; torch {torch.__version__}; median of {args.reps} "
                f"after {args.warmup} warm-up; probe: {'; '.join(f'align {a} {r}' for a, r in probes)}; "
                f"out_dtype fp32: {fp32}\n")
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in records:
            w.writerow(r)
    print(f"wrote {path}")
    summarise(args, records, probes, fp32)
    return 0


if __name__ == "__main__":
    sys.exit(main())
