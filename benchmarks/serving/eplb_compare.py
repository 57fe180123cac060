#!/usr/bin/env python3
"""FlatEP against periodic expert placement ("EPLB", what serving engines run) on one routing trace, same slot memory.

    # a drifting trace (flatep.testing.drifting_popularity), DeepEP's serving shape, 1000 steps, rows and bytes only:
    python3 benchmarks/serving/eplb_compare.py --trace drift --preset deepep --steps 1000 --out /tmp/eplb
    # the routing a training run recorded (benchmarks/training/train_e2e.py's trace), its deepest MoE layer:
    python3 benchmarks/serving/eplb_compare.py --trace benchmarks/results/train_e2e_h100/trace_flatep.npz --layer 3
    # the serving step's time too (a GPU; every policy's nn.MoE step graph-replayed on every step of the trace):
    python3 benchmarks/serving/eplb_compare.py --trace drift --preset deepep --steps 200 --time --device cuda

Policies, every one with B replica slots a rank (the same slot memory), on the same routing:

* ``flatep_b<B>``: FlatEP's balanced planner every step (nn.MoE(num_slots=B), serving pools: up to B replicas pulled
  into the slots each step, any further replica read in place from its owner): every rank computes exactly S*K rows.
* ``flatep_bepn``: the same with B = epn (the training layout's slots: every replica pushed each step).
* ``static_<N>``: a placement from flatep.eplb.place (replicate by load, pack onto the B slots) made every N steps
  from the counts of the N steps before (the first from step 0's own counts), its weights moved once (the bytes are
  counted in the step that moves them); between placements each expert's entries are split evenly over its copies
  (Buffer(planner="static"), design §4: at least as even as an engine's per-token rule). Rows per rank vary.
* ``owner``: no balancing (every row to its expert's home rank).

Reported per step and policy (CSV): the busiest rank's rows over S*K (what sets the pace of R GPUs), the expert-weight
bytes moved, and with --time the serving step's time (the whole nn.MoE inference forward with the expert GEMM, one
CUDA graph per rank on 8 virtual ranks, from a common start to the last rank's end; a re-placement step adds the
timed set_placement and weight move). Summary: mean and p99 over the trace, and FlatEP's against the best static
interval's. The rows and bytes need no GPU: they follow from the counts (the balanced planner is exact, the static
split and the owner loads are closed forms, checked against the CPU backend's plans by --check-plans).
"""

import argparse
import csv
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flatep import eplb, testing  # noqa: E402
from flatep.trace import RoutingTrace  # noqa: E402

PRESETS = {
    # DeepEP's serving shape (prefill-sized calls) and Kimi K3's expert count
    "deepep": dict(ranks=8, tokens=4096, experts=256, topk=8, hidden=7168, ffn=2048),
    "k3": dict(ranks=8, tokens=4096, experts=896, topk=8, hidden=7168, ffn=512),
    "tiny": dict(ranks=4, tokens=64, experts=16, topk=2, hidden=64, ffn=32),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="drift", help="'drift' (generated) or a flatep.trace .npz file")
    p.add_argument("--layer", type=int, default=None, help="the trace's MoE layer (default: the most imbalanced)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="deepep", help="the shape of a generated trace")
    p.add_argument("--steps", type=int, default=1000, help="steps of a generated trace (a file: at most this many)")
    p.add_argument("--sigma", type=float, default=1.0, help="drift: log-normal skew of the popularity")
    p.add_argument("--drift", type=float, default=0.05, help="drift: per-step innovation of log-popularity")
    p.add_argument("--shift-every", type=int, default=250, help="drift: steps between sudden shifts (0: none)")
    p.add_argument("--slots", type=int, default=4, help="B, replica slots a rank (every policy)")
    p.add_argument("--intervals", default="1,10,100,1000", help="static placement's re-placement intervals N")
    p.add_argument("--hidden", type=int, default=None, help="H of the expert weights (bytes moved; --time)")
    p.add_argument("--ffn", type=int, default=None, help="F of the experts (SwiGLU: W1 [H, 2F], W2 [F, H])")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder of eplb_compare.csv, summary.txt and the PNG")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--time", action="store_true", help="time every policy's serving step on the device (a GPU)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--check-plans", type=int, default=0,
                   help="hold the closed forms to the CPU backend's plans on this many steps (virtual ranks)")
    a = p.parse_args(argv)
    try:
        a.intervals = sorted({int(v) for v in a.intervals.split(",")})
    except ValueError:
        p.error(f"--intervals must be a comma list of positive ints, got {a.intervals!r}")
    if not a.intervals or min(a.intervals) < 1:
        p.error(f"--intervals must be a comma list of positive ints, got {a.intervals}")
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    a.command = " ".join(["benchmarks/serving/eplb_compare.py"] + (sys.argv[1:] if argv is None else list(argv)))
    return a


