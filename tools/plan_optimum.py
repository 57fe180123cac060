#!/usr/bin/python3
"""plan_optimum: the exact optimum of FlatEP's planning problem (design §4) as a mixed-integer program.

    /usr/bin/python3 tools/plan_optimum.py [--time-limit 30] [--replicas-time-limit S] [--compact] [--no-alloc] [FILE]

Reads the same JSON as flatep-plan ({"R","E","S","K","align"?,"capacity_factor"?,"tpe"}) from FILE or stdin and
prints one JSON object:

    status         "optimal"    P and total replicas both proven optimal
                   "feasible"   a plan was found, not proven optimal (see p_optimal, bound, replicas_bound)
                   "timeout"    no plan found within the time limit (bound may still be set)
    p_optimal      true when P is proven optimal (the replicas stage may still have timed out)
    P, replicas    makespan and total replicas of the best plan found (null on timeout)
    bound          proven lower bound on P;  replicas_bound: lower bound on the replicas at that P (null if none)
    entries_moved  entries computed off their source rank under plan.hpp's split rule (locality, objective 3)
    local_fraction (N - entries_moved) / N
    alloc          [R][E] integer allocation (omitted with --no-alloc)
    seconds        wall time per stage

Model (design §4). Variables a[d][e] >= 0 (entries of expert e computed on rank d), binary y[d][e] for every d that is
not e's home (a replica of e on d), integer P.
    sum_d a[d][e] = T_e                              conservation (constraint 1)
    sum_e a[d][e] = target_d   (exact)               balance (constraint 2): target_d = floor(N/R) + (d < N % R)
    sum_e a[d][e] <= C         (slack)                                      as the planner's targets
    a[d][e] <= min(T_e, cap_d) * y[d][e]             a replica is needed to compute e off its home
    sum_e y[d][e] <= epn                             slots (constraint 3)
    sum_e y[d][e] <= P                               replicas received by d
    sum_{e home r} sum_d y[d][e] <= P                replica copies sent by r
Constraint 4 (determinism) is a property of the split rule, not of the allocation, so any allocation is admissible.

Lexicographic objective: stage 1 minimises P; stage 2 fixes P at its optimum (or at the best P found, if stage 1
timed out) and minimises sum y; stage 3 fixes y and maximises the entries kept on their source rank (locality).
a may be continuous in stages 1-2: with y fixed the remaining problem is a transportation flow with integer
supplies, demands and capacities, whose feasibility does not change under integrality; stage 3 solves for an integral
a. Solver: HiGHS through scipy.optimize.milp, with time limits for stage 1 (--time-limit) and stage 2
(--replicas-time-limit); stage 2 also gets the valid cut sum y >= replicas_lower_bound() so that it stops as soon as
it reaches that bound.
"""

import argparse
import json
import math
import sys
import time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix


def fail(message):
    print("plan_optimum: error: " + " ".join(str(message).split()), file=sys.stderr)
    sys.exit(1)


def read_request(text):
    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        fail(f"invalid JSON: {e}")
    if not isinstance(req, dict):
        fail("the input must be a JSON object")
    known = {"R", "E", "S", "K", "align", "capacity_factor", "tpe"}
    for k in req:
        if k not in known:
            fail(f'unknown field "{k}"')
    for k in ("R", "E", "S", "K", "tpe"):
        if k not in req:
            fail(f'missing field "{k}"')
    R, E, S, K = (int(req[k]) for k in ("R", "E", "S", "K"))
    if R < 1 or E < 1 or E % R != 0:
        fail(f"E = {E} must be a positive multiple of R = {R}")
    f = float(req.get("capacity_factor", 1.0))
    if not (1.0 <= f <= 4.0):
        fail(f"capacity_factor must be in [1, 4], got {f}")
    tpe = np.asarray(req["tpe"], dtype=np.int64)
    if tpe.shape != (R, E):
        fail(f"tpe must be [R={R}][E={E}], got shape {tpe.shape}")
    if (tpe < 0).any():
        fail("tpe has a negative count")
    if (tpe.sum(axis=1) > S * K).any():
        fail(f"a tpe row sums above S*K = {S * K}")
    sk = S * K
    capacity = sk if f == 1.0 else int(math.ceil(f * sk))
    return R, E, S, K, f, capacity, tpe


