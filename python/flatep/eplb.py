"""Periodic expert placement ("EPLB"), the balancing serving engines run instead of planning every step.

Every N steps such an engine counts each expert's load over a recent window, gives the hottest experts extra
replicas in a fixed number of redundant slots, packs those replicas onto ranks so that the expected rank loads are
even, moves the weights, and until the next rearrangement routes each token row to one replica of its expert by a
fixed rule. This module is that placement algorithm, written from the engines' public descriptions (replicate by
load, then pack replicas onto ranks; optionally nodes first, then the ranks of each node), on FlatEP's layout: rank r
owns experts [r*epn, (r+1)*epn) for good (their weights never move) and has B slots for replicas of other ranks'
experts. ``flatep.Buffer(planner="static")`` with ``set_placement`` runs the placement;
benchmarks/serving/eplb_compare.py sets it against FlatEP's per-step plan.

    loads = window_counts.sum(0)                        # [E] entries per expert over the window
    slots = flatep.eplb.place(loads, num_ranks=8, num_slots=4)    # [R][B] expert ids, -1 = empty slot

The two steps (each deterministic: every tie goes to the lower expert id, then the lower rank):

* replicate(loads, R, R*B): the expert copies. Every expert has its home copy; each of the R*B extra copies goes, one
  at a time, to the expert whose load per copy L_e / n_e is the largest (an expert has at most R copies, one a rank).
  This greedy minimises the largest load per copy for the number of copies (brute force agrees: tests).
* pack(loads, copies, R, B): the extra copies onto slots. Each copy carries L_e / n_e (an expert's entries are split
  evenly over its copies); the home copies are fixed, so rank d starts with the load of its own experts' home copies.
  Copies are taken in decreasing load (ties: lower expert id) and each goes to the rank of least load (ties: lower
  rank) that has a free slot and holds no copy of that expert yet (longest-processing-time packing with slot
  limits). With num_nodes > 1 the copies are first packed onto nodes (each node's slots and loads summed), then each
  node's copies onto its ranks: an engine's hierarchical variant, which keeps a replica inside the node when it can.

Loads are integers (entry counts) and every comparison is exact (fractions as cross products), so the placement
is the same on every rank and every machine.
"""

from fractions import Fraction

import torch

__all__ = ["replicate", "pack", "place", "rank_loads", "expected_max_load"]


def _loads(loads, op):
    values = torch.as_tensor(loads).flatten().tolist()
    if not values or any(isinstance(v, float) and v != int(v) for v in values):
        raise ValueError(f"{op}: loads must be a non-empty list of non-negative integer counts, got {values[:8]}")
    values = [int(v) for v in values]
    if min(values) < 0:
        raise ValueError(f"{op}: loads must be non-negative, got {min(values)}")
    return values


def _check_shape(op, num_experts, num_ranks, num_slots):
    for name, value in (("num_ranks", num_ranks), ("num_slots", num_slots)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{op}: {name} must be an int, got {value!r}")
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"{op}: the {num_experts} experts must split evenly over num_ranks={num_ranks}")
    epn = num_experts // num_ranks
    if not 0 <= num_slots <= epn:
        raise ValueError(f"{op}: num_slots must be in [0, epn={epn}], got {num_slots}")
    return epn


def _max_flow(edges, source, sink):
    """The value of a maximum flow over edges {(u, v): capacity} (Edmonds-Karp; the graphs here are small: the
    experts that need copies by the ranks)."""
    residual, adjacent = {}, {}
    for (u, v), c in edges.items():
        residual[u, v] = residual.get((u, v), 0) + c
        residual.setdefault((v, u), 0)
        adjacent.setdefault(u, []).append(v)
        adjacent.setdefault(v, []).append(u)
    total = 0
    while True:
        parent, frontier = {source: None}, [source]
        while frontier and sink not in parent:
            nxt = []
            for u in frontier:
                for v in adjacent.get(u, ()):
                    if v not in parent and residual[u, v] > 0:
                        parent[v] = u
                        nxt.append(v)
            frontier = nxt
        if sink not in parent:
            return total
        path, v = [], sink
        while parent[v] is not None:
            path.append((parent[v], v))
            v = parent[v]
        push = min(residual[e] for e in path)
        for u, v in path:
            residual[u, v] -= push
            residual[v, u] += push
        total += push


