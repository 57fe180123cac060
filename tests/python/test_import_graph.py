"""The flatep package's modules import one another without a cycle (issue 45): the graph of its relative (and
absolute flatep.*) imports, function-level imports included, read from the sources with ast, is a DAG.

An edge M -> T for every `from .x import ...` / `from . import x` / `import flatep.x` anywhere in M (module level or
inside a function: an import at call time is still a dependency), and to each package __init__ that the import runs
on the way that is not one of M's own packages. `from . import name` of a name that is no module is an edge to the
package's __init__ (the name comes from it). The compiled extension flatep._C imports nothing of the package: a leaf.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_import_graph.py
"""

import ast
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PACKAGE_DIR = os.path.join(ROOT, "python", "flatep")
EXTENSIONS = {"flatep._C"}  # built by CMake into build/python/flatep, no Python source


def modules_of(package_dir, package="flatep"):
    """{module name: (source path, is a package)} of every .py file under package_dir."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, package_dir)
        prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
        for name in sorted(filenames):
            if name.endswith(".py"):
                is_package = name == "__init__.py"
                found[prefix if is_package else f"{prefix}.{name[:-3]}"] = (os.path.join(dirpath, name), is_package)
    return found


def import_graph(package_dir, package="flatep", extensions=EXTENSIONS):
    """{module: set of modules of the package it imports} (see the module docstring)."""
    modules = modules_of(package_dir, package)
    known = set(modules) | set(extensions)
    graph = {m: set() for m in known}

    def ancestors(name):
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}

    for module, (path, is_package) in modules.items():
        own = ancestors(module) | ({module} if is_package else set())
        here = module if is_package else module.rsplit(".", 1)[0]  # the package a relative import starts from

        def add(target):
            if target not in known:
                return
            for t in ancestors(target) | {target}:
                if t in known and t not in own and t != module:
                    graph[module].add(t)

        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = ".".join(base[: len(base) - (node.level - 1)])
                elif node.module == package or (node.module or "").startswith(package + "."):
                    base = None
                else:
                    continue
                source = node.module if base is None else (f"{base}.{node.module}" if node.module else base)
                add(source)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in known:
                        add(sub)
                    elif source in own and source in modules and modules[source][1]:
                        graph[module].add(source)  # a name of one of M's own packages' __init__: M depends on it
    return graph


def find_cycle(graph):
    """One cycle of `graph` as [m0, m1, ..., m0], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_flatep_imports_form_a_dag():
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) >= 15, sorted(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in python/flatep: " + " -> ".join(cycle)


def test_the_layering_issue_45_asks_for():
    graph = import_graph(PACKAGE_DIR)
    # the expert FFN's arithmetic is below both of its users; nothing of the launch plumbing reaches up
    assert "flatep.ffn" in graph["flatep.ops"] and "flatep.ffn" in graph["flatep.nn"]
    assert "flatep.nn" not in graph["flatep.ops"]
    assert "flatep.virtual" not in graph["flatep.distributed"]
    assert "flatep.distributed" not in graph["flatep.virtual"]
    assert graph["flatep.launch"] <= {"flatep._tensors"}
    # the FFN reaches only what lies below it: the extension (its CUDA row kernels), the argument checks' text and
    # the stream plumbing (none of them imports anything of the package but _tensors)
    assert graph["flatep.ffn"] <= {"flatep._C", "flatep._tensors", "flatep.launch"}
    assert graph["flatep._bootstrap"] == set()


def _write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


@pytest.mark.parametrize("files, cycle", [
    # a function-level import closing the loop (ops <-> nn as it was)
    ({"__init__.py": "", "a.py": "from . import b\n", "b.py": "def f():\n    from .a import g\n"}, ["pkg.a", "pkg.b"]),
    # a name taken from the package's __init__, which imports the module
    ({"__init__.py": "from .a import X\n", "a.py": "from . import Y\n"}, ["pkg", "pkg.a"]),
    # through a subpackage's __init__ (run on the way to its module)
    ({"__init__.py": "", "a.py": "from .sub.c import Z\n", "sub/__init__.py": "from ..a import W\n",
      "sub/c.py": ""}, ["pkg.a", "pkg.sub"]),
    # absolute imports of the package count too
    ({"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "from pkg import a\n"}, ["pkg.a", "pkg.b"]),
])
def test_the_checker_finds_cycles(tmp_path, files, cycle):
    _write(str(tmp_path), files)
    graph = import_graph(str(tmp_path), "pkg", extensions=set())
    found = find_cycle(graph)
    assert found is not None and set(found) == set(cycle), found


def test_the_checker_passes_a_dag(tmp_path):
    _write(str(tmp_path), {"__init__.py": "from . import a, b\n", "a.py": "from . import b\nfrom .b import f\n",
                           "b.py": "def f():\n    from . import _ext\n"})
    graph = import_graph(str(tmp_path), "pkg", extensions={"pkg._ext"})
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg._ext"}
    assert find_cycle(graph) is None