class Model:
    """Index bookkeeping and constraint matrices of the model in the module docstring."""

    def __init__(self, R, E, exact, capacity, tpe):
        self.R, self.E, self.epn = R, E, E // R
        self.tpe = tpe
        self.total = tpe.sum(axis=0)
        n = int(self.total.sum())
        if exact:
            self.target = np.array([n // R + (1 if d < n % R else 0) for d in range(R)], dtype=np.int64)
        else:
            self.target = None
        self.cap = self.target if exact else np.full(R, capacity, dtype=np.int64)
        self.exact = exact
        home = np.arange(E) // self.epn
        # Replica pairs: d != home(e) and T_e > 0 and the rank can take something.
        self.pairs = [(d, e) for d in range(R) for e in range(E)
                      if d != home[e] and self.total[e] > 0 and self.cap[d] > 0]
        self.num_a = R * E
        self.num_y = len(self.pairs)
        self.p_idx = self.num_a + self.num_y
        self.num_vars = self.p_idx + 1
        self.home = home

    def a_idx(self, d, e):
        return d * self.E + e

    def base(self):
        """Bounds, integrality and constraints shared by stages 1 and 2."""
        R, E, epn = self.R, self.E, self.epn
        lb = np.zeros(self.num_vars)
        ub = np.zeros(self.num_vars)
        for e in range(E):
            ub[self.a_idx(self.home[e], e)] = min(self.total[e], self.cap[self.home[e]])
        for k, (d, e) in enumerate(self.pairs):
            ub[self.a_idx(d, e)] = min(self.total[e], self.cap[d])
            ub[self.num_a + k] = 1
        ub[self.p_idx] = R * epn
        integrality = np.zeros(self.num_vars)
        integrality[self.num_a:] = 1
        rows, cols, vals, lo, hi = [], [], [], [], []
        r = 0

        def add(entries, low, high):
            nonlocal r
            for c, v in entries:
                rows.append(r)
                cols.append(c)
                vals.append(v)
            lo.append(low)
            hi.append(high)
            r += 1

        for e in range(E):  # conservation
            add([(self.a_idx(d, e), 1.0) for d in range(R)], self.total[e], self.total[e])
        for d in range(R):  # balance
            add([(self.a_idx(d, e), 1.0) for e in range(E)], self.target[d] if self.exact else 0,
                self.cap[d])
        recv = [[] for _ in range(R)]
        send = [[] for _ in range(R)]
        for k, (d, e) in enumerate(self.pairs):  # linking
            add([(self.a_idx(d, e), 1.0), (self.num_a + k, -float(ub[self.a_idx(d, e)]))], -np.inf, 0)
            recv[d].append(self.num_a + k)
            send[self.home[e]].append(self.num_a + k)
        for d in range(R):
            if recv[d]:
                add([(c, 1.0) for c in recv[d]], 0, epn)  # slots
                add([(c, 1.0) for c in recv[d]] + [(self.p_idx, -1.0)], -np.inf, 0)
            if send[d]:
                add([(c, 1.0) for c in send[d]] + [(self.p_idx, -1.0)], -np.inf, 0)
        a = coo_matrix((vals, (rows, cols)), shape=(r, self.num_vars)).tocsr()
        return lb, ub, integrality, LinearConstraint(a, np.array(lo, dtype=float), np.array(hi, dtype=float))


def replicas_lower_bound(m):
    """A combinatorial lower bound on the total replicas (HiGHS's LP bound is weak here).

    Replicas are edges (home rank -> host rank) of a graph on the ranks; entries only move along edges, so in exact
    mode the surplus (G_r - target_r) of every connected component sums to zero, and a component of c ranks has at
    least c - 1 edges. Hence replicas >= nz - B, with nz the ranks of non-zero surplus and B the largest number of
    blocks of a partition of them into zero-sum blocks (exact for nz <= 16 by a DP over subsets: orderings whose
    prefix sums hit zero B times; else bounded by opposite pairs plus blocks of >= 3). In slack mode every rank above
    C sends at least one copy.
    """
    loads = np.array([m.total[d * m.epn:(d + 1) * m.epn].sum() for d in range(m.R)], dtype=np.int64)
    if not m.exact:
        return int((loads > m.cap).sum())
    surplus = [int(v) for v in loads - m.target if v != 0]
    nz = len(surplus)
    if nz == 0:
        return 0
    if nz <= 16:
        size = 1 << nz
        sums = np.zeros(size, dtype=np.int64)
        for i in range(nz):
            sums[1 << i:1 << (i + 1)] = sums[:1 << i] + surplus[i]
        best = np.zeros(size, dtype=np.int64)
        for mask in range(1, size):
            b = 0
            mm = mask
            while mm:
                low = mm & -mm
                v = best[mask ^ low]
                if v > b:
                    b = v
                mm ^= low
            best[mask] = b + (1 if sums[mask] == 0 else 0)
        return nz - int(best[size - 1])
    counts = {}
    for v in surplus:
        counts[v] = counts.get(v, 0) + 1
    pairs = sum(min(counts[v], counts.get(-v, 0)) for v in counts if v > 0)
    return nz - (pairs + (nz - 2 * pairs) // 3)


def solve(c, integrality, lb, ub, cons, time_limit):
    t0 = time.monotonic()
    res = milp(c, integrality=integrality, bounds=Bounds(lb, ub), constraints=cons,
               options={"time_limit": float(time_limit), "mip_rel_gap": 0.0, "disp": False})
    return res, time.monotonic() - t0


def dual_bound(res):
    b = getattr(res, "mip_dual_bound", None)
    if b is None or not np.isfinite(b):
        return None
    return b


def optimise(R, E, exact, capacity, tpe, time_limit, replicas_time_limit):
    m = Model(R, E, exact, capacity, tpe)
    lb, ub, integrality, cons = m.base()
    out = {"p_optimal": False, "P": None, "replicas": None, "bound": 0, "replicas_bound": None, "alloc": None,
           "seconds": {}}
    # Stage 1: min P.
    c = np.zeros(m.num_vars)
    c[m.p_idx] = 1.0
    res, secs = solve(c, integrality, lb, ub, cons, time_limit)
    out["seconds"]["p"] = round(secs, 3)
    if res.status == 2:
        fail("the model is infeasible (unexpected for valid counts)")
    b = dual_bound(res)
    if b is not None:
        out["bound"] = max(0, int(math.ceil(b - 1e-6)))
    if res.x is None:
        out["status"] = "timeout"
        return out, m
    p_best = int(round(res.x[m.p_idx]))
    out["p_optimal"] = res.status == 0 or out["bound"] >= p_best
    if out["p_optimal"]:
        out["bound"] = p_best
    y_best = np.round(res.x[m.num_a:m.p_idx]).astype(np.int64)
    # Stage 2: P fixed (<= best), min total replicas, with the valid cut sum y >= replicas_lower_bound (lets HiGHS
    # stop as soon as it reaches it).
    ub2 = ub.copy()
    ub2[m.p_idx] = p_best
    c = np.zeros(m.num_vars)
    c[m.num_a:m.p_idx] = 1.0
    rep_lb = replicas_lower_bound(m)
    out["replicas_lower_bound"] = rep_lb
    if int(y_best.sum()) <= rep_lb:
        res2, secs = None, 0.0
    else:
        cut = np.zeros((1, m.num_vars))
        cut[0, m.num_a:m.p_idx] = 1.0
        res2, secs = solve(c, integrality, lb, ub2, [cons, LinearConstraint(cut, rep_lb, np.inf)],
                           replicas_time_limit)
    out["seconds"]["replicas"] = round(secs, 3)
    replicas_optimal = res2 is None
    if res2 is not None and res2.x is not None:
        y2 = np.round(res2.x[m.num_a:m.p_idx]).astype(np.int64)
        if y2.sum() <= y_best.sum():
            y_best = y2
        replicas_optimal = res2.status == 0
        b2 = dual_bound(res2)
        if b2 is not None:
            out["replicas_bound"] = max(rep_lb, int(math.ceil(b2 - 1e-6)))
    elif res2 is not None:
        out["replicas_bound"] = rep_lb
    if replicas_optimal:
        out["replicas_bound"] = int(y_best.sum())
    # Stage 3: y fixed, integral a maximising the entries kept on their source rank. Variables a[R*E], kept[R*E].
    alloc, secs = locality_stage(m, y_best, time_limit)
    out["seconds"]["locality"] = round(secs, 3)
    out["alloc"] = alloc
    out["status"] = "optimal" if out["p_optimal"] and replicas_optimal else "feasible"
    return out, m


def locality_stage(m, y, time_limit):
    R, E = m.R, m.E
    n = R * E
    ub_a = np.zeros(n)
    for e in range(E):
        ub_a[m.a_idx(m.home[e], e)] = min(m.total[e], m.cap[m.home[e]])
    for k, (d, e) in enumerate(m.pairs):
        if y[k]:
            ub_a[m.a_idx(d, e)] = min(m.total[e], m.cap[d])
    ub = np.concatenate([ub_a, m.tpe.reshape(-1).astype(float)])
    lb = np.zeros(2 * n)
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for e in range(E):
        for d in range(R):
            rows.append(r), cols.append(m.a_idx(d, e)), vals.append(1.0)
        lo.append(m.total[e]), hi.append(m.total[e])
        r += 1
    for d in range(R):
        for e in range(E):
            rows.append(r), cols.append(m.a_idx(d, e)), vals.append(1.0)
        lo.append(m.target[d] if m.exact else 0), hi.append(m.cap[d])
        r += 1
    for i in range(n):  # kept <= a
        rows += [r, r]
        cols += [n + i, i]
        vals += [1.0, -1.0]
        lo.append(-np.inf), hi.append(0)
        r += 1
    a_mat = coo_matrix((vals, (rows, cols)), shape=(r, 2 * n)).tocsr()
    c = np.concatenate([np.zeros(n), -np.ones(n)])
    res, secs = solve(c, np.ones(2 * n), lb, ub, LinearConstraint(a_mat, np.array(lo, float), np.array(hi, float)),
                      time_limit)
    if res.x is None:
        fail("the locality stage found no allocation for a feasible replica set (unexpected)")
    alloc = np.round(res.x[:n]).astype(np.int64).reshape(R, E)
    return alloc, secs


def evaluate(alloc, tpe, epn):
    R, E = alloc.shape
    home = np.arange(E) // epn
    num_in = np.zeros(R, dtype=np.int64)
    num_out = np.zeros(R, dtype=np.int64)
    for d in range(R):
        for e in np.nonzero(alloc[d])[0]:
            if home[e] != d:
                num_in[d] += 1
                num_out[home[e]] += 1
    kept = int(np.minimum(alloc, tpe).sum())
    n = int(tpe.sum())
    return int(max(num_in.max(), num_out.max())), int(num_in.sum()), n - kept, (kept / n if n else 1.0)


def main():
    ap = argparse.ArgumentParser(description="Exact optimum of the FlatEP planning problem (MILP, HiGHS).")
    ap.add_argument("file", nargs="?", default="-")
    ap.add_argument("--time-limit", type=float, default=30.0, help="solver seconds for stage 1 (min P)")
    ap.add_argument("--replicas-time-limit", type=float, default=None,
                    help="solver seconds for stage 2 (min replicas; default: --time-limit)")
    ap.add_argument("--compact", action="store_true")
    ap.add_argument("--no-alloc", action="store_true", help="leave the allocation out of the output")
    args = ap.parse_args()
    text = sys.stdin.read() if args.file == "-" else open(args.file).read()
    R, E, S, K, f, capacity, tpe = read_request(text)
    rep_limit = args.time_limit if args.replicas_time_limit is None else args.replicas_time_limit
    out, m = optimise(R, E, f == 1.0, capacity, tpe, args.time_limit, rep_limit)
    result = {"R": R, "E": E, "S": S, "K": K, "capacity_factor": f, "capacity": capacity, "status": out["status"],
              "p_optimal": out["p_optimal"], "P": None, "replicas": None, "bound": out["bound"],
              "replicas_bound": out["replicas_bound"], "entries_moved": None, "local_fraction": None,
              "seconds": out["seconds"]}
    alloc = out["alloc"]
    if alloc is not None:
        # Check the allocation against the constraints before reporting it.
        assert (alloc.sum(axis=0) == m.total).all(), "conservation violated"
        loads = alloc.sum(axis=1)
        assert ((loads == m.target) if m.exact else (loads <= capacity)).all(), "balance violated"
        p, reps, moved, local = evaluate(alloc, tpe, m.epn)
        result.update({"P": p, "replicas": reps, "entries_moved": moved, "local_fraction": local})
        if not args.no_alloc:
            result["alloc"] = alloc.tolist()
    json.dump(result, sys.stdout, separators=(",", ":") if args.compact else None, indent=None if args.compact else 1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
