"""The README's install route, run as its install section writes it, on a copy of this tree in a clean virtual
environment: Debian's packages, `python3 -m venv --system-site-packages`, `pip install --no-build-isolation .`, then
`import flatep` from the venv, examples/train_moe.py's two-rank training and the quick start
(examples/quickstart.py) on the CPU backend.

pip runs with PIP_NO_INDEX=1, so the route is shown to need no package index (Debian's registry is the only one
FlatEP relies on), and FLATEP_CMAKE_ARGS=-DFLATEP_CUDA=OFF (the CUDA kernels are the main build's business; here
they would only add nvcc's minutes). About 2 minutes on 2 cores.

Reproduce: /usr/bin/python3 -m pytest -q tests/python/test_install_venv.py
"""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The install section's commands, verbatim, in order (the test fails when the README stops showing one of them).
README_COMMANDS = [
    "scripts/setup.sh --packages-only",
    "/usr/bin/python3 -m venv --system-site-packages .venv",
    ".venv/bin/pip install --no-build-isolation .",
    ".venv/bin/python examples/train_moe.py --ranks 2 --steps 20",
    ".venv/bin/python examples/quickstart.py",  # the README's quick start, in the venv
]


def copy_tree(dst):
    """The working tree as a fresh clone of it would hold it: tracked and untracked, not ignored files (no build
    directories, no venv)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in listed:
        src = os.path.join(ROOT, rel)
        if not rel or rel.split("/")[0] == ".venv" or not os.path.isfile(src):
            continue  # a deleted tracked file, or a venv of the README's route made in this tree
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))


def run(cmd, cwd, env, timeout=600):
    proc = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"`{cmd}` in {cwd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _debian_12():
    try:
        with open("/etc/debian_version") as f:
            return f.read().startswith("12")
    except OSError:
        return False


# The route is Debian 12's (apt, Debian's python3): elsewhere, e.g. the GPU machine's image, it does not apply.
@pytest.mark.skipif(not _debian_12() or shutil.which("dpkg-query") is None, reason="the README's route is Debian 12's")
def test_readme_install_route_in_a_clean_venv(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    missing = [c for c in README_COMMANDS if c not in readme]
    assert not missing, f"README.md no longer shows {missing}: keep its install section and this test in step"

    src = tmp_path / "flatep"
    copy_tree(src)
    # A clean environment: nothing from this process's PYTHONPATH (which may hold a build's flatep) or user site.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PYTHONNOUSERSITE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1",
               FLATEP_CMAKE_ARGS="-DFLATEP_CUDA=OFF")
    setup, venv, install, example, quickstart = README_COMMANDS
    run(setup, src, env)
    run(venv, src, env)
    run(install, src, env)

    # Imported from outside the source tree, flatep (package and extension) comes from the venv's site-packages.
    site = run(".venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'", src, env).strip()
    where = run(f"{src}/.venv/bin/python -c 'import flatep; print(flatep.__file__); print(flatep._C.__file__)'",
                tmp_path, env).split()
    assert len(where) == 2 and all(p.startswith(site + os.sep) for p in where), (site, where)

    out = run(example, src, env).splitlines()
    # Exact mode: S=64 tokens * K=2 rows on each of the two ranks, every step.
    assert sum(l.startswith("step ") and "rank loads [128, 128]" in l for l in out) == 20, "\n".join(out)
    assert out[-1].endswith(": OK"), "\n".join(out)

    out = run(quickstart, src, env).splitlines()
    assert out[-1].startswith("quickstart: OK"), "\n".join(out)