def _fits(need, room, may, ranks_per_node=None):
    """Whether copies fit: need {(expert, node or None): copies}, room [ranks] free slots, may(e, d) whether rank d
    may hold a copy of e at all; a copy keyed to node n goes onto that node's ranks (d // ranks_per_node == n), and
    no rank holds two copies of one expert. Exact, as a flow source -> key -> (expert, rank) [1] -> rank [room] -> sink."""
    want = sum(need.values())
    if want == 0:
        return True
    edges = {}
    for (e, node), c in need.items():
        if c <= 0:
            continue
        edges["s", ("k", e, node)] = c
        for d in range(len(room)):
            if may(e, d) and (node is None or d // ranks_per_node == node):
                edges[("k", e, node), ("x", e, d)] = c
                edges[("x", e, d), ("r", d)] = 1
                edges[("r", d), "t"] = room[d]
    return _max_flow(edges, "s", "t") == want


def _packable(need, room, allowed):
    """_fits of need {expert: copies}, none keyed to a node, where allowed(e, d)."""
    return _fits({(e, None): c for e, c in need.items()}, room, allowed)


def _rank_allowed(epn, holds):
    return lambda e, d: e // epn != d and e not in holds[d]


def replicate(loads, num_ranks, extra, num_slots=None):
    """[E] copies per expert (home copy included): `extra` more copies (<= E*(R-1)), each to the expert of the
    largest load per copy (ties: the lower id) among those whose copies can still be packed onto R ranks of
    num_slots slots (one copy of an expert a rank, never on its home rank; None: no slot limit)."""
    loads = _loads(loads, "replicate")
    E = len(loads)
    if isinstance(extra, bool) or not isinstance(extra, int) or not 0 <= extra <= E * (num_ranks - 1):
        raise ValueError(f"replicate: extra must be an int in [0, E*(R-1)={E * (num_ranks - 1)}], got {extra!r}")
    if num_slots is not None and extra > num_ranks * num_slots:
        raise ValueError(f"replicate: extra={extra} copies do not fit R*B={num_ranks * num_slots} slots")
    epn = E // num_ranks if E % num_ranks == 0 else None
    copies = [1] * E
    allowed = None if num_slots is None or epn is None else _rank_allowed(epn, [set()] * num_ranks)
    for _ in range(extra):
        # candidates by load per copy, largest first (exact: cross products), then the lower id
        order = sorted((e for e in range(E) if copies[e] < num_ranks),
                       key=lambda e: (-Fraction(loads[e], copies[e]), e))
        for e in order:
            if allowed is not None:
                need = {x: copies[x] - 1 for x in range(E) if copies[x] > 1}
                need[e] = copies[e]
                if not _packable(need, [num_slots] * num_ranks, allowed):
                    continue
            copies[e] += 1
            break
        else:
            break  # nothing more can be placed
    return copies


def _pack_onto(bins, capacity, start, items, holds, allowed):
    """LPT packing: items [(load Fraction, expert)] in order, each onto the bin of least load (ties: the lower bin)
    that allowed(e, b), has room, holds no copy of that expert, and leaves the items after it packable. Returns [bin
    per item]; updates start (loads) and holds (sets of experts)."""
    room = list(capacity)
    out = []
    for i, (load, e) in enumerate(items):
        rest = {}
        for _, x in items[i + 1:]:
            rest[x] = rest.get(x, 0) + 1
        best = -1
        for b in sorted(range(bins), key=lambda b: (start[b], b)):
            if room[b] <= 0 or e in holds[b] or not allowed(e, b):
                continue
            room[b] -= 1
            holds[b].add(e)
            ok = _packable(rest, room, lambda x, c: allowed(x, c) and x not in holds[c])
            room[b] += 1
            holds[b].discard(e)
            if ok:
                best = b
                break
        if best < 0:
            raise ValueError(f"pack: no bin with a free slot can take a copy of expert {e}")
        room[best] -= 1
        start[best] += load
        holds[best].add(e)
        out.append(best)
    return out


def pack(loads, copies, num_ranks, num_slots, num_nodes=1):
    """[R][B] expert ids (-1: empty) of the extra copies of `copies` ([E], from replicate) packed onto the ranks'
    slots (module docstring). num_nodes: ranks in equal consecutive blocks per node; > 1 packs nodes first."""
    loads = _loads(loads, "pack")
    E, R = len(loads), num_ranks
    epn = _check_shape("pack", E, R, num_slots)
    if len(copies) != E or any(not 1 <= c <= R for c in copies) or sum(c - 1 for c in copies) > R * num_slots:
        raise ValueError(f"pack: copies must be E={E} counts in [1, R={R}] with at most R*B={R * num_slots} extra")
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1 or R % num_nodes:
        raise ValueError(f"pack: num_nodes must be an int dividing num_ranks={R}, got {num_nodes!r}")
    share = [Fraction(loads[e], copies[e]) for e in range(E)]
    rank_load = [sum(share[e] for e in range(d * epn, (d + 1) * epn)) for d in range(R)]
    holds = [set() for d in range(R)]
    home = _rank_allowed(epn, [set()] * R)
    if not _packable({e: copies[e] - 1 for e in range(E) if copies[e] > 1}, [num_slots] * R, home):
        raise ValueError("pack: these copies cannot be placed (one copy of an expert a rank, never on its home rank, "
                         f"{num_slots} slots a rank)")
    items = sorted(((share[e], e) for e in range(E) for _ in range(copies[e] - 1)), key=lambda t: (-t[0], t[1]))
    slots = [[] for _ in range(R)]
    per = R // num_nodes
    if num_nodes == 1:
        groups = [(list(range(R)), items)]
    else:  # nodes first: each copy to the node of least load whose ranks can still take it, such that every copy
        # (those given a node: onto its ranks; the rest: anywhere) can still be placed; then each node's copies onto
        # its ranks
        node_load = [sum(rank_load[n * per:(n + 1) * per]) for n in range(num_nodes)]
        node_items = [[] for _ in range(num_nodes)]
        chosen_node = []

        def fits_with(rest):
            need = {}
            for (_, e), n in zip(items, chosen_node):
                need[e, n] = need.get((e, n), 0) + 1
            for _, e in rest:
                need[e, None] = need.get((e, None), 0) + 1
            return _fits(need, [num_slots] * R, home, ranks_per_node=per)

        for i, (load, e) in enumerate(items):
            picked = -1
            for n in sorted(range(num_nodes), key=lambda n: (node_load[n], n)):
                chosen_node.append(n)
                ok = fits_with(items[i + 1:])
                chosen_node.pop()
                if ok:
                    picked = n
                    break
            if picked < 0:
                raise ValueError(f"pack: no node with a free slot can take a copy of expert {e}")
            chosen_node.append(picked)
            node_load[picked] += load
            node_items[picked].append((load, e))
        groups = [(list(range(n * per, (n + 1) * per)), node_items[n]) for n in range(num_nodes)]
    for ranks, group_items in groups:
        start = [rank_load[d] for d in ranks]
        group_holds = [holds[d] for d in ranks]
        allowed = lambda e, i, ranks=ranks: home(e, ranks[i])  # noqa: E731
        for (_, e), i in zip(group_items, _pack_onto(len(ranks), [num_slots] * len(ranks), start, group_items,
                                                     group_holds, allowed)):
            slots[ranks[i]].append(e)
    return [sorted(s) + [-1] * (num_slots - len(s)) for s in slots]


def place(loads, num_ranks, num_slots, num_nodes=1):
    """The placement of a window's per-expert loads [E]: [R][B] expert ids per rank's slots (-1 = empty):
    replicate(loads, R, R*B extra copies at most, as many as distinct ranks allow) then pack."""
    loads = _loads(loads, "place")
    E = len(loads)
    _check_shape("place", E, num_ranks, num_slots)
    extra = min(num_ranks * num_slots, E * (num_ranks - 1))
    return pack(loads, replicate(loads, num_ranks, extra, num_slots), num_ranks, num_slots, num_nodes)


def rank_loads(loads, slots):
    """[R] expected entries per rank (Fractions) under a placement: each expert's load split evenly over its home
    copy and its slot copies."""
    loads = _loads(loads, "rank_loads")
    R, E = len(slots), len(loads)
    epn = E // R
    copies = [1] * E
    for row in slots:
        for e in row:
            if e >= 0:
                copies[e] += 1
    out = []
    for d in range(R):
        hosted = list(range(d * epn, (d + 1) * epn)) + [e for e in slots[d] if e >= 0]
        out.append(sum(Fraction(loads[e], copies[e]) for e in hosted))
    return out


def expected_max_load(loads, slots):
    """The largest expected rank load under a placement, over the mean (1.0 = perfectly even)."""
    per_rank = rank_loads(loads, slots)
    total = sum(per_rank)
    return float(max(per_rank) * len(per_rank) / total) if total else 1.0
