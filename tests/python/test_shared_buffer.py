"""Layers of one shape share one Buffer per process (communication memory does not grow with the layer count), and
two layers on that one Buffer still give the dense reference's output and gradients: each layer's plan owns its
arrays, so the first layer's plan stays valid for its backward after the second layer planned.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_shared_buffer.py
"""

import torch

import flatep
from flatep import testing

H, F, E, K, S = 16, 8, 4, 2, 12


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_layers_of_one_shape_share_one_buffer_and_match_the_dense_reference():
    testing.release_all()
    a = flatep.nn.MoE(H, F, E, K, num_tokens=S, align=1, seed=1)
    b = flatep.nn.MoE(H, F, E, K, num_tokens=S, align=1, seed=2)
    c = flatep.nn.MoE(H, F, E, K, num_tokens=S, align=8, seed=3)  # another shape (align): its own Buffer
    assert a.buffer is b.buffer and a.buffer is not c.buffer
    da, db = testing.DenseMoE(H, F, E, K, seed=1), testing.DenseMoE(H, F, E, K, seed=2)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(0))
    xs, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys = b(a(xs) + xs)  # a's plan must outlive b's plan() for a's backward
    yd = db(da(xd) + xd)
    assert a.last_plan.generation != b.last_plan.generation
    assert rel_l2(ys, yd) < 1e-2  # bf16 rows and GEMMs on both sides, rounded at the same points
    g = torch.randn(S, H, generator=torch.Generator().manual_seed(1))
    ys.backward(g)
    yd.backward(g)
    assert rel_l2(xs.grad, xd.grad) < 1e-2
    for sharded, dense in ((a, da), (b, db)):
        assert rel_l2(sharded.w1.main_grad, dense.w1.grad) < 1e-2
        assert rel_l2(sharded.w2.main_grad, dense.w2.grad) < 1e-2
        assert rel_l2(sharded.router.weight.grad, dense.router_weight.grad) < 1e-2
    testing.release_all()
