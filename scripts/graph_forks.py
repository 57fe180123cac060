#!/usr/bin/env python3
"""Where a captured CUDA graph is not a chain: reads CUDA's debug dump of a graph (Graphviz, as
torch.cuda.CUDAGraph.debug_dump or cudaGraphDebugDotPrint write it) and prints its size and every fork (a node with
several successors), each branch as the nodes it runs until it meets another branch or ends. In a chain no two kernels
may run side by side; each fork names kernels that may.

    python3 scripts/graph_forks.py step_graph_rank1.dot [--limit 12]

Used by scripts/device.sh's step_graph_repeat step on the whole-step test's graphs (benchmarks/results/LOG.md: the
known failure).
"""

import argparse
import re
import sys

_NODE = re.compile(r'"([^"]+)"\s*\[(.*?)\]\s*;?\s*$', re.S | re.M)
_EDGE = re.compile(r'"([^"]+)"\s*->\s*"([^"]+)"')
_MANGLED = re.compile(r"_Z[\w]+")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_LABEL = re.compile(r'label\s*=\s*"((?:[^"\\]|\\.)*)"', re.S)


def node_name(attributes):
    """A short name of a node from its attributes: the first mangled symbol (a kernel), else the longest identifier of
    its label (an unmangled kernel's name, MEMSET, ...)."""
    label = _LABEL.search(attributes)
    text = label.group(1) if label else attributes
    mangled = _MANGLED.search(text)
    if mangled:
        return mangled.group(0)
    identifiers = _IDENTIFIER.findall(text.replace("\\n", " ").replace("\\l", " "))
    return max(identifiers, key=len) if identifiers else "?"


def parse(text):
    """(names, successors, predecessors): dicts keyed by node id, from the DOT text."""
    names, succ, pred = {}, {}, {}
    for line in text.splitlines():
        for a, b in _EDGE.findall(line):
            succ.setdefault(a, []).append(b)
            pred.setdefault(b, []).append(a)
            names.setdefault(a, a)
            names.setdefault(b, b)
    for match in _NODE.finditer(text):
        line_start = text.rfind("\n", 0, match.start()) + 1
        if "->" in text[line_start : match.start()]:  # an edge's head and its attributes, not a node
            continue
        names[match.group(1)] = node_name(match.group(2))
    for node in names:
        succ.setdefault(node, [])
        pred.setdefault(node, [])
    return names, succ, pred


def forks(succ, pred, limit):
    """[(fork node, [branch, ...])]: each branch the nodes from one successor on while they have one predecessor
    and one successor (at most `limit`), in the file's node order."""
    out = []
    for node, nexts in succ.items():
        if len(nexts) < 2:
            continue
        branches = []
        for start in nexts:
            branch, at = [], start
            while len(branch) < limit:
                branch.append(at)
                if len(succ[at]) != 1 or len(pred[at]) != 1:
                    break
                at = succ[at][0]
                if len(pred[at]) != 1:  # a join: the branch ends before it
                    break
            branches.append(branch)
        out.append((node, branches))
    return out


def report(text, limit=12):
    """The printed analysis as a list of lines."""
    names, succ, pred = parse(text)
    edges = sum(len(v) for v in succ.values())
    found = forks(succ, pred, limit)
    roots = [n for n in names if not pred[n]]
    lines = [f"{len(names)} nodes, {edges} edges, {len(roots)} root(s), {len(found)} fork(s)"]
    if not found and len(roots) <= 1:
        lines.append("a chain: no two nodes may run side by side")
    for node, branches in found:
        lines.append(f"fork after {names[node]} ({node}): {len(branches)} branches")
        for k, branch in enumerate(branches):
            lines.append(f"  branch {k}: " + " -> ".join(names[n] for n in branch))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dot", help="the graph's debug dump (Graphviz)")
    parser.add_argument("--limit", type=int, default=12, help="nodes printed per branch (default 12)")
    args = parser.parse_args(argv)
    if args.limit < 1:
        parser.error(f"--limit must be at least 1, got {args.limit}")
    with open(args.dot, encoding="utf-8", errors="replace") as f:
        text = f.read()
    print("\n".join(report(text, args.limit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
