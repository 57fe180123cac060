"""R processes (2 and 4) joined by torch.distributed (gloo) through the ipc transport, on the CPU backend and, where a
GPU and a CUDA build of FlatEP exist, on CUDA (every rank on cuda:0: the processes share the GPU through CUDA VMM
memory). flatep.nn.MoE's forward output and every gradient (input, router, expert weights) are held to the dense
single-process reference (DenseMoE, on the CPU) across maxvio 0-20, capacity factors 1.0/1.25, aligns 1/8/128, both
planners and ragged token counts. On CUDA, plan, dispatch, both combines, entry_values, prefetch and reduce_grad are
also held bitwise to the CPU backend (the oracle of design §6) on the same inputs, one case on a side stream; on the
CPU the same check asserts that two Buffers give the same bits.

Tolerances (max |a - b| / max |ref| over the tensor):
* cpu, bf16 results (output, input gradient): 2**-6, i.e. two bf16 ulps at the largest magnitude. The distributed
  combine rounds per-destination partial sums to bf16 before the final sum (design §6), the reference rounds once.
* cpu, fp32 results (router and expert-weight gradients): 1e-4. Both sides compute the same bf16 values; only fp32
  summation order differs (replica gradients are reduced into the owner after the fact).
* cuda, every result: 2**-6. The expert FFN runs as bf16 grouped GEMMs on tensor cores (torch._grouped_mm), whose
  fp32 accumulation order differs from the CPU's: an element of h or y may round to the neighbouring bf16 value, and
  the expert-weight gradients are bf16 products of the GEMM's backward. The communication itself is checked bitwise.
A missing replica contribution or a misrouted row gives errors of order 1 on either device.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_distributed.py
(CUDA only: add -m cuda; FLATEP_TIMEOUT_S=60 bounds every wait of the processes sharing the GPU.)
"""

import json
import math
import os

import pytest

import flatep.testing
import mp_cases

BF16_TOL = 2.0**-6
FP32_TOL = 1e-4
QUANTITIES = ("out", "grad_x", "grad_router", "grad_w1", "grad_w2")
TOLERANCES = {
    "cpu": {"out": BF16_TOL, "grad_x": BF16_TOL, "grad_router": FP32_TOL, "grad_w1": FP32_TOL, "grad_w2": FP32_TOL},
    "cuda": {q: BF16_TOL for q in QUANTITIES},
}

CASES = [dict(maxvio=mv, cf=cf, align=8, planner="balanced") for mv in (0.0, 2.0, 20.0) for cf in (1.0, 1.25)]
CASES += [
    dict(maxvio=5.0, cf=1.0, align=128, planner="greedy", ragged=1),
    dict(maxvio=10.0, cf=1.25, align=1, planner="balanced", ragged=1),
]

CUDA_SKIP = mp_cases.cuda_unavailable_reason()


def world_param(R, device):
    marks = []
    if device == "cuda":
        marks = [pytest.mark.cuda, pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")]
    return pytest.param((R, device), marks=marks, id=f"R{R}-{device}")


@pytest.fixture(scope="module", params=[world_param(R, d) for d in ("cpu", "cuda") for R in (2, 4)])
def world(request, tmp_path_factory):
    R, device = request.param
    out_path = os.path.join(str(tmp_path_factory.mktemp(f"R{R}-{device}")), "results.json")
    flatep.testing.spawn(mp_cases.main, R, device, CASES, out_path)
    with open(out_path) as f:
        return R, device, json.load(f)


@pytest.mark.parametrize("case", CASES, ids=mp_cases.case_name)
def test_matches_dense_reference(world, case):
    R, device, ranks = world
    name = mp_cases.case_name(case)
    for rank, result in enumerate(ranks):
        r = result["cases"][name]
        for quantity, tol in TOLERANCES[device].items():
            assert r[quantity] <= tol, (
                f"R={R} {device} {name} rank {rank}: {quantity} relative error {r[quantity]:.3g} > {tol}"
            )


@pytest.mark.parametrize("case", CASES, ids=mp_cases.case_name)
def test_balance_guarantee(world, case):
    R, device, ranks = world
    r = ranks[0]["cases"][mp_cases.case_name(case)]
    loads = r["loads"]
    tokens = [mp_cases.S - (q if case.get("ragged") else 0) for q in range(R)]
    total = sum(tokens) * mp_cases.K
    assert sum(loads) == total
    if case["cf"] == 1.0:  # exact mode: floor/ceil of N/R, lower ranks take the remainder
        assert loads == [total // R + (1 if q < total % R else 0) for q in range(R)]
    else:  # slack mode: C = ceil(f*S*K) (design §1), written out here rather than read from the Buffer
        capacity = math.ceil(case["cf"] * mp_cases.S * mp_cases.K)
        assert r["capacity"] == capacity and max(loads) <= capacity
    assert abs(r["maxvio"] - case["maxvio"]) <= max(0.5, 0.2 * case["maxvio"]) or case["maxvio"] < 1.5


def test_replicas_exercised(world):
    """At high skew in exact mode the planner must place replicas, so prefetch and reduce_grad are on the path."""
    R, device, ranks = world
    r = ranks[0]["cases"][mp_cases.case_name(CASES[4])]
    assert CASES[4]["maxvio"] == 20.0 and CASES[4]["cf"] == 1.0
    assert r["replicas"] >= 1 and r["P"] >= 1


def test_backend_bitwise_equal_to_cpu_backend(world):
    """Every op's output on the world's device equals the CPU backend's bit for bit (on the CPU: two Buffers agree)."""
    R, device, ranks = world
    assert mp_cases.BACKEND_CASES[0]["maxvio"] == 20.0
    for rank, result in enumerate(ranks):
        report = result["backends"]
        assert report["mismatches"] == [], f"R={R} {device} rank {rank}:\n" + "\n".join(report["mismatches"])
        assert report["replicas"][0] >= 1, f"R={R} {device}: the maxvio-20 case placed no replica"


def test_errors_on_every_rank(world):
    R, device, ranks = world
    for result in ranks:
        e = result["errors"]
        assert e["E_not_multiple"] == f"num_experts (E) must be a multiple of num_ranks (R): E={R + 1} R={R}"
        moe_message = f"MoE: num_experts must be an int multiple of the group size R={R}, got {R + 1}"
        assert e["moe_E_not_multiple"] == moe_message
        assert e["foreign_plan"] == "dispatch: plan was made by another Buffer; use the plan of this Buffer"
