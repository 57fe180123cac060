#!/usr/bin/env bash
# Mutation testing of FlatEP's test suite (not in CI: it rebuilds once per mutant and takes tens of minutes).
#
# Each mutant below is one plausible bug, given as (file, exact original text, replacement): one line each, but for
# M19 (three lines: the order of a chain has no one-line change). The script
# copies the tree to a work folder (never touching the working tree), configures one CPU-only build there
# (-DFLATEP_CUDA=OFF) that every mutant reuses incrementally, checks that the unmutated copy passes, then per mutant:
# patches the copy, builds, runs the tests that cover the mutated area (ctest -R ... and pytest files) and, only when
# those pass, the whole suite (ctest and pytest); then restores the file. A mutant is caught when a test fails (or the
# run hangs past its time limit), survived when everything passes. The score is caught / (caught + survived); a
# mutant that does not apply or does not build is reported and left out of the score.
#
#   scripts/mutants.sh                       the committed tree (HEAD), every mutant; --rev REV: another commit
#   scripts/mutants.sh --overlay tests/python/test_new.py,tests/unit/host/test_new.cpp
#                                            HEAD with these files taken from the working tree (try new tests before
#                                            committing them)
#   scripts/mutants.sh --from-worktree       the working tree as it is (tracked and untracked, not ignored)
#   scripts/mutants.sh --only M04,M07        some mutants;  --list  print the mutants;  --work DIR (default
#                                            /tmp/flatep-mutants);  --no-baseline  skip the unmutated run
#   scripts/mutants.sh --ctest 'OrderedSums' --pytest tests/python/test_autograd_paths.py
#                                            run only these tests against every mutant (which tests kill which)
#
# Python tests: /usr/bin/python3 (Debian's, with torch) over PYTHONPATH=<copy>/python:<build>/python. The install and
# dependency-check tests (test_install*.py, test_check_deps.py) test packaging, not the library, and are left out.
#
# Scores (issue 23): at f2ea609, 19/19 caught. At 939716f, before issue 23's tests, 15/19: M01, M02, M03 (the three
# survivors the issue reported) and M09 survived.
# Survivors accepted: none. A mutant that survives is a missing test unless it is equivalent (no input can tell it
# apart); such a mutant would be listed here with the reason it is accepted.
set -euo pipefail
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
exec /usr/bin/python3 - "$ROOT" "$@" <<'PYTHON'
import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
import time

root = sys.argv[1]
parser = argparse.ArgumentParser(prog="scripts/mutants.sh")
source = parser.add_mutually_exclusive_group()
source.add_argument("--from-worktree", action="store_true")
source.add_argument("--overlay", default="")
parser.add_argument("--rev", default="HEAD")
parser.add_argument("--only", default="")
parser.add_argument("--list", action="store_true")
parser.add_argument("--work", default="/tmp/flatep-mutants")
parser.add_argument("--no-baseline", action="store_true")
parser.add_argument("--ctest", default=None, help="run only the ctest tests matching this regex")
parser.add_argument("--pytest", default=None, help="run only these pytest files / node ids (comma-separated)")
args = parser.parse_args(sys.argv[2:])

# Tests that cover an area: (ctest regex, pytest files). A mutant runs its area's tests first, the rest only if
# those pass.
HOST = "DataPlane|Buffer|ExpertPools|OrderedSums|EntryValues|ExpertIdBoundary|CombineGrad|PlanGeneration|BadInput"
AREAS = {
    "planner": ("^Planner|^FuzzRegression", []),
    "host": (HOST, []),
    "layout": ("^Config|^Layout|BadInput|DataPlane", []),
    "runtime": (HOST, ["tests/python/test_buffer.py"]),
    "transport": ("HostBarrier|LocalHost|BufferErrors", []),
    "python": ("", ["tests/python/test_autograd_paths.py", "tests/python/test_buffer.py",
                      "tests/python/test_contract_edges.py"]),
}