# ---- the routing ----


class Routing:
    """The trace's per-step counts [steps, R, E] (one layer), its shape and a per-rank topk_idx for replays."""

    def __init__(self, args):
        self.seed = args.seed
        if args.trace == "drift":
            shape = PRESETS[args.preset]
            self.R, self.S, self.E, self.K = shape["ranks"], shape["tokens"], shape["experts"], shape["topk"]
            self.hidden, self.ffn = shape["hidden"], shape["ffn"]
            self.steps = args.steps
            self.pop = testing.drifting_popularity(self.E, self.steps, sigma=args.sigma, drift=args.drift,
                                                   shift_every=args.shift_every, seed=args.seed)
            self.trace, self.layer, self._drawn = None, 0, []
            self.name = (f"drift(sigma={args.sigma:g}, drift={args.drift:g}, shift every {args.shift_every}) "
                         f"{args.preset}")
            self._counts = np.stack([self._drift_counts(t) for t in range(self.steps)])
        else:
            self.trace = RoutingTrace.load(args.trace)
            tr = self.trace
            self.R, self.S, self.E, self.K = tr.num_ranks, tr.num_tokens, tr.num_experts, tr.topk
            meta = tr.metadata().get("meta", {}) if hasattr(tr, "metadata") else {}
            self.hidden, self.ffn = meta.get("hidden", 1024), meta.get("ffn", 512)
            self.steps = min(args.steps, tr.num_steps)
            vio = tr.maxvio()
            self.layer = int(np.argmax(vio[: self.steps].mean(0))) if args.layer is None else args.layer
            if not 0 <= self.layer < tr.num_layers:
                raise SystemExit(f"eplb_compare: --layer must be in [0, {tr.num_layers}), got {self.layer}")
            self.name = f"{os.path.basename(args.trace)} layer {self.layer}"
            self._counts = np.stack([np.asarray(tr.counts(t, self.layer)) for t in range(self.steps)])
        if args.hidden:
            self.hidden = args.hidden
        if args.ffn:
            self.ffn = args.ffn
        if self.E % self.R:
            raise SystemExit(f"eplb_compare: E={self.E} experts do not split over R={self.R} ranks")
        self.epn = self.E // self.R

    def _drift_counts(self, t):
        out = np.zeros((self.R, self.E), dtype=np.int64)
        drawn = []
        for r in range(self.R):
            idx = testing.sample_topk_from(self.pop[t], self.S, self.K, r, seed=self.seed * 100_003 + t)
            out[r] = np.bincount(idx.flatten().numpy(), minlength=self.E)
            drawn.append(idx.to(torch.int16))  # kept for the replays (--time): 2 bytes an id
        self._drawn.append(drawn)
        return out

    def counts(self, t):
        return self._counts[t]

    def topk_idx(self, t, rank):
        """Rank `rank`'s routing [S, K] (int64) of step t: the drawn one (kept from the counts' draw), or the trace's
        (recorded, or synthesised from its exact counts)."""
        if self.trace is None:
            return self._drawn[t][rank].long()
        return self.trace.topk_idx(t, self.layer, rank)

    def expert_bytes(self):
        return (self.hidden * 2 * self.ffn + self.ffn * self.hidden) * 2  # SwiGLU bf16 W1 [H, 2F] + W2 [F, H]


# ---- the closed forms of every policy's rows ----


