"""scripts/check_deps.py passes on this tree, and fails, naming the module, the importing file and the package, when
scripts/setup.sh lacks a package or a module has no entry in its table.

Reproduce: /usr/bin/python3 -m pytest -q tests/python/test_check_deps.py
"""

import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "check_deps.py")


def check_deps(*args):
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_real_tree_passes():
    rc, out = check_deps()
    assert rc == 0, out
    assert "matplotlib" in out and "torch" in out, out


def test_setup_without_matplotlib_fails_naming_the_importer(tmp_path):
    with open(os.path.join(ROOT, "scripts", "setup.sh")) as f:
        setup = f.read()
    assert re.search(r"\bpython3-matplotlib\b", setup)
    stripped = tmp_path / "setup.sh"
    stripped.write_text(re.sub(r"\bpython3-matplotlib\b", "", setup))
    rc, out = check_deps("--setup-sh", str(stripped))
    assert rc == 1, out
    lines = [l for l in out.splitlines() if "imports matplotlib" in l]
    assert lines, out
    assert all("does not install python3-matplotlib" in l for l in lines), out
    assert any(l.startswith("check_deps: benchmarks/layer/moe_layer_plot.py:") for l in lines), out
    problems = [l for l in out.splitlines() if not l.startswith("check_deps: note:")]
    assert not any("torch" in l for l in problems), out  # only the package taken out is reported


def test_fake_tree_unknown_and_missing_imports(tmp_path):
    write(tmp_path / "scripts" / "setup.sh", "packages=(python3 python3-torch  # a comment python3-numpy\n"
                                             "    python3-pytest)\npackages+=(python3-scipy)\n")
    write(tmp_path / "tools" / "helper.py", "X = 1\n")
    write(tmp_path / "tools" / "main.py", "import os, json\nimport helper\nimport torch.nn\nfrom scipy import sparse\n"
                                          "from . import sibling\n\n\nimport frobnicate.sub\n")
    write(tmp_path / "tests" / "test_x.py", "import pytest\nimport numpy as np\n")
    write(tmp_path / "python" / "pkg" / "__init__.py", "")
    write(tmp_path / "python" / "pkg" / "mod.py", "import pkg.mod\ntry:\n    import matplotlib\nexcept ImportError:\n"
                                                  "    matplotlib = None\n")
    rc, out = check_deps("--root", str(tmp_path))
    assert rc == 1, out
    problems = [l for l in out.splitlines() if not l.startswith("check_deps: note:")]
    assert problems == [
        "check_deps: tests/test_x.py:2: imports numpy, but scripts/setup.sh does not install python3-numpy",
        "check_deps: tools/main.py:8: imports frobnicate, which has no Debian package in DEBIAN_PACKAGES of "
        "scripts/check_deps.py: add it there (and to scripts/setup.sh)",
        "check_deps: 2 problem(s)",
    ], out
    # The optional import (try/except ImportError) of a package setup.sh lacks is a note, not a failure.
    assert ("check_deps: note: python/pkg/mod.py:3: imports matplotlib (optional), but scripts/setup.sh does not "
            "install python3-matplotlib") in out, out


def test_optional_import_must_still_be_known(tmp_path):
    write(tmp_path / "scripts" / "setup.sh", "packages=(python3)\n")
    write(tmp_path / "examples" / "a.py", "try:\n    import frobnicate\nexcept (OSError, ModuleNotFoundError):\n"
                                          "    pass\n")
    rc, out = check_deps("--root", str(tmp_path))
    assert rc == 1, out
    assert "check_deps: examples/a.py:2: imports frobnicate (optional), which has no Debian package" in out, out

    write(tmp_path / "examples" / "a.py", "import json\n")
    rc, out = check_deps("--root", str(tmp_path))
    assert rc == 0, out


def test_bundled_module_only_as_an_optional_import(tmp_path):
    # triton has no Debian package (CUDA torch wheels bring it): fine behind try/except ImportError, an error bare.
    write(tmp_path / "scripts" / "setup.sh", "packages=(python3)\n")
    write(tmp_path / "python" / "m.py", "try:\n    import triton\nexcept ImportError:\n    triton = None\n")
    rc, out = check_deps("--root", str(tmp_path))
    assert rc == 0, out
    assert "check_deps: note: python/m.py:2: imports triton (optional): CUDA builds of torch" in out, out
    write(tmp_path / "python" / "m.py", "import triton\n")
    rc, out = check_deps("--root", str(tmp_path))
    assert rc == 1, out
    assert "check_deps: python/m.py:1: imports triton, which has no Debian package" in out, out
