#!/usr/bin/env python3
"""The report of scripts/coverage_ci.sh: line and branch coverage of the host-compiled C++ (gcovr's JSON) and of
python/flatep (coverage.py's JSON), and the rule of docs/testing.md: every branch that no test takes is listed in
scripts/coverage_exclusions.txt with the reason it is not tested on the CPU.

C++ branches are gcov's branch outcomes, less those gcovr drops (--exclude-throw-branches,
--exclude-unreachable-branches) and those on a line whose source has no branch (no condition, loop, case, handler or
check macro): what remains there are exception edges of calls and destructors that gcov does not mark as throws. They
are counted and printed apart, never as covered.

The exclusions file holds blocks: a line "== <reason>" and under it the lines it covers, one per line as
"<path>: <source line>" (the line's text stripped of surrounding blanks, exactly as in the file). An entry stands
for every uncovered branch on every line of that file with that text (C++: gcovr's branch outcomes; Python:
coverage.py's missing arcs, counted at the line they leave), so an entry survives code moving up or down.
Blank lines and lines starting with '#' are comments.

Prints both summaries (lines and branches, and branches counting the listed ones as accounted for), the files with
the most uncovered branches, and then each uncovered branch that no entry lists ("path:line: text"; with --missed
every uncovered branch, in the exclusions file's format) and each entry that matches nothing (stale: the branch is
covered now or its line changed; a note, since some branches are taken only in some runs). Exit status 1 when an
uncovered branch is not listed.

    /usr/bin/python3 scripts/coverage_report.py --cpp cpp.json --python python.json \
        --exclusions scripts/coverage_exclusions.txt [--missed]
"""

import argparse
import collections
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

# A C++ line with a branch of its own: a condition, a loop, a case, a handler, or a check macro (an if inside).
SOURCE_BRANCH = re.compile(r"\b(if|for|while|switch|case|catch|do)\b|\?|&&|\|\||\bFLATEP_\w*CHECK\w*")


def load_exclusions(path):
    """{(path, text): reason} from the exclusions file (format in the module docstring)."""
    entries, reason = {}, None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            if line.startswith("== "):
                reason = line[3:].strip()
                continue
            where, sep, text = line.partition(": ")
            if not sep or reason is None or not text.strip():
                sys.exit(f"{path}:{number}: expected '== <reason>' or '<path>: <source line>' under one: {line!r}")
            entries[(where.strip(), text.strip())] = reason
    return entries


def source_lines(path, cache={}):
    if path not in cache:
        try:
            with open(path) as f:
                cache[path] = f.read().splitlines()
        except OSError:
            cache[path] = []
    return cache[path]


def line_text(path, number):
    lines = source_lines(path)
    return lines[number - 1].strip() if 0 < number <= len(lines) else ""


class Tally:
    def __init__(self, name):
        self.name = name
        self.lines = self.lines_hit = self.branches = self.branches_hit = self.listed = self.generated = 0
        self.by_lines = 0  # device arcs its coverage.py does not count as branches, taken by their lines
        self.per_file = collections.Counter()  # path -> uncovered branches
        self.uncovered = []  # (path, line, text, branches missed on it)

    def summary(self):
        def pct(a, b):
            return f"{100.0 * a / b:.1f}%" if b else "-"

        accounted = self.branches_hit + self.listed
        notes = (f" ({self.generated} more on lines without a branch in the source, compiler-generated, left "
                 "out)" if self.generated else "")
        if self.by_lines:
            notes += (f" ({self.by_lines} of them arcs the device's coverage.py does not count as branches, taken by "
                      "their two lines)")
        return (f"{self.name}: lines {self.lines_hit}/{self.lines} ({pct(self.lines_hit, self.lines)}), branches "
                f"{self.branches_hit}/{self.branches} ({pct(self.branches_hit, self.branches)}){notes}; with the "
                f"{self.listed} listed in the exclusions: {pct(accounted, self.branches)}")


