"""scripts/coverage_report.py's merge of a device run's coverage into the CPU suite's (issue 62): a stamped report
counts only for a file whose source is still the one it measured, the union of several device runs is taken, and the
merged tally counts a branch or line taken on either side as covered, and nothing else."""

import importlib.util
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "coverage_report.py")
SOURCE = "def f(a, b):\n    if a:\n        x = 1\n    if b:\n        x = 2\n    return x\n"


def load():
    spec = importlib.util.spec_from_file_location("coverage_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_report():
    # Branches 2->3, 2->4, 4->5, 4->6; the CPU suite took only 2->4 and 4->6; lines 3 and 5 never ran.
    return {"files": {"pkg/a.py": {
        "summary": {"num_statements": 6, "covered_lines": 4, "num_branches": 4, "covered_branches": 2},
        "missing_lines": [3, 5], "missing_branches": [[2, 3], [4, 5]]}}}


def device_run(tmp_path, name, lines, branches, stamp_time):
    raw = tmp_path / f"{name}.raw.json"
    raw.write_text(json.dumps({"meta": {"version": "7.6", "timestamp": stamp_time}, "files": {
        str(tmp_path / "pkg" / "a.py"): {"executed_lines": lines, "executed_branches": branches}}}))
    out = tmp_path / f"{name}.json"
    assert load().stamp(str(raw), str(out), str(tmp_path)) == 0
    return str(out)


def test_device_runs_merge_where_the_source_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(SOURCE)
    cr = load()
    first = device_run(tmp_path, "first", [1, 2, 3], [[2, 3]], "T1")
    second = device_run(tmp_path, "second", [1, 2], [[2, 4]], "T2")
    stamped = json.loads(open(first).read())["files"]["pkg/a.py"]
    assert stamped["executed_branches"] == [[2, 3]] and len(stamped["sha256"]) == 64

    merged = cr.merge_stamped([first, second])
    assert merged["meta"]["timestamp"] == "T1, T2"
    assert merged["files"]["pkg/a.py"]["executed_branches"] == {(2, 3), (2, 4)}
    assert merged["files"]["pkg/a.py"]["executed_lines"] == {1, 2, 3}

    cpu = cr.python_tally(cpu_report(), str(tmp_path))
    assert (cpu.lines_hit, cpu.branches_hit) == (4, 2)
    both = cr.python_tally(cpu_report(), str(tmp_path), merged["files"])
    assert (both.lines, both.lines_hit, both.branches, both.branches_hit) == (6, 5, 4, 3)
    assert both.stale == []
    assert both.uncovered == [("pkg/a.py", 4, "if b:", 1)]  # 4->5 taken nowhere

    (tmp_path / "pkg" / "a.py").write_text(SOURCE + "# changed\n")  # the device measured another source
    stale = cr.python_tally(cpu_report(), str(tmp_path), merged["files"])
    assert stale.stale == ["pkg/a.py"]
    assert (stale.lines_hit, stale.branches_hit) == (4, 2)  # the CPU suite's alone
    assert [u[1] for u in stale.uncovered] == [2, 4]


def test_a_later_run_on_another_source_replaces_the_earlier(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(SOURCE)
    old = device_run(tmp_path, "old", [1, 2, 3], [[2, 3]], "T1")
    (tmp_path / "pkg" / "a.py").write_text(SOURCE + "# v2\n")
    new = device_run(tmp_path, "new", [1, 2], [[2, 4]], "T2")
    merged = load().merge_stamped([old, new])["files"]["pkg/a.py"]
    assert merged["executed_branches"] == {(2, 4)}
    assert merged["executed_lines"] == {1, 2}


WITH_SOURCE = "def g(m, n):\n    with m:\n        y = 1\n    for i in n:\n        y += i\n    return y\n"


def test_arcs_the_device_does_not_count_as_branches_are_taken_by_their_lines(tmp_path, monkeypatch):
    # Debian's coverage.py 6 counts the `with` on line 2 as a branch (2->3 into the block, 2->4 out of it) and the
    # loop on line 4 (4->5, 4->6) and a generator's exit (4->-4, standing for any arc to an exit); a newer coverage.py
    # on the device counts only the loop. The CPU suite took none of them.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(WITH_SOURCE)
    cr = load()
    report = {"files": {"pkg/a.py": {
        "summary": {"num_statements": 6, "covered_lines": 1, "num_branches": 5, "covered_branches": 0},
        "missing_lines": [2, 3, 4, 5, 6], "missing_branches": [[2, 3], [2, 4], [4, 5], [4, 6], [4, -4]]}}}

    def tally(lines, branches):
        run = device_run(tmp_path, "run", lines, branches, "T")
        return cr.python_tally(report, str(tmp_path), cr.merge_stamped([run])["files"])

    # Lines 2, 3, 4 and 6 ran and the loop was left at once (4->6): line 2 is no branch there, its arcs count by
    # their lines (2->3 and 2->4 both); 4->5 was not taken (line 5 never ran) and 4 is a branch there, so neither
    # 4->5 nor the exit counts.
    t = tally([1, 2, 3, 4, 6], [[4, 6]])
    assert (t.branches_hit, t.by_lines) == (3, 2)
    assert t.uncovered == [("pkg/a.py", 4, "for i in n:", 2)]
    assert "2 of them arcs the device's coverage.py does not count as branches" in t.summary()
    # The same lines, but line 4 a branch nowhere: 4->5 still does not count (line 5 never ran), nor the exit (an
    # arc to an exit never counts by lines).
    t = tally([1, 2, 3, 4, 6], [])
    assert (t.branches_hit, t.by_lines) == (3, 3)
    assert t.uncovered == [("pkg/a.py", 4, "for i in n:", 2)]
    # Line 2 ran but line 3 did not (the block raised before it): 2->3 is not taken; 2->4 is.
    t = tally([1, 2, 4, 6], [[4, 6]])
    assert (t.branches_hit, t.by_lines) == (2, 1)
    assert ("pkg/a.py", 2, "with m:", 1) in t.uncovered
    # A device that counts line 2 as a branch (an arc from it taken) is taken at its word: 2->4 not listed is missed.
    t = tally([1, 2, 3, 4, 6], [[2, 3], [4, 6]])
    assert (t.branches_hit, t.by_lines) == (2, 0)
    assert ("pkg/a.py", 2, "with m:", 1) in t.uncovered
