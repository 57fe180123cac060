"""R processes (2 and 4) joined by torch.distributed (gloo) through the ipc transport: flatep.nn.MoE's forward output
and every gradient (input, router, expert weights) against the dense single-process reference (DenseMoE), across
maxvio 0-20, capacity factors 1.0 and 1.25, aligns 1/8/128, both planners and ragged token counts.

Tolerances (max |a - b| / max |ref| over the tensor):
* bf16 results (output, input gradient): 2**-6, i.e. two bf16 ulps at the largest magnitude. The distributed
  combine rounds per-destination partial sums to bf16 before the final sum (design §6), the reference rounds once.
* fp32 results (router and expert-weight gradients): 1e-4. Both sides compute the same bf16 values; only fp32
  summation order differs (replica gradients are reduced into the owner after the fact). A missing replica
  contribution or a misrouted row gives errors of order 1.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_distributed.py
"""

import json
import os

import pytest

import flatep.testing
import mp_cases

BF16_TOL = 2.0**-6
FP32_TOL = 1e-4
TOLERANCES = {"out": BF16_TOL, "grad_x": BF16_TOL, "grad_router": FP32_TOL, "grad_w1": FP32_TOL, "grad_w2": FP32_TOL}

CASES = [dict(maxvio=mv, cf=cf, align=8, planner="balanced") for mv in (0.0, 2.0, 20.0) for cf in (1.0, 1.25)]
CASES += [
    dict(maxvio=5.0, cf=1.0, align=128, planner="greedy", ragged=1),
    dict(maxvio=10.0, cf=1.25, align=1, planner="balanced", ragged=1),
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda r: f"R{r}")
def world(request, tmp_path_factory):
    R = request.param
    out_path = os.path.join(str(tmp_path_factory.mktemp(f"R{R}")), "results.json")
    flatep.testing.spawn(mp_cases.main, R, CASES, out_path)
    with open(out_path) as f:
        return R, json.load(f)


@pytest.mark.parametrize("case", CASES, ids=mp_cases.case_name)
def test_matches_dense_reference(world, case):
    R, ranks = world
    name = mp_cases.case_name(case)
    for rank, result in enumerate(ranks):
        r = result["cases"][name]
        for quantity, tol in TOLERANCES.items():
            assert r[quantity] <= tol, f"R={R} {name} rank {rank}: {quantity} relative error {r[quantity]:.3g} > {tol}"


@pytest.mark.parametrize("case", CASES, ids=mp_cases.case_name)
def test_balance_guarantee(world, case):
    R, ranks = world
    r = ranks[0]["cases"][mp_cases.case_name(case)]
    loads = r["loads"]
    tokens = [mp_cases.S - (q if case.get("ragged") else 0) for q in range(R)]
    total = sum(tokens) * mp_cases.K
    assert sum(loads) == total
    if case["cf"] == 1.0:  # exact mode: floor/ceil of N/R, lower ranks take the remainder
        assert loads == [total // R + (1 if q < total % R else 0) for q in range(R)]
    else:
        assert max(loads) <= r["capacity"]
    assert abs(r["maxvio"] - case["maxvio"]) <= max(0.5, 0.2 * case["maxvio"]) or case["maxvio"] < 1.5


def test_replicas_exercised(world):
    """At high skew in exact mode the planner must place replicas, so prefetch and reduce_grad are on the path."""
    R, ranks = world
    r = ranks[0]["cases"][mp_cases.case_name(CASES[4])]
    assert CASES[4]["maxvio"] == 20.0 and CASES[4]["cf"] == 1.0
    assert r["replicas"] >= 1 and r["P"] >= 1


def test_errors_on_every_rank(world):
    R, ranks = world
    for result in ranks:
        e = result["errors"]
        assert e["E_not_multiple"] == f"num_experts (E) must be a multiple of num_ranks (R): E={R + 1} R={R}"
        moe_message = f"MoE: num_experts must be an int multiple of the group size R={R}, got {R + 1}"
        assert e["moe_E_not_multiple"] == moe_message
        assert e["foreign_plan"] == "dispatch: plan was made by another Buffer; use the plan of this Buffer"
