"""scripts/graph_forks.py on small graphs in the layout of CUDA's debug dump: a chain has no fork; a fork names each
branch's kernels up to the join; bad arguments fail with the argument named.

Reproduce: /usr/bin/python3 -m pytest -q tests/python/test_graph_forks.py
"""

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "graph_forks.py")


def node(i, kernel):
    """A node as the dump writes it: a kernel (name) or, for "MEMSET", a memset node."""
    if kernel == "MEMSET":
        return (f'"graph_0_node_{i}"[style="solid" shape="record" label="{{MEMSET\\n| {{ID | {i} | {i}}}\n'
                f'| {{dst | 0x7f}}}}"];\n')
    return (f'"graph_0_node_{i}"[style="solid" shape="record" label="{{KERNEL\\n| {{ID | {i} | {i}}}\n'
            f'| {{{kernel} | {kernel}}}\n}}"];\n')


def edge(a, b):
    return f'"graph_0_node_{a}" -> "graph_0_node_{b}" [style="solid" taillabel="" headlabel=""];\n'


def dot(nodes, edges):
    body = "".join(node(i, k) for i, k in enumerate(nodes)) + "".join(edge(a, b) for a, b in edges)
    return 'digraph dot {\nsubgraph cluster_0 {\nlabel="graph_0" graph[style="dashed"];\n' + body + "}\n}\n"


def run(tmp_path, text, *args):
    path = tmp_path / "g.dot"
    path.write_text(text)
    proc = subprocess.run([sys.executable, SCRIPT, str(path), *args], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


def test_chain_has_no_fork(tmp_path):
    rc, lines, err = run(tmp_path, dot(["_Z1av", "_Z1bv", "_Z1cv", "_Z1dv"], [(0, 1), (1, 2), (2, 3)]))
    assert rc == 0, err
    assert lines == ["4 nodes, 3 edges, 1 root(s), 0 fork(s)", "a chain: no two nodes may run side by side"]


def test_fork_names_each_branch_up_to_the_join(tmp_path):
    # 0 forks into 1 and 2 -> 4; both join at 3, which runs on to 5.
    nodes = ["_Z4rootv", "_Z4leftv", "_Z6right1v", "_Z4joinv", "_Z6right2v", "_Z4tailv"]
    rc, lines, err = run(tmp_path, dot(nodes, [(0, 1), (0, 2), (1, 3), (2, 4), (4, 3), (3, 5)]))
    assert rc == 0, err
    assert lines == [
        "6 nodes, 6 edges, 1 root(s), 1 fork(s)",
        "fork after _Z4rootv (graph_0_node_0): 2 branches",
        "  branch 0: _Z4leftv",
        "  branch 1: _Z6right1v -> _Z6right2v",
    ]


def test_limit_cuts_a_long_branch(tmp_path):
    nodes = ["_Z1rv"] + [f"_Z1k{i}v" for i in range(5)] + ["_Z1sv"]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (0, 6)]
    rc, lines, err = run(tmp_path, dot(nodes, edges), "--limit", "2")
    assert rc == 0, err
    assert lines[2:] == ["  branch 0: _Z1k0v -> _Z1k1v", "  branch 1: _Z1sv"]


def test_bad_limit_is_named(tmp_path):
    rc, _, err = run(tmp_path, dot(["_Z1av"], []), "--limit", "0")
    assert rc != 0
    assert "--limit must be at least 1, got 0" in err


def test_unmangled_kernel_and_memset_names(tmp_path):
    text = dot(["_Z1av", "sm90_xmma_gemm_bf16bf16_bf16f32", "MEMSET"], [(0, 1), (0, 2)])
    rc, lines, err = run(tmp_path, text)
    assert rc == 0, err
    assert lines[2:] == ["  branch 0: sm90_xmma_gemm_bf16bf16_bf16f32", "  branch 1: MEMSET"]