def static_rows(counts, slots, epn):
    """[R] rows each rank computes under a static placement (the split rule of Buffer(planner="static"), design §4):
    expert e's copies are its home rank then the ranks whose slots hold it, in increasing rank order; its T_e
    entries give every copy floor(T_e / n_e) and the T_e mod n_e copies from copy (e mod n_e) on, cyclically, one
    more."""
    R, E = counts.shape
    total = counts.sum(0)
    holders = [[e // epn] for e in range(E)]
    for d in range(R):
        for e in slots[d]:
            if e >= 0:
                holders[e].append(d)
    rows = np.zeros(R, dtype=np.int64)
    for e in range(E):
        ranks = [holders[e][0]] + sorted(holders[e][1:])
        n, t = len(ranks), int(total[e])
        base, extra = divmod(t, n)
        for i, d in enumerate(ranks):
            rows[d] += base + (1 if (i - e % n) % n < extra else 0)
    return rows


def owner_rows(counts, epn):
    R = counts.shape[0]
    return counts.sum(0).reshape(R, epn).sum(1)


def slots_changed(old, new):
    """Slots whose expert differs (a new placement's weight moves), every placed slot against no placement."""
    if old is None:
        return sum(e >= 0 for row in new for e in row)
    return sum(1 for row_o, row_n in zip(old, new) for o, n in zip(row_o, row_n) if n >= 0 and n != o)


class FlatPlans:
    """FlatEP's balanced plans of the trace's steps on the CPU backend (R virtual ranks; a plan depends on the counts
    alone, so each rank's routing is flatep.trace.synthesise_topk of its counts): the replicas each rank hosts, whose
    weights a step moves (B = epn: every one, pushed; B slots: at most B a rank pulled, the rest read in place)."""

    def __init__(self, routing):
        import flatep
        from flatep import virtual

        self.routing = routing
        R = routing.R
        self.ranks = virtual.virtual_ranks(R, "cpu")
        self.bufs = virtual.run_threads(R, lambda r: flatep.Buffer(self.ranks[r], routing.S, 64, routing.E,
                                                                   routing.K, align=1))

    def replicas_per_rank(self, t):
        from flatep import virtual
        from flatep.trace import synthesise_topk

        counts = self.routing.counts(t)
        plans = virtual.run_threads(self.routing.R, lambda r: self.bufs[r].plan(synthesise_topk(counts[r],
                                                                                                self.routing.K)))
        loads = plans[0].stats["loads"]
        if loads != [self.routing.S * self.routing.K] * self.routing.R:
            raise SystemExit(f"eplb_compare: step {t}: FlatEP's plan loads {loads}, not S*K on every rank")
        return [int((p.slot_expert >= 0).sum()) for p in plans]


def simulate(routing, args):
    """{policy: [per step dict(rows, rows_ratio, bytes_moved)]} from the counts (FlatEP's replicas from its plans on
    the CPU backend)."""
    R, S, K, epn, B = routing.R, routing.S, routing.K, routing.epn, args.slots
    even = S * K
    eb = routing.expert_bytes()
    out = {f"flatep_b{B}": [], "flatep_bepn": [], "owner": []}
    out.update({f"static_{n}": [] for n in args.intervals})
    placements = {n: None for n in args.intervals}
    flat = FlatPlans(routing)
    for t in range(routing.steps):
        counts = routing.counts(t)
        # FlatEP's balanced planner is exact: every rank S*K rows (design §4, checked on every plan)
        hosted = flat.replicas_per_rank(t)
        out[f"flatep_b{B}"].append(dict(rows=even, bytes_moved=sum(min(n, B) for n in hosted) * eb))
        out["flatep_bepn"].append(dict(rows=even, bytes_moved=sum(hosted) * eb))
        out["owner"].append(dict(rows=int(owner_rows(counts, epn).max()), bytes_moved=0))
        for n in args.intervals:
            moved = 0
            if t % n == 0:
                window = routing._counts[max(0, t - n):t] if t else routing._counts[0:1]
                new = eplb.place(window.sum((0, 1)).tolist(), R, B)
                moved = slots_changed(placements[n], new) * eb
                placements[n] = new
            out[f"static_{n}"].append(dict(rows=int(static_rows(counts, placements[n], epn).max()),
                                           bytes_moved=moved))
    for recs in out.values():
        for rec in recs:
            rec["rows_ratio"] = rec["rows"] / even
    return out


def p99(values):
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)]


