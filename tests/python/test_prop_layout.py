"""Layout and allocation invariants of the pools over random shapes (hypothesis, virtual ranks on the CPU backend):
R ranks, epn experts a rank, B slots (training or serving), one to three projections of random rows, cols and
dtypes, experts from a few bytes to several pages (so that a rank's data starts inside a granule of the serving view).
Every rank writes its own experts through own_weights and its slots through slot_pool; then every view row reads back
exactly the bytes placed for it: training [own experts, slots], serving [every rank's own experts at row r*Q + l (read
in place from rank r's memory), pad rows, this rank's slots at R*Q + j], the gradient views likewise over own_grads
and the reduce pool. A byte placed outside its allocation, or a view mapping the wrong memory, shows as another
row's bytes. The sizes follow the documented formulas (view_rows, view_row(e), reduce_pool and grads present exactly
when the pools train).

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_prop_layout.py
"""

import math

import pytest
import torch

pytest.importorskip("hypothesis")  # Debian's python3-hypothesis (scripts/setup.sh)
from hypothesis import given, settings
from hypothesis import strategies as st

import flatep
from flatep import fp8 as _fp8
from flatep import testing, virtual

E4M3 = _fp8.E4M3_DTYPE or torch.uint8
ELEMENT_BYTES = {torch.bfloat16: 2, torch.float32: 4, E4M3: 1}


pytestmark = pytest.mark.usefixtures("fresh_caches")


@st.composite
def projection(draw):
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, E4M3]))
    rows = draw(st.sampled_from([1, 3, 8]))
    # An expert's bytes a multiple of 16 whatever rows is: cols a multiple of 16 / element bytes.
    cols = draw(st.sampled_from([1, 3, 5, 65, 1040])) * (16 // ELEMENT_BYTES[dtype])
    return rows, cols, dtype


@st.composite
def pools_shape(draw):
    R = draw(st.integers(1, 3))
    epn = draw(st.integers(1, 4))
    num_slots = draw(st.one_of(st.none(), st.integers(0, epn)))
    projections = draw(st.lists(projection(), min_size=1, max_size=3))
    return R, epn, num_slots, projections


def pattern(owner, index, nbytes, salt):
    """The bytes placed for (owner, index): distinct for every owner, index and projection."""
    g = torch.Generator().manual_seed(owner * 1009 + index * 31 + salt)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def as_bytes(t):
    """A [n, rows, cols] tensor's rows as [n, bytes] uint8 (a view of the same memory)."""
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return flat if t.dtype == torch.uint8 else flat.view(torch.uint8)


@settings(max_examples=30)
@given(shape=pools_shape())
def test_every_view_row_reads_the_bytes_placed_for_it(shape):
    try:
        check_view_rows(*shape)
    finally:  # each example's pools and views go before the next one maps its own
        testing.release_all()


def check_view_rows(R, epn, num_slots, projections):
    ranks = virtual.virtual_ranks(R, "cpu", timeout_s=60)

    def build(r):
        pools = flatep.ExpertPools(ranks[r], epn, projections, num_slots=num_slots)
        return pools, pools.register_layer()

    built = virtual.run_threads(R, build)
    pools = built[0][0]
    B = epn if num_slots is None else num_slots
    serving = B < epn
    trains = not serving and all(p[2] == torch.bfloat16 for p in projections)
    Q = pools.view_stride
    assert pools.num_slots == B and pools.serving == serving and pools.trains == trains
    assert Q == epn if not serving else Q >= epn
    assert pools.view_rows == (R * Q + B if serving else 2 * epn)
    if serving:
        assert [pools.view_row(e) for e in range(R * epn)] == [(e // epn) * Q + e % epn for e in range(R * epn)]

    def place(r):
        p_obj, layer = built[r]
        for p, (rows, cols, dtype) in enumerate(projections):
            nbytes = rows * cols * ELEMENT_BYTES[dtype]
            own, slots = as_bytes(layer.own_weights(p)), as_bytes(p_obj.slot_pool(p))
            assert own.shape == (epn, nbytes) and slots.shape == (B, nbytes)
            for local in range(epn):
                own[local] = pattern(r, local, nbytes, p)
            for j in range(B):
                slots[j] = pattern(r, 1000 + j, nbytes, p)
            if trains:
                own_g, pool_g = as_bytes(layer.own_grads(p)), as_bytes(p_obj.reduce_pool(p))
                for local in range(epn):
                    own_g[local] = pattern(r, 2000 + local, rows * cols * 4, p)
                for j in range(B):
                    pool_g[j] = pattern(r, 3000 + j, rows * cols * 4, p)
            else:
                assert layer.grads(p) is None and layer.own_grads(p) is None and p_obj.reduce_pool(p) is None

    virtual.run_threads(R, place)

    def read(r):  # after every rank placed its bytes (run_threads returned)
        _, layer = built[r]
        for p, (rows, cols, dtype) in enumerate(projections):
            nbytes = rows * cols * ELEMENT_BYTES[dtype]
            view = layer.weights(p)
            assert view.shape == (pools.view_rows, rows, cols) and view.dtype == dtype
            view = as_bytes(view)
            want = {}
            if serving:
                for owner in range(R):
                    for local in range(epn):
                        want[owner * Q + local] = pattern(owner, local, nbytes, p)
                for j in range(B):
                    want[R * Q + j] = pattern(r, 1000 + j, nbytes, p)
            else:
                for local in range(epn):
                    want[local] = pattern(r, local, nbytes, p)
                for j in range(B):
                    want[epn + j] = pattern(r, 1000 + j, nbytes, p)
            for row, expected in want.items():
                assert torch.equal(view[row], expected), f"rank {r} projection {p}: view row {row}"
            view.sum()  # every row of the view, the pad rows included, is mapped memory
            if trains:
                grads = as_bytes(layer.grads(p))
                for local in range(epn):
                    assert torch.equal(grads[local], pattern(r, 2000 + local, rows * cols * 4, p))
                for j in range(B):
                    assert torch.equal(grads[epn + j], pattern(r, 3000 + j, rows * cols * 4, p))

    virtual.run_threads(R, read)