# (id, area, file, original text (exactly once in the file), replacement, the bug)
MUTANTS = [
    ("M01", "planner", "src/planner/planner_core.hpp",
     "(best < 0 || c - w.target[r] > c - w.target[best])", "(best < 0 || c - w.target[r] >= c - w.target[best])",
     "slack-mode targets: ties in free room go to the higher rank"),
    ("M02", "host", "src/host/grad_reduce.cpp",
     "for (int d = 0; d < a.num_ranks; ++d) {", "for (int d = a.num_ranks - 1; d >= 0; --d) {",
     "reduce_grad adds the replicas in descending rank order"),
    ("M03", "python", "python/flatep/autograd.py",
     "want_y, want_weights = ctx.needs_input_grad[2], ctx.needs_input_grad[3]",
     "want_y, want_weights = ctx.needs_input_grad[3], ctx.needs_input_grad[2]",
     "combine backward: needs_input_grad of y and weights swapped"),
    ("M04", "host", "src/host/combine.cpp",
     "for (int d = 0; d < l.num_ranks; ++d) {", "for (int d = l.num_ranks - 1; d >= 0; --d) {",
     "combine adds the destination partials in descending rank order"),
    ("M05", "planner", "src/planner/planner.cpp",
     "for (int64_t i = 0; i < num_entries; ++i) {", "for (int64_t i = num_entries - 1; i >= 0; --i) {",
     "routing numbers a source's entries in reverse (token, k) order: rows inside a group reversed"),
    ("M06", "host", "src/host/entry_values.cpp",
     "reinterpret_cast<const float*>(a.peers[d] + sym.recv_w_offset)",
     "reinterpret_cast<const float*>(a.peers[a.rank] + sym.recv_w_offset)",
     "entry_values reads every entry's row on its own rank instead of the destination"),
    ("M07", "planner", "src/planner/planner_core.hpp",
     "            if (k > best) {", "            if (k > best || (k != 0 && k == best)) {",
     "SerialExec::arg_max breaks ties toward the higher index"),
    ("M08", "layout", "src/layout/config.cpp",
     "align >= 1 && align <= kMaxAlign", "align >= 1 && align < kMaxAlign",
     "config rejects align = 4096, its documented limit"),
    ("M09", "layout", "src/layout/config.cpp",
     "return int64_t(std::ceil(c.capacity_factor * double(sk)));",
     "return int64_t(std::floor(c.capacity_factor * double(sk)));",
     "slack capacity rounded down instead of up"),
    ("M10", "layout", "src/layout/layout.hpp",
     "s.recv_w_offset = at;\n    at = SymmetricLayout::align_up(at + int64_t(l.num_recv_rows) * 4);",
     "s.recv_w_offset = at;\n    at = SymmetricLayout::align_up(at + int64_t(l.num_recv_rows) * 2);",
     "symmetric recv_w region sized for bf16, overlapping the next region"),
    ("M11", "host", "src/host/dispatch.cpp",
     "for (int32_t r = group.real_end; r < group.padded_end; ++r) {",
     "for (int32_t r = group.real_end + 1; r < group.padded_end; ++r) {",
     "dispatch leaves the first padding row of every group unzeroed"),
    ("M12", "host", "src/host/grad_reduce.cpp",
     "if (a.slot_expert[a.rank * epn + j] >= 0) std::memset", "if (a.slot_expert[a.rank * epn + j] > 0) std::memset",
     "reduce_grad does not zero a consumed slot that holds expert 0"),
    ("M13", "host", "src/host/plan_op.cpp",
     "if (expert < 0 || expert >= E) {", "if (expert < 0 || expert > E) {",
     "the histogram takes expert id E as valid"),
    ("M14", "runtime", "src/runtime/expert_pools.cpp",
     "args.expert_bytes = projections_[p].elems() * 2;", "args.expert_bytes = projections_[p].elems();",
     "prefetch copies half of each expert (elements, not bytes)"),
    ("M15", "runtime", "src/runtime/buffer.cpp",
     "data->generation = ++generation_;", "data->generation = generation_++;",
     "the first plan gets generation 0 (unstamped): its step is never checked"),
    ("M16", "python", "python/flatep/autograd.py",
     "if ctx.has_weights and ctx.needs_input_grad[3]:", "if ctx.has_weights and ctx.needs_input_grad[2]:",
     "dispatch backward computes the weights' gradient only when x needs one"),
    ("M17", "python", "python/flatep/nn.py",
     "x_leaf = recv_x.detach().requires_grad_(ctx.needs_input_grad[2])",
     "x_leaf = recv_x.detach().requires_grad_(False)",
     "the MoE layer drops the gradient through the expert FFN into the receive rows"),
    ("M18", "transport", "src/sync/barrier_host.cpp",
     "if (now - start_s > sync.timeout_s) {", "if (now - start_s > 10 * sync.timeout_s) {",
     "the host barrier waits ten times its timeout (and still reports the timeout it was given)"),
    # Not one line (the order of a chain has no one-line change): the chain's terms summed in descending k.
    ("M19", "host", "src/host/combine.cpp",
     "for (int32_t r = h; r >= 0; r = p.row_next[r]) {",
     "std::vector<int32_t> chain;\n"
     "            for (int32_t r = h; r >= 0; r = p.row_next[r]) chain.insert(chain.begin(), r);\n"
     "            for (int32_t r : chain) {",
     "combine sums a chain's terms in descending k (three lines)"),
]

