#!/usr/bin/python3
"""Planner quality: greedy vs FlatEP (balanced) vs the MILP optimum (tools/plan_optimum.py).

    /usr/bin/python3 benchmarks/planner/plan_quality.py --build build-quality [--out benchmarks/results] [--seeds 3]
        [--time-limit 20] [--replicas-time-limit 10] [--jobs 2] [--cache DIR]

For each config (R=8 E=384 S=8192 K=8; R=8 E=64 S=4096 K=2; R=16 E=256 S=4096 K=8; R=64 E=256 S=4096 K=8) x maxvio
(0.2, 1, 5, 10, 20) x seeds x capacity factor (1 = exact, 1.05, 1.1, 1.25), flatep-plan-quality (C++) generates the
counts with the routing generator, plans them with both planners (median host time over repeats) and writes each
matrix as a request; plan_optimum.py then solves each request (time limit per stage). Writes
OUT/plan_quality.csv (one row per case and planner: greedy, flatep, optimum) and OUT/plan_quality.png, and prints
the summary table. The optimum is "known" for a case when its P is proven optimal (p_optimal); FlatEP's criterion
is P <= optimum + 1 on those cases.
"""

import argparse
import concurrent.futures
import csv
import json
import os
import subprocess
import sys
import time

CONFIGS = [(8, 384, 8192, 8), (8, 64, 4096, 2), (16, 256, 4096, 8), (64, 256, 4096, 8)]
MAXVIO = [0.2, 1, 5, 10, 20]
FACTORS = [1, 1.05, 1.1, 1.25]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run_optimum(request, cache_dir, time_limit, replicas_time_limit):
    out_path = os.path.join(cache_dir, os.path.basename(request) + f".opt{time_limit:g}_{replicas_time_limit:g}.json")
    if os.path.exists(out_path):
        with open(out_path) as f:
            return json.load(f)
    cmd = ["/usr/bin/python3", os.path.join(ROOT, "tools", "plan_optimum.py"), "--no-alloc", "--compact",
           "--time-limit", str(time_limit), "--replicas-time-limit", str(replicas_time_limit), request]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")
    result = json.loads(res.stdout)
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build-quality"), help="CMake build dir with the binaries")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "results"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=11, help="host planner timing repeats (median)")
    ap.add_argument("--time-limit", type=float, default=20.0, help="solver seconds for min P")
    ap.add_argument("--replicas-time-limit", type=float, default=10.0, help="solver seconds for min replicas")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cache", default="/tmp/flatep_plan_quality", help="request files and cached solver results")
    ap.add_argument("--optimum-max-ranks", type=int, default=16,
                    help="run the solver only for R <= this (at R=64 HiGHS finds no plan within 20 s: status skipped)")
    ap.add_argument("--reuse-host", action="store_true", help="reuse the host CSVs already in --cache")
    args = ap.parse_args()
    t_start = time.monotonic()
    tool = os.path.join(args.build, "benchmarks", "flatep-plan-quality")
    os.makedirs(args.cache, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    host_rows = []
    for R, E, S, K in CONFIGS:
        csv_path = os.path.join(args.cache, f"host_R{R}_E{E}_S{S}_K{K}.csv")
        cmd = [tool, "--ranks", str(R), "--experts", str(E), "--tokens", str(S), "--topk", str(K), "--seeds",
               str(args.seeds), "--maxvio", ",".join(f"{m:g}" for m in MAXVIO), "--factors",
               ",".join(f"{f:g}" for f in FACTORS), "--iters", str(args.repeats), "--dump", args.cache, "--csv", csv_path]
        if not (args.reuse_host and os.path.exists(csv_path)):
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        with open(csv_path) as f:
            host_rows += list(csv.DictReader(f))
    requests = sorted({r["request"] for r in host_rows if int(r["R"]) <= args.optimum_max_ranks})
    print(f"solving {len(requests)} requests with plan_optimum.py ({args.jobs} jobs)", flush=True)
    optimum = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_optimum, q, args.cache, args.time_limit, args.replicas_time_limit): q
                   for q in requests}
        for fut in concurrent.futures.as_completed(futures):
            optimum[futures[fut]] = fut.result()
    rows = []
    for h in host_rows:
        key = {k: h[k] for k in ("R", "E", "S", "K", "capacity_factor", "maxvio_target", "maxvio_real", "seed")}
        planner = "flatep" if h["planner"] == "balanced" else h["planner"]
        rows.append(dict(key, planner=planner, status="", makespan=h["makespan"], total_replicas=h["total_replicas"],
                         entries_moved=h["entries_moved"], local_fraction=h["local_fraction"],
                         host_time_us=h["host_time_us"], p_bound="", replicas_bound="", solver_s=""))
        if planner == "greedy" and h["request"] not in optimum:
            rows.append(dict(key, planner="optimum", status="skipped", makespan="", total_replicas="",
                             entries_moved="", local_fraction="", host_time_us="", p_bound="", replicas_bound="",
                             solver_s=""))
        elif planner == "greedy":
            o = optimum[h["request"]]
            rows.append(dict(key, planner="optimum", status=o["status"] + ("" if not o["p_optimal"] or
                                                                             o["status"] == "optimal" else "/P"),
                             makespan=o["P"] if o["P"] is not None else "",
                             total_replicas=o["replicas"] if o["replicas"] is not None else "",
                             entries_moved=o["entries_moved"] if o["entries_moved"] is not None else "",
                             local_fraction=o["local_fraction"] if o["local_fraction"] is not None else "",
                             host_time_us="", p_bound=o["bound"],
                             replicas_bound=o["replicas_bound"] if o["replicas_bound"] is not None else "",
                             solver_s=round(sum(o["seconds"].values()), 2)))
    command = ("/usr/bin/python3 benchmarks/planner/plan_quality.py --build <build> --seeds {} --repeats {} "
               "--time-limit {:g} --replicas-time-limit {:g} --optimum-max-ranks {} --jobs {}").format(
                   args.seeds, args.repeats, args.time_limit, args.replicas_time_limit, args.optimum_max_ranks,
                   args.jobs)
    fields = ["R", "E", "S", "K", "capacity_factor", "maxvio_target", "maxvio_real", "seed", "planner", "status",
              "makespan", "total_replicas", "entries_moved", "local_fraction", "host_time_us", "p_bound",
              "replicas_bound", "solver_s"]
    csv_out = os.path.join(args.out, "plan_quality.csv")
    with open(csv_out, "w", newline="") as f:
        f.write(f"# {command}\n")
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    summary = summarise(rows)
    print_summary(summary, command)
    draw(summary, os.path.join(args.out, "plan_quality.png"), command)
    print(f"wrote {csv_out} and plan_quality.png in {time.monotonic() - t_start:.0f} s")


