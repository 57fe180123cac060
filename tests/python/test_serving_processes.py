"""Serving across processes (issue 43): nn.MoE(num_slots=B) on R processes joined by gloo, each process's own experts
read in place through every other process's [E+B] weight view (memfd on the CPU backend; CUDA VMM on 'cuda', every
process on GPU 0). A balanced prefill step with an empty rank, then owner-planner decode steps over the same weights
with ragged and empty ranks; every rank's output against the dense reference, the slots used never above B, the
owner planner's none, and the prefill's rows balanced exactly (floor or ceil of the total over R)."""

import json
import os

import pytest

import flatep
import mp_cases
import serving_mp_cases as cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
R = 4
TOL = 2.0**-7


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")])])
@pytest.mark.parametrize("num_slots", [0, 1, 4])
def test_serving_across_processes_matches_dense_reference(tmp_path, device, num_slots):
    out_path = str(tmp_path / "serving.json")
    flatep.testing.spawn(cases.main, R, device, num_slots, out_path)
    with open(out_path) as f:
        ranks = json.load(f)
    epn = cases.E // R
    for r, res in enumerate(ranks):
        assert res["serving"] == (num_slots < epn)
        if res["serving"]:
            assert res["view_rows"] == R * res["view_stride"] + num_slots
        for planner, counts, err, slot_expert, loads, shape in res["steps"]:
            assert shape == [counts[r], cases.H], (planner, r, shape)
            assert err < TOL, f"rank {r} {planner} step {counts}: error {err}"
            used = sum(1 for e in slot_expert if e >= 0)
            if planner == "owner":
                assert used == 0, f"rank {r}: the owner planner slotted {slot_expert}"
            else:
                assert used <= num_slots, f"rank {r}: {used} slots used, B = {num_slots}"
                assert all(e < 0 for e in slot_expert[num_slots:]), slot_expert
                total = sum(counts) * cases.K  # exact mode: floor/ceil of the rows over R, lower ranks the remainder
                assert loads == [total // R + (1 if q < total % R else 0) for q in range(R)], (r, loads, counts)
            assert sum(loads) == sum(counts) * cases.K, (planner, loads, counts)
