"""benchmarks/serving/eplb_compare.py on the CPU: its closed forms of every policy's rows (the static split rule, the
owner loads), the tiny preset end to end with the plans checked against the CPU backend, and its one-line refusals.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_eplb_compare.py
"""

import csv
import os
import random
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks", "serving"))

import eplb_compare  # noqa: E402

from flatep import eplb  # noqa: E402


def random_counts(rng, R, E, total_per_rank):
    counts = np.zeros((R, E), dtype=np.int64)
    for r in range(R):
        weights = [rng.lognormvariate(0, 1.5) for _ in range(E)]
        picks = rng.choices(range(E), weights=weights, k=total_per_rank)
        counts[r] = np.bincount(picks, minlength=E)
    return counts


@pytest.mark.parametrize("seed", range(5))
def test_the_static_split_gives_every_entry_to_one_copy_as_evenly_as_integers_allow(seed):
    rng = random.Random(seed)
    R, epn, B = rng.choice([2, 4, 8]), rng.choice([2, 4]), 2
    E = R * epn
    counts = random_counts(rng, R, E, 200)
    slots = eplb.place(counts.sum(0).tolist(), R, B)
    rows = eplb_compare.static_rows(counts, slots, epn)
    assert rows.sum() == counts.sum(), "every entry is computed once"
    none = eplb_compare.static_rows(counts, [[-1] * B for _ in range(R)], epn)
    assert np.array_equal(none, eplb_compare.owner_rows(counts, epn)), "no placement: the owner's loads"
    # expert by expert: the copies' shares differ by at most one and sum to the expert's entries
    total = counts.sum(0)
    for e in range(E):
        hosts = [e // epn] + sorted(d for d in range(R) if e in slots[d])
        single = np.zeros((R, E), dtype=np.int64)
        single[0, e] = total[e]
        shares = eplb_compare.static_rows(single, slots, epn)[hosts]
        assert shares.sum() == total[e] and shares.max() - shares.min() <= 1
        extra = total[e] % len(hosts)
        start = e % len(hosts)  # the remainder goes to the copies from copy (e mod n) on, cyclically
        want = [total[e] // len(hosts) + (1 if (i - start) % len(hosts) < extra else 0) for i in range(len(hosts))]
        assert shares.tolist() == want


def test_the_tiny_preset_end_to_end(tmp_path):
    code = eplb_compare.main(["--trace", "drift", "--preset", "tiny", "--steps", "30", "--intervals", "1,10",
                              "--check-plans", "2", "--out", str(tmp_path), "--no-plot"])
    assert code == 0
    rows = list(csv.DictReader(line for line in open(tmp_path / "eplb_compare.csv") if not line.startswith("#")))
    policies = {r["policy"] for r in rows}
    assert policies == {"flatep_b4", "flatep_bepn", "owner", "static_1", "static_10"}
    for r in rows:
        assert int(r["step"]) < 30
        if r["policy"].startswith("flatep"):
            assert float(r["rows_ratio"]) == 1.0, "FlatEP's balanced planner is exact"
        else:
            assert float(r["rows_ratio"]) >= 1.0
    moved = {p: sum(int(r["bytes_moved"]) for r in rows if r["policy"] == p) for p in policies}
    assert moved["owner"] == 0 and moved["static_10"] <= moved["static_1"]
    text = (tmp_path / "summary.txt").read_text()
    assert "flatep_b4 / best static" in text


def test_bad_flags_are_refused_in_one_line(capsys):
    for argv, message in ((["--intervals", "0,10"], "--intervals must be a comma list of positive ints"),
                          (["--steps", "0"], "--steps must be >= 1, got 0")):
        with pytest.raises(SystemExit):
            eplb_compare.parse_args(argv)
        assert message in capsys.readouterr().err