def merge_into(lines, key, count, branches):
    """Adds one record of a line (a count and its branch counts) to lines[key], branch i to branch i."""
    old_count, old = lines.get(key, (0, []))
    merged = [(old[i] if i < len(old) else 0) + (branches[i] if i < len(branches) else 0)
              for i in range(max(len(old), len(branches)))]
    lines[key] = (old_count + count, merged)


def real_path(root, path):
    """A file's path under root, through links (headers compiled through the layers' include roots, links to src/)."""
    return os.path.relpath(os.path.realpath(os.path.join(root, path)), root)


def gcovr_lines(report, root):
    """{(path, line): (count, [branch counts])} as gcovr reports them (a template's branches once per instantiation,
    one after the other)."""
    lines = {}
    for f in report["files"]:
        path = real_path(root, f["file"])
        for line in f["lines"]:
            if not line.get("gcovr/noncode"):
                merge_into(lines, (path, line["line_number"]), line["count"], [b["count"] for b in line["branches"]])
    return lines


def gcov_lines(build_dir, root):
    """{(path, line): (count, [branch counts])} from gcov's own JSON (gcc's `gcov --json-format`) of every .gcda under
    build_dir, with a template's instantiations merged: a branch counts as taken when any instantiation took it.
    gcov gives a line of one function with that function's branches, and a line of several (the instantiations
    of a template in one object) with their branches one after the other; the latter are cut into blocks the size of
    the line's single-function records and added branch by branch, as are the records of every object. gcov's
    exception branches (throw) are dropped, as gcovr's --exclude-throw-branches does."""
    records = collections.defaultdict(list)  # (path, line) -> [(count, [branch counts], one function?)]
    with tempfile.TemporaryDirectory() as tmp:
        for number, (dirpath, _, names) in enumerate(os.walk(os.path.abspath(build_dir))):
            gcdas = [os.path.join(dirpath, n) for n in names if n.endswith(".gcda")]
            if not gcdas:
                continue
            out = os.path.join(tmp, str(number))  # one folder an object directory: no two outputs collide
            os.mkdir(out)
            subprocess.run(["gcov", "--json-format", "--branch-probabilities", "--branch-counts", "--preserve-paths",
                            "--object-directory", dirpath, *gcdas], cwd=out, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False)
        for dirpath, _, names in os.walk(tmp):
            for name in names:
                if not name.endswith(".gcov.json.gz"):
                    continue
                with gzip.open(os.path.join(dirpath, name)) as f:
                    report = json.load(f)
                cwd = report.get("current_working_directory", root)
                for f in report["files"]:
                    path = real_path(root, os.path.join(cwd, f["file"]))
                    if not path.startswith("src" + os.sep):
                        continue
                    for line in f["lines"]:
                        branches = [b["count"] for b in line["branches"] if not b.get("throw")]
                        records[(path, line["line_number"])].append((line["count"], branches, "function_name" in line))
    lines = {}
    for key, recs in records.items():
        single = [len(b) for _, b, one in recs if one and b] or [len(b) for _, b, _ in recs if b] or [0]
        n = min(single)
        for count, branches, _ in recs:
            blocks = [branches[i:i + n] for i in range(0, len(branches), n)] if n and len(branches) % n == 0 else \
                [branches]
            merge_into(lines, key, count, blocks[0] if blocks else [])
            for block in blocks[1:]:
                merge_into(lines, key, 0, block)
    return lines


