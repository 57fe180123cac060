#!/usr/bin/env python3
"""Checks that scripts/setup.sh installs the Debian package of every third-party module the Python code imports.

Reads every .py file under python/, tests/, benchmarks/, examples/, tools/ and scripts/ (and the root's setup.py),
collects the top-level modules they import (ast), drops the standard library (sys.stdlib_module_names) and the
project's own modules (flatep, and any module that is a .py file or package of the scanned tree, such as a benchmark
helper imported by its sibling script), maps each remaining module to its Debian package through DEBIAN_PACKAGES,
and compares with the `packages=(...)` lists of scripts/setup.sh. Each problem is one line naming the importing
file and line, the module and the package setup.sh lacks (or, for a module with no entry in DEBIAN_PACKAGES, saying
to add one); then the exit status is 1:

    check_deps: benchmarks/layer/moe_layer_plot.py:34: imports matplotlib, but scripts/setup.sh does not install ...

An import inside `try: ... except ImportError:` is optional: its module must still be in DEBIAN_PACKAGES, but a
package that setup.sh does not install is only a note. Standard library only; run with Debian's python3:

    /usr/bin/python3 scripts/check_deps.py [--setup-sh scripts/setup.sh] [--root .]
"""

import argparse
import ast
import os
import re
import sys

# Top-level module -> the Debian 12 package that provides it. A new third-party import needs a line here.
DEBIAN_PACKAGES = {
    "coverage": "python3-coverage",
    "hypothesis": "python3-hypothesis",
    "matplotlib": "python3-matplotlib",
    "numpy": "python3-numpy",
    "pybind11": "python3-pybind11",
    "pytest": "python3-pytest",
    "scipy": "python3-scipy",
    "setuptools": "python3-setuptools",
    "torch": "python3-torch",
}
# Modules that come with a package above on some platforms and have no Debian package of their own: allowed only as
# optional imports (try/except ImportError, with a fallback), never as a hard dependency.
BUNDLED_OPTIONAL = {
    "triton": "CUDA builds of torch (pip wheels) ship it; nn.py's FP8 dequantisation falls back to torch ops",
}
FIRST_PARTY = {"flatep"}  # the package this repository builds (its extension flatep._C is compiled, not a file)
SCANNED_DIRS = ("python", "tests", "benchmarks", "examples", "tools", "scripts")
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def python_files(root):
    """Relative paths of the scanned .py files, sorted."""
    found = [name for name in os.listdir(root) if name.endswith(".py") and os.path.isfile(os.path.join(root, name))]
    for top in SCANNED_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            found += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    return sorted(found)


def local_modules(root, files):
    """Names importable from the tree itself: every scanned module file and every package directory above one."""
    names = set()
    for rel in files:
        parts = rel.split(os.sep)
        names.add(os.path.splitext(parts[-1])[0])
        for i in range(1, len(parts)):
            if os.path.isfile(os.path.join(root, *parts[:i], "__init__.py")):
                names.add(parts[i - 1])
    return names


def catches_import_error(handler):
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in IMPORT_ERRORS for k in kinds)


def imports(tree):
    """(module, line, optional) for every absolute import; optional: inside the body of a try that catches
    ImportError."""
    found = []

    def visit(node, optional):
        if isinstance(node, ast.Import):
            found.extend((alias.name.split(".")[0], node.lineno, optional) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno, optional))
        if isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            guarded = optional or any(catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, guarded)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, optional)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(tree, False)
    return found


def setup_packages(setup_sh):
    """Every word of the `packages=(...)` and `packages+=(...)` arrays of setup.sh (comments dropped)."""
    with open(setup_sh) as f:
        text = "\n".join(line.split("#", 1)[0] for line in f.read().splitlines())
    arrays = re.findall(r"\bpackages\+?=\(([^)]*)\)", text)
    return {word for body in arrays for word in body.split()}


def check(root, setup_sh):
    """(problems, notes, summary): one line each."""
    root = os.path.abspath(root)
    setup_rel = os.path.relpath(os.path.abspath(setup_sh), root)
    if setup_rel.startswith(os.pardir):
        setup_rel = setup_sh  # outside the tree: as given
    installed = setup_packages(setup_sh)
    if not installed:
        return [f"check_deps: {setup_rel}: found no `packages=(...)` list to read"], [], ""
    files = python_files(root)
    own = FIRST_PARTY | local_modules(root, files)
    problems, notes, seen, used = [], [], set(), set()
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            source = f.read()
        try:
            tree = ast.parse(source, filename=rel)
        except SyntaxError as e:
            problems.append(f"check_deps: {rel}:{e.lineno}: cannot parse ({e.msg}), so its imports are unchecked")
            continue
        for module, line, optional in imports(tree):
            if module in sys.stdlib_module_names or module in own or (rel, module) in seen:
                continue
            seen.add((rel, module))  # one line per module and importing file (its first import)
            site = f"{rel}:{line}: imports {module}" + (" (optional)" if optional else "")
            package = DEBIAN_PACKAGES.get(module)
            if package is None and optional and module in BUNDLED_OPTIONAL:
                notes.append(f"check_deps: note: {site}: {BUNDLED_OPTIONAL[module]}")
                continue
            if package is None:
                problems.append(f"check_deps: {site}, which has no Debian package in DEBIAN_PACKAGES of "
                                f"scripts/check_deps.py: add it there (and to {setup_rel})")
            elif package not in installed:
                (notes if optional else problems).append(
                    f"check_deps: {'note: ' if optional else ''}{site}, but {setup_rel} does not install {package}")
            else:
                used.add(module)
    summary = (f"check_deps: {len(files)} files; every third-party import ({', '.join(sorted(used)) or 'none'}) "
               f"has its Debian package in {setup_rel}")
    return problems, notes, summary


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=os.path.dirname(here), help="the tree to scan (default: this repository)")
    p.add_argument("--setup-sh", help="the setup script whose package list is read (default: ROOT/scripts/setup.sh)")
    args = p.parse_args(argv)
    if not hasattr(sys, "stdlib_module_names"):
        sys.exit(f"check_deps: needs Python >= 3.10 (sys.stdlib_module_names); this is {sys.version.split()[0]}")
    problems, notes, summary = check(args.root, args.setup_sh or os.path.join(args.root, "scripts", "setup.sh"))
    for line in notes + problems:
        print(line)
    if problems:
        print(f"check_deps: {len(problems)} problem(s)")
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