def summarise(rows):
    """Per (config, factor, maxvio): means over seeds, and the optimum+1 criterion over known optima."""
    groups = {}
    for r in rows:
        key = (int(r["R"]), int(r["E"]), int(r["S"]), int(r["K"]), float(r["capacity_factor"]),
               float(r["maxvio_target"]))
        groups.setdefault(key, {}).setdefault(r["seed"], {})[r["planner"]] = r
    out = []
    for key in sorted(groups):
        seeds = groups[key]
        s = {"key": key, "n": len(seeds)}
        for p in ("greedy", "flatep"):
            s[p + "_P"] = mean(float(seeds[k][p]["makespan"]) for k in seeds)
            s[p + "_rep"] = mean(float(seeds[k][p]["total_replicas"]) for k in seeds)
            s[p + "_moved"] = mean(float(seeds[k][p]["entries_moved"]) for k in seeds)
            s[p + "_local"] = mean(float(seeds[k][p]["local_fraction"]) for k in seeds)
            s[p + "_us"] = mean(float(seeds[k][p]["host_time_us"]) for k in seeds)
        known = [k for k in seeds if seeds[k]["optimum"]["status"] in ("optimal", "feasible/P")]
        s["known"] = len(known)
        s["opt_P"] = mean(float(seeds[k]["optimum"]["makespan"]) for k in known) if known else None
        s["opt_rep"] = mean(float(seeds[k]["optimum"]["total_replicas"]) for k in known) if known else None
        s["within1"] = sum(int(seeds[k]["flatep"]["makespan"]) <= int(seeds[k]["optimum"]["makespan"]) + 1
                           for k in known)
        s["equal"] = sum(int(seeds[k]["flatep"]["makespan"]) == int(seeds[k]["optimum"]["makespan"]) for k in known)
        s["worse_than_greedy"] = sum(int(seeds[k]["flatep"]["makespan"]) > int(seeds[k]["greedy"]["makespan"]) or
                                     int(seeds[k]["flatep"]["total_replicas"]) >
                                     int(seeds[k]["greedy"]["total_replicas"]) for k in seeds)
        bounds = [float(seeds[k]["optimum"]["p_bound"]) for k in seeds if seeds[k]["optimum"]["p_bound"] != ""]
        s["bound"] = mean(bounds) if bounds else float("nan")
        out.append(s)
    return out