def cpp_tally(lines, name):
    """Every line with code of src/; each of its branch outcomes counts once."""
    t = Tally(name)
    for (path, number), (count, branches) in sorted(lines.items()):
        if not path.startswith("src" + os.sep):
            continue
        t.lines += 1
        t.lines_hit += count > 0
        missed = sum(1 for c in branches if c == 0)
        if branches and not SOURCE_BRANCH.search(line_text(path, number).split("//")[0]):
            # gcov's branches of a line with no condition in the source: the exception edges of its calls and
            # destructors that gcov does not mark as throw branches (unwinding through a constructor, say).
            t.generated += len(branches)
            continue
        t.branches += len(branches)
        t.branches_hit += len(branches) - missed
        if missed:
            t.per_file[path] += missed
            t.uncovered.append((path, number, line_text(path, number), missed))
    return t


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def stamp(source, out, root):
    """A coverage.py JSON report of another machine (the device run), each file's executed lines and branches with the
    sha256 of the source they were measured on: merged later only where the source is still the same."""
    with open(source) as f:
        report = json.load(f)
    files = {}
    for name, f in report["files"].items():
        path = os.path.relpath(os.path.abspath(name), root)
        files[path] = {"sha256": file_sha256(path), "executed_lines": f["executed_lines"],
                       "executed_branches": f.get("executed_branches", [])}
    meta = {k: report.get("meta", {}).get(k) for k in ("version", "timestamp")}
    with open(out, "w") as f:
        json.dump({"meta": meta, "files": files}, f, indent=0, sort_keys=True)
    print(f"coverage_report: {out}: {len(files)} files stamped")
    return 0


def merge_stamped(paths):
    """The union of stamped device reports (their lines and branches taken), per file and source sha256; a file
    measured on two different sources keeps the newer report's."""
    files, stamps = {}, []
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        stamps.append(str(report["meta"].get("timestamp")))
        for name, f in report["files"].items():
            old = files.get(name)
            if old is None or old["sha256"] != f["sha256"]:
                files[name] = {"sha256": f["sha256"], "executed_lines": set(f["executed_lines"]),
                               "executed_branches": {tuple(b) for b in f["executed_branches"]}}
            else:
                old["executed_lines"] |= set(f["executed_lines"])
                old["executed_branches"] |= {tuple(b) for b in f["executed_branches"]}
    return {"meta": {"timestamp": ", ".join(sorted(stamps))}, "files": files}


def _taken_by_lines(arc, sources, ran):
    """Whether the device run took `arc` (a, b), a branch arc of the CPU's report, where the device's coverage.py does
    not count line a as a branch at all: coverage.py 6 (Debian's) counts arcs 7 does not, such as a `with`
    statement's exit and a decorated def's. Then the arc counts as taken when the device ran line a and line b, the
    line the arc goes to: in structured code b is reached from a that way only. A branch line the device ran took one
    of its arcs there, so a line no taken arc starts from (not in `sources`) is not a branch to that coverage.py (a
    line that raised before its jump is the exception). An arc to the exit of a code object (b < 0) never counts this
    way: a generator left early and one run to its end both ran line a."""
    a, b = arc
    return b > 0 and a in ran and b in ran and a not in sources