if args.list:
    for mid, area, path, _, _, bug in MUTANTS:
        print(f"{mid}  {area:8s} {path:32s} {bug}")
    sys.exit(0)
only = {m for m in args.only.split(",") if m}
mutants = [m for m in MUTANTS if not only or m[0] in only]

work = os.path.abspath(args.work)
tree, build = os.path.join(work, "tree"), os.path.join(work, "build")
IGNORED_PYTEST = ["--ignore-glob=tests/python/test_install*.py", "--ignore=tests/python/test_check_deps.py"]


def log(text):
    print(text, flush=True)


def git(*argv, binary=False):
    out = subprocess.run(["git", "-C", root, *argv], check=True, capture_output=True).stdout
    return out if binary else out.decode()


def worktree_files():
    """{path: bytes} of the working tree's tracked and untracked (not ignored) files that exist."""
    names = git("ls-files", "-co", "--exclude-standard", "-z").split("\0")
    files = {}
    for name in names:
        if not name:
            continue
        full = os.path.join(root, name)
        if os.path.isfile(full) and not os.path.islink(full):
            with open(full, "rb") as f:
                files[name] = f.read()
    return files


def rev_files():
    files = {}
    with tarfile.open(fileobj=io.BytesIO(git("archive", args.rev, binary=True))) as tar:
        for member in tar:
            if member.isfile():
                files[member.name] = tar.extractfile(member).read()
    return files


def sync_tree(files):
    """Makes `tree` hold exactly `files`, rewriting only what differs (unchanged files keep their mtimes, so the
    build stays incremental)."""
    for name, data in files.items():
        path = os.path.join(tree, name)
        try:
            with open(path, "rb") as f:
                if f.read() == data:
                    continue
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    for dirpath, _, names in os.walk(tree):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), tree)
            if rel not in files and "__pycache__" not in rel:
                os.remove(os.path.join(dirpath, n))


def run(cmd, timeout, env=None):
    """(passed, tail of the output); a run past `timeout` counts as failed (a hang is a caught bug)."""
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout} s: {' '.join(cmd)}"
    return p.returncode == 0, p.stdout.decode(errors="replace")[-3000:]


def build_tree():
    return run(["cmake", "--build", build, "-j2"], timeout=3600)


PY_ENV = dict(os.environ, PYTHONPATH=f"{tree}/python:{build}/python")
PY_ENV.pop("FLATEP_BUILD_DIR", None)


def ctest(regex=None):
    cmd = ["ctest", "--test-dir", build, "-j2", "--stop-on-failure", "--output-on-failure"]
    return run(cmd + (["-R", regex] if regex else []), timeout=1200)


def pytest(files):
    files = [f for f in files if os.path.exists(os.path.join(tree, f.split("::")[0]))]  # absent at older commits
    if not files:
        return True, ""
    cmd = ["/usr/bin/python3", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *IGNORED_PYTEST, *files]
    return run(cmd, timeout=1200, env=PY_ENV)