def mean(values):
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def print_summary(summary, command):
    print(f"\nplanner quality ({command}); means over seeds; opt = MILP optimum over the seeds where P is proven")
    print(f"{'config':>22} {'f':>5} {'maxvio':>6} | {'P greedy':>8} {'flatep':>6} {'opt':>5} | {'rep greedy':>10}"
          f" {'flatep':>6} {'opt':>5} | {'known':>5} {'<=opt+1':>7} {'=opt':>4} | {'moved fl/gr':>11} {'us flatep':>9}")
    tot_known = tot_within = tot_equal = tot_worse = 0
    for s in summary:
        R, E, S, K, f, mv = s["key"]
        print(f"{f'R={R} E={E} S={S} K={K}':>22} {f:>5g} {mv:>6g} | {s['greedy_P']:>8.2f} {s['flatep_P']:>6.2f} "
              f"{fmt(s['opt_P']):>5} | {s['greedy_rep']:>10.2f} {s['flatep_rep']:>6.2f} {fmt(s['opt_rep']):>5} | "
              f"{s['known']:>2}/{s['n']:<2} {s['within1']:>7} {s['equal']:>4} | "
              f"{s['flatep_moved'] / max(s['greedy_moved'], 1):>11.4f} {s['flatep_us']:>9.1f}")
        tot_known += s["known"]
        tot_within += s["within1"]
        tot_equal += s["equal"]
        tot_worse += s["worse_than_greedy"]
    pct = 100.0 * tot_within / tot_known if tot_known else float("nan")
    print(f"\nFlatEP P <= optimum+1 on {tot_within}/{tot_known} cases with a known optimum ({pct:.1f}%), "
          f"P == optimum on {tot_equal}; cases worse than greedy (P or replicas): {tot_worse}")


def draw(summary, path, command):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = sorted({s["key"][:4] for s in summary})
    fig, axes = plt.subplots(2, len(configs), figsize=(4.2 * len(configs), 7.5), squeeze=False)
    for ci, cfg in enumerate(configs):
        exact = [s for s in summary if s["key"][:4] == cfg and s["key"][4] == 1.0]
        mv = [s["key"][5] for s in exact]
        x = range(len(mv))
        ax = axes[0][ci]
        ax.plot(x, [s["greedy_P"] for s in exact], "o-", label="greedy")
        ax.plot(x, [s["flatep_P"] for s in exact], "s-", label="FlatEP")
        ax.plot(x, [s["opt_P"] if s["opt_P"] is not None else float("nan") for s in exact], "^--", label="optimum")
        ax.plot(x, [s["bound"] for s in exact], ":", color="gray", label="solver bound")
        ax.set_xticks(list(x), [f"{m:g}" for m in mv])
        ax.set_title(f"R={cfg[0]} E={cfg[1]} S={cfg[2]} K={cfg[3]}, exact")
        ax.set_xlabel("maxvio")
        ax.set_ylabel("prefetch makespan P (experts)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ci == 0:
            ax.legend(fontsize=8)
        ax = axes[1][ci]
        factors = sorted({s["key"][4] for s in summary if s["key"][:4] == cfg})
        width = 0.8 / len(factors)
        for fi, f in enumerate(factors):
            rows = [s for s in summary if s["key"][:4] == cfg and s["key"][4] == f]
            ax.bar([i + fi * width for i in range(len(rows))], [s["flatep_rep"] for s in rows], width,
                   label=f"FlatEP f={f:g}")
        ax.set_xticks([i + 0.4 - width / 2 for i in x], [f"{m:g}" for m in mv])
        ax.set_xlabel("maxvio")
        ax.set_ylabel("total replicas (FlatEP)")
        ax.grid(alpha=0.3, axis="y")
        if ci == 0:
            ax.legend(fontsize=8)
    fig.suptitle("Planner quality: greedy vs FlatEP vs MILP optimum (top); replicas saved by slack (bottom)\n" +
                 command, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