def python_tally(report, root, device=None):
    """coverage.py JSON: statements, and branch arcs counted at the line they leave. device: a stamped report of the
    device run (stamp()); a file whose source is unchanged counts its lines and branches taken there as covered."""
    t = Tally("Python python/flatep (coverage.py)" + (", CPU suite and the device run" if device else ""))
    t.stale = []
    for name, f in report["files"].items():
        path = os.path.relpath(os.path.abspath(name), root)
        s = f["summary"]
        missing_lines = set(f.get("missing_lines", []))
        missing = [tuple(b) for b in f.get("missing_branches", [])]
        other = (device or {}).get(path)
        if other is not None and other["sha256"] != file_sha256(path):
            t.stale.append(path)
        elif other is not None:
            taken = {tuple(b) for b in other["executed_branches"]}
            ran = set(other["executed_lines"])
            sources = {a for a, _ in taken}
            missing_lines -= ran
            still = []
            for arc in missing:
                if arc in taken:
                    continue
                if _taken_by_lines(arc, sources, ran):
                    t.by_lines += 1
                else:
                    still.append(arc)
            missing = still
        t.lines += s["num_statements"]
        t.lines_hit += s["num_statements"] - len(missing_lines)
        t.branches += s.get("num_branches", 0)
        t.branches_hit += s.get("num_branches", 0) - len(missing)
        by_line = collections.Counter(src for src, _ in missing)
        for number, missed in sorted(by_line.items()):
            t.per_file[path] += missed
            t.uncovered.append((path, number, line_text(path, number), missed))
    return t


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stamp", help="stamp this coverage.py JSON (of the device run) into --out, and stop")
    parser.add_argument("--out", help="with --stamp: the stamped report")
    parser.add_argument("--cpp", help="gcovr's JSON")
    parser.add_argument("--build-dir", help="the build directory of the .gcda files")
    parser.add_argument("--python")
    parser.add_argument("--python-device", action="append", default=[], help="a stamped report of a device run "
                        "(scripts/device.sh with DEVICE_COVERAGE=1) to merge for the files whose source is unchanged "
                        "(repeatable)")
    parser.add_argument("--exclusions")
    parser.add_argument("--missed", action="store_true", help="print every uncovered branch")
    parser.add_argument("--top", type=int, default=12, help="files listed by uncovered branches")
    args = parser.parse_args()
    root = os.getcwd()
    if args.stamp:
        if not args.out:
            parser.error("--stamp needs --out")
        return stamp(args.stamp, args.out, root)
    for name in ("cpp", "build_dir", "python", "exclusions"):
        if getattr(args, name) is None:
            parser.error(f"--{name.replace('_', '-')} is required")
    exclusions = load_exclusions(args.exclusions)
    with open(args.cpp) as f:
        by_gcovr = cpp_tally(gcovr_lines(json.load(f), root), "C++ src/, gcovr's count")
    cpp = cpp_tally(gcov_lines(args.build_dir, root), "C++ src/ (gcov, template instantiations merged)")
    with open(args.python) as f:
        cpu_report = json.load(f)
    py = python_tally(cpu_report, root)
    py_all = None
    if args.python_device:
        device = merge_stamped(args.python_device)
        py_all = python_tally(cpu_report, root, device["files"])
    used, unlisted = set(), []
    for t in (cpp, py):
        for path, number, text, missed in t.uncovered:
            if (path, text) in exclusions:
                used.add((path, text))
                t.listed += missed
            else:
                unlisted.append((path, number, text, missed))
    print("coverage: " + by_gcovr.summary().split("; with")[0] + " (a template's branches once per instantiation)")
    for t in (cpp, py):
        print("coverage: " + t.summary())
        for path, missed in t.per_file.most_common(args.top):
            print(f"    {missed:4d} uncovered branches  {path}")
    if py_all is not None:
        py_all.listed = sum(m for p, _, text, m in py_all.uncovered if (p, text) in exclusions)
        print("coverage: " + py_all.summary() + f" (device runs of {device['meta']['timestamp']}; "
              f"{len(py_all.stale)} file(s) changed since, counted from the CPU suite alone"
              + (f": {', '.join(py_all.stale)}" if py_all.stale else "") + ")")
    if args.missed:
        print("every uncovered branch (exclusions file format; the count is of branch outcomes):")
        for t in (cpp, py):
            for path, number, text, missed in t.uncovered:
                mark = "listed" if (path, text) in exclusions else "UNLISTED"
                print(f"{path}: {text}    # line {number}, {missed} missed, {mark}")
    stale = sorted(set(exclusions) - used)
    for path, text in stale:
        print(f"coverage: note: {args.exclusions} lists '{path}: {text}', which no uncovered branch matches now "
              "(covered in this run, or the line changed)")
    for path, number, text, missed in unlisted:
        print(f"coverage: UNLISTED {path}:{number}: {missed} branch outcome(s) never taken: {text}")
    if unlisted:
        print(f"coverage: {len(unlisted)} line(s) with uncovered branches are not in {args.exclusions}: cover them "
              "with a test that asserts the outcome, or list them with the reason (docs/testing.md, Coverage)")
        return 1
    print(f"coverage: every uncovered branch is listed in {args.exclusions} with its reason")
    return 0


if __name__ == "__main__":
    sys.exit(main())
