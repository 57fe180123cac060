"""The flag the pools derive from their projections' dtypes, over every combination: ExpertPools.trains (gradients:
the training layout and every projection bf16) for each of the 39 dtype lists of one to three projections (bf16,
fp32, e4m3) in both layouts, with what follows from it: the gradient views and the reduce pool exist exactly when
it is set, write_grads and reduce_grad run then and refuse otherwise with the reason (serving, or a weight that is
not bf16), and every weights view has its projection's dtype and shape.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_prop_dtypes.py
"""

import itertools

import pytest
import torch

import flatep
from flatep import fp8 as _fp8

EPN, ROWS, COLS = 2, 16, 8  # 128 elements an expert: a multiple of 16 bytes in every dtype
E4M3 = _fp8.E4M3_DTYPE or torch.uint8
DTYPES = [torch.bfloat16, torch.float32, E4M3]
COMBINATIONS = [c for n in (1, 2, 3) for c in itertools.product(DTYPES, repeat=n)]


pytestmark = pytest.mark.usefixtures("fresh_caches")


def test_every_combination_is_listed():
    assert len(COMBINATIONS) == 3 + 9 + 27


@pytest.mark.parametrize("num_slots", [None, EPN - 1], ids=["training", "serving"])
def test_trains_follows_the_layout_and_every_dtype(num_slots):
    buffer = flatep.Buffer(None, 4, 16, EPN, 1, align=1)
    for dtypes in COMBINATIONS:
        what = f"dtypes {[str(d)[6:] for d in dtypes]}, num_slots={num_slots}"
        pools = flatep.ExpertPools(None, EPN, [(ROWS, COLS, d) for d in dtypes], num_slots=num_slots)
        if num_slots is not None:
            buffer = flatep.Buffer(None, 4, 16, EPN, 1, align=1, pools=pools)
        expected = num_slots is None and all(d == torch.bfloat16 for d in dtypes)
        assert pools.trains == expected, what
        assert pools.serving == (num_slots is not None), what
        assert pools.dtypes == list(dtypes), what
        layer = pools.register_layer()
        for p, dtype in enumerate(dtypes):
            assert layer.weights(p).dtype == dtype and layer.weights(p).shape == (pools.view_rows, ROWS, COLS), what
            assert (layer.grads(p) is None) == (not expected) and (layer.own_grads(p) is None) == (not expected), what
            assert (pools.reduce_pool(p) is None) == (not expected), what
        plan = buffer.plan(torch.zeros(4, 1, dtype=torch.int64))
        pools.prefetch(plan, layer)  # every pools move their weights
        grad = torch.ones(2 * EPN, ROWS, COLS)
        if expected:
            pools.write_grads(plan, layer, 0, grad)
            pools.reduce_grad(plan, layer)
            # Expert 0 had the plan's 4 rows: its gradient was written; expert 1 had none: zero.
            assert torch.equal(layer.own_grads(0)[0], grad[0]) and not layer.own_grads(0)[1].any(), what
            continue
        why = f"serving: num_slots={num_slots} < epn={EPN}" if num_slots is not None else \
            "a projection's weights are not bf16"
        for op, call in (("write_grads", lambda: pools.write_grads(plan, layer, 0, grad)),
                         ("reduce_grad", lambda: pools.reduce_grad(plan, layer))):
            with pytest.raises(ValueError) as info:
                call()
            assert str(info.value).startswith(f"{op}: these pools are forward-only ({why})"), what