def summarise(results, routing, args, key="rows_ratio", label="busiest rank's rows / S*K"):
    lines = [f"{label}, over {routing.steps} steps of {routing.name} (R={routing.R}, S={routing.S}, E={routing.E}, "
             f"K={routing.K}, B={args.slots}):",
             f"{'policy':>14} {'mean':>8} {'p99':>8} {'max':>8} {'GB moved':>10}"]
    stats = {}
    for policy, recs in results.items():
        vals = [r[key] for r in recs if r.get(key) is not None]
        if not vals:
            continue
        stats[policy] = (statistics.mean(vals), p99(vals))
        moved = sum(r["bytes_moved"] for r in recs) / 1e9
        lines.append(f"{policy:>14} {stats[policy][0]:8.3f} {stats[policy][1]:8.3f} {max(vals):8.3f} {moved:10.2f}")
    statics = {p: v for p, v in stats.items() if p.startswith("static_")}
    flat = stats.get(f"flatep_b{args.slots}")
    if statics and flat:
        best_mean = min(statics, key=lambda p: statics[p][0])
        best_p99 = min(statics, key=lambda p: statics[p][1])
        lines.append(f"flatep_b{args.slots} / best static: mean {flat[0] / statics[best_mean][0]:.3f} ({best_mean}), "
                     f"p99 {flat[1] / statics[best_p99][1]:.3f} ({best_p99})")
    return "\n".join(lines)


def write_csv(path, results, routing, args):
    with open(path, "w", newline="") as f:
        f.write(f"# {args.command}\n# {routing.name}; R={routing.R} S={routing.S} E={routing.E} K={routing.K} "
                f"B={args.slots} expert bytes {routing.expert_bytes()}\n")
        fields = ["step", "policy", "rows", "rows_ratio", "bytes_moved", "time_us"]
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for policy, recs in results.items():
            for t, rec in enumerate(recs):
                w.writerow(dict(rec, step=t, policy=policy, time_us=rec.get("time_us", "")))


def plot(path, results, routing, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any("time_us" in r for recs in results.values() for r in recs)
    panels = [("rows_ratio", "busiest rank's rows / S*K")] + ([("time_us", "serving step (us)")] if timed else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for policy, recs in results.items():
            ys = [r.get(key) for r in recs]
            if any(y is None for y in ys):
                continue
            ax.plot(range(len(ys)), ys, label=policy, lw=1.2 if policy.startswith("flatep") else 0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle(f"{args.command}\n{routing.name}, R={routing.R} S={routing.S} E={routing.E} K={routing.K} "
                 f"B={args.slots}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_plans(routing, args, steps):
    """The closed forms against the CPU backend's plans (virtual ranks): balanced loads S*K and the owner loads."""
    import flatep
    from flatep import virtual

    R = routing.R
    ranks = virtual.virtual_ranks(R, "cpu")
    for planner, expect in (("balanced", lambda c: np.full(R, routing.S * routing.K)),
                            ("owner", lambda c: owner_rows(c, routing.epn))):
        bufs = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], routing.S, 64, routing.E, routing.K,
                                                              align=1, planner=planner))
        for t in range(steps):
            plans = virtual.run_threads(R, lambda r: bufs[r].plan(routing.topk_idx(t, r)))
            got = np.array(plans[0].stats["loads"])
            if not np.array_equal(got, expect(routing.counts(t))):
                raise SystemExit(f"eplb_compare: {planner} step {t}: plan loads {got.tolist()}, closed form "
                                 f"{expect(routing.counts(t)).tolist()}")
    print(f"check: the balanced and owner loads of {steps} steps equal the CPU backend's plans", flush=True)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    routing = Routing(args)
    if not 0 <= args.slots <= routing.epn:
        raise SystemExit(f"eplb_compare: --slots must be in [0, epn={routing.epn}], got {args.slots}")
    print(f"eplb_compare: {routing.name}: R={routing.R} S={routing.S} E={routing.E} K={routing.K} epn={routing.epn} "
          f"B={args.slots}, {routing.steps} steps (routing ready in {time.perf_counter() - t0:.1f} s)", flush=True)
    if args.check_plans:
        check_plans(routing, args, args.check_plans)
    results = simulate(routing, args)
    text = summarise(results, routing, args)
    if args.time:
        import eplb_timing  # the GPU part: benchmarks/serving/eplb_timing.py

        eplb_timing.time_policies(results, routing, args)
        text += "\n\n" + summarise(results, routing, args, key="time_us", label="serving step time (us)")
    out = args.out
    if out:
        os.makedirs(out, exist_ok=True)
        write_csv(os.path.join(out, "eplb_compare.csv"), results, routing, args)
        with open(os.path.join(out, "summary.txt"), "w") as f:
            f.write(f"# {args.command}\n{text}\n")
        if not args.no_plot:
            plot(os.path.join(out, "eplb_compare.png"), results, routing, args)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