def first_failures(out):
    """The failed tests a ctest or pytest output names (ctest: 'NN - Name (Failed)', pytest: 'FAILED path::test')."""
    names = re.findall(r"^\s*\d+ - (\S+) \((?:Failed|Timeout|SEGFAULT|Subprocess aborted|Exception)\)", out, re.M)
    names += [m.split("::", 1)[-1] for m in re.findall(r"^FAILED (\S+)", out, re.M)]
    return ", ".join(names[:3]) or out.strip().splitlines()[-1][:160] if out.strip() else ""


def failing_run(area):
    """(the first run that fails and the tests it names, its output); ('', '') when all pass. The area's tests
    first, then the whole suite (or only --ctest / --pytest when given)."""
    if args.ctest is not None or args.pytest is not None:
        runs = [("ctest", args.ctest)] if args.ctest else []
        runs += [("pytest", args.pytest.split(","))] if args.pytest else []
    else:
        regex, files = AREAS[area] if area else (None, [])
        runs = ([("ctest", regex)] if regex else []) + ([("pytest", files)] if files else [])
        runs += [("ctest", None), ("pytest", ["tests/python"])]
    for kind, what in runs:
        ok, out = ctest(what) if kind == "ctest" else pytest(what)
        if not ok:
            label = f"ctest -R '{what}'" if kind == "ctest" and what else ("ctest (all)" if kind == "ctest" else
                                                                          "pytest " + " ".join(what))
            return f"{label}: {first_failures(out)}", out
    return "", ""


# ---- the copy, its build, the baseline ----
if args.from_worktree:
    files = worktree_files()
else:
    files = rev_files()
    for name in filter(None, args.overlay.split(",")):
        with open(os.path.join(root, name), "rb") as f:
            files[name] = f.read()
os.makedirs(tree, exist_ok=True)
sync_tree(files)
log(f"copy: {tree} ({len(files)} files); build: {build}")

problems = []
for mid, _, path, old, _, _ in mutants:
    count = files.get(path, b"").decode().count(old)
    if count != 1:
        problems.append(f"{mid}: the original text occurs {count} times in {path} (the code moved: update the mutant)")
for p in problems:
    log(p)
skip = {p.split(":")[0] for p in problems}

if not os.path.exists(os.path.join(build, "build.ninja")):
    ok, out = run(["cmake", "-S", tree, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                   "-DFLATEP_CUDA=OFF", "-DPython_EXECUTABLE=/usr/bin/python3"], timeout=600)
    if not ok:
        sys.exit("configure failed:\n" + out)
start = time.time()
ok, out = build_tree()
if not ok:
    sys.exit("the unmutated copy does not build:\n" + out)
if not args.no_baseline:
    failed, out = failing_run(None)
    if failed:
        sys.exit(f"the unmutated copy fails {failed}; fix that first:\n{out}")
    log(f"baseline: builds and passes ({time.time() - start:.0f} s)")

# ---- the mutants ----
results = []
for mid, area, path, old, new, bug in mutants:
    if mid in skip:
        results.append((mid, "not applied", bug, ""))
        continue
    full = os.path.join(tree, path)
    original = files[path]
    t0 = time.time()
    with open(full, "wb") as f:
        f.write(original.decode().replace(old, new).encode())
    try:
        ok, out = build_tree()
        if not ok:
            verdict, by = "build error", out.strip().splitlines()[-1] if out.strip() else ""
        else:
            failed, _ = failing_run(area)
            verdict, by = ("caught", failed) if failed else ("SURVIVED", "")
    finally:
        with open(full, "wb") as f:
            f.write(original)
    results.append((mid, verdict, bug, by))
    log(f"{mid} {verdict:9s} {bug}" + (f"  [by {by}]" if by else "") + f"  ({time.time() - t0:.0f} s)")

# ---- score ----
caught = sum(1 for r in results if r[1] == "caught")
survived = [r for r in results if r[1] == "SURVIVED"]
scored = caught + len(survived)
log("")
for mid, verdict, bug, by in results:
    log(f"  {mid}  {verdict:11s} {bug}" + (f"  [{by}]" if by else ""))
log(f"score: {caught}/{scored} caught" + (f" ({100.0 * caught / scored:.0f}%)" if scored else ""))
if survived:
    log("survivors: " + ", ".join(r[0] for r in survived))
sys.exit(0)
PYTHON
