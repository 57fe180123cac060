"""flatep.eplb's paths the placement tests do not take (issue 62's gaps): replicate without a slot limit (or with E
not a multiple of R, where no rank is a home), the exact flow check given a key of no copies, and the packer's guard
when no bin may take a copy. Results worked out by hand."""

from fractions import Fraction

import pytest

from flatep import eplb


def test_replicate_without_a_slot_limit():
    # E=4, R=2, no limit: the largest load per copy first, an expert at most R copies. Loads [4, 2, 1, 1]:
    # e0 (4) gets its second copy, then e0 is full (R=2) and e1 (2) gets one.
    assert eplb.replicate([4, 2, 1, 1], 2, 2) == [2, 2, 1, 1]
    # Ties go to the lower id: loads [3, 3, 3, 3], three copies go to e0, e1, e2.
    assert eplb.replicate([3, 3, 3, 3], 2, 3) == [2, 2, 2, 1]
    # E=3 on R=2 ranks (no home ranks, so no slot packing even with num_slots): e0 (6), then e1 (5) over e0's
    # 6/2 = 3.
    assert eplb.replicate([6, 5, 1], 2, 2, num_slots=1) == [2, 2, 1]


def test_fits_ignores_keys_of_no_copies():
    may = lambda e, d: e != d  # noqa: E731 - expert e's home is rank e
    # Two ranks of one slot: e0's copy onto rank 1, e1's onto rank 0; a key asking for 0 copies adds nothing.
    assert eplb._fits({(0, None): 1, (1, None): 1, (2, None): 0}, [1, 1], may) is True
    assert eplb._fits({(0, None): 0}, [0, 0], may) is True
    assert eplb._fits({(0, None): 2, (1, None): 0}, [1, 1], may) is False  # only rank 1 may hold e0


def test_pack_onto_refuses_an_item_no_bin_may_take():
    start, holds = [Fraction(0), Fraction(0)], [set(), set()]
    with pytest.raises(ValueError) as e:
        eplb._pack_onto(2, [1, 1], start, [(Fraction(3), 5)], holds, lambda e, b: False)
    assert str(e.value) == "pack: no bin with a free slot can take a copy of expert 5"
    assert start == [0, 0] and holds == [set(), set()]  # nothing was placed
    # The same item where bin 1 alone may take it: bin 1, its load and holdings updated.
    assert eplb._pack_onto(2, [1, 1], start, [(Fraction(3), 5)], holds, lambda e, b: b == 1) == [1]
    assert start == [0, 3] and holds == [set(), {5}]
