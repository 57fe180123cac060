"""flatep.ffn.grouped_mm: more groups than one torch._grouped_mm call takes (a serving weights view of R*Q + B
groups, above 1024 with small experts on processes) runs as several calls with the same result. On the CPU, with a
reference grouped GEMM of torch._grouped_mm's contract (rows past the last group end unwritten) and a small limit:
every row of a group equals the reference's bitwise (integer-valued data: exact sums), rows past the end are zero,
whatever the runs' boundaries cut (empty groups, a group at a run's edge, empty runs, all rows in the last run)."""

import pytest
import torch

from flatep import ffn

UNWRITTEN = float("nan")


def reference_mm(x, w, offs):
    """torch._grouped_mm's contract on the CPU: group g = rows [offs[g-1], offs[g]) times w[g]; rows past offs[-1]
    unwritten (NaN here, so a leak shows)."""
    out = torch.full((x.shape[0], w.shape[-1]), UNWRITTEN, dtype=x.dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[g]
        start = max(start, end)
    return out


CASES = {
    "empty groups and runs": [0, 0, 0, 3, 3, 3, 3, 7, 7, 9, 9, 9, 9, 9],
    "rows only in the last run": [0] * 9 + [2, 5, 5, 11],
    "every group one row": list(range(1, 11)),
    "rows past the end": [1, 4, 4, 6, 6, 6, 8],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("max_groups", [1, 3, 4])
def test_chunked_grouped_mm_equals_one_call(case, max_groups):
    ends = CASES[case]
    n, k, m = 14, 5, 6
    g = torch.Generator().manual_seed(len(ends) * 10 + max_groups)
    x = torch.randint(-4, 5, (n, k), generator=g).float()
    w = torch.randint(-4, 5, (len(ends), k, m), generator=g).float()
    offs = torch.tensor(ends, dtype=torch.int32)
    want = reference_mm(x, w, offs)
    got = ffn.grouped_mm(x, w, offs, mm=reference_mm, max_groups=max_groups)
    used = ends[-1]
    assert torch.equal(got[:used], want[:used]), case
    assert torch.equal(got[used:], torch.zeros(n - used, m)), "rows past the last group end must be zero"


def test_at_most_max_groups_is_one_call():
    calls = []

    def counting_mm(x, w, offs):
        calls.append(w.shape[0])
        return reference_mm(x, w, offs)

    x, w = torch.ones(4, 2), torch.ones(5, 2, 3)
    offs = torch.tensor([1, 2, 2, 3, 4], dtype=torch.int32)
    ffn.grouped_mm(x, w, offs, mm=counting_mm, max_groups=5)
    ffn.grouped_mm(x, w, offs, mm=counting_mm, max_groups=2)
    assert calls == [5, 2, 2, 1]
    assert ffn.MAX_GROUPS == 1023  # torch._grouped_mm checks group_count < 1024
