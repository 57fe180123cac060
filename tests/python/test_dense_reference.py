"""The oracles of the MoE tests, held on their own:

* the routing weights, pinned alone by hand on tiny inputs (softmax, top-K, renormalised over the K chosen experts:
  every row sums to 1): flatep.nn.route (the layer's router) and flatep.testing.routing_weights (the reference's);
* flatep.testing.DenseMoE shares no function with the layer's path: it runs, forward and backward, with every
  function of flatep.nn, fp8, buffer, pools, ops, autograd, distributed and _tensors replaced by one that raises, and
  without the C++ extension (so a bug there cannot be carried into the reference);
* the reference's FP8 round trip (written out on values) equals flatep.fp8's bit rule on a sweep of magnitudes,
  ties, subnormal scales, zeros, NaN and Inf;
* the reference's init is the layer's (same seed, same weights), and one rank of nn.MoE gives its output.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_dense_reference.py
"""

import inspect
import math

import pytest
import torch

import flatep
from flatep import fp8, testing

BF16 = torch.bfloat16


def route_both(x, w, topk, topk_idx=None):
    """(weights, idx) of the layer's router and of the reference's, checked equal to each other."""
    lib_w, lib_i = flatep.nn.route(x, w, topk, topk_idx)
    ref_w, ref_i = testing.routing_weights(x, w, topk, topk_idx)
    assert torch.equal(lib_i, ref_i) and torch.equal(lib_w, ref_w)
    return lib_w, lib_i


def logits_input(logits):
    """(x, router_weight) whose fp32 logits x @ W.T are exactly `logits` [s, E]: x = the logits, W = identity."""
    logits = torch.tensor(logits, dtype=torch.float32)
    return logits, torch.eye(logits.shape[1])


def test_routing_weights_by_hand_exact():
    # Row 0: four equal logits, K=2: softmax 1/4 each; renormalised over the two chosen: exactly 1/2 each (without
    #        the renormalisation the row would sum to 1/2).
    # Row 1: three equal logits and one far below (e^-30 vanishes next to 3 in fp32): softmax p = fp32(1/3) for the
    #        three; two of them chosen: p / (p + p) = 1/2 exactly.
    # Row 2: two equal logits far above the others: p ~ 1/2 each, and p / (p + p) = 1/2 exactly.
    # Which of tied experts torch.topk picks is not specified: only that they are among the tied ones.
    x, w = logits_input([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -30.0, 0.0], [-30.0, 5.0, 5.0, -30.0]])
    tied = [{0, 1, 2, 3}, {0, 1, 3}, {1, 2}]
    for topk, want in ((1, 1.0), (2, 0.5)):
        weights, idx = route_both(x, w, topk)
        for r in range(3):
            assert len(set(idx[r].tolist())) == topk and set(idx[r].tolist()) <= tied[r], (topk, r, idx[r])
        assert weights.tolist() == [[want] * topk] * 3, topk
    # K=3 of four equal logits: p / 3p = fp32(1/3) each, and the row sums to exactly 1 in fp32.
    weights, _ = route_both(x[:1], w, 3)
    third = torch.tensor(1.0 / 3.0, dtype=torch.float32).item()
    assert weights.tolist() == [[third, third, third]]
    assert weights.sum().item() == 1.0
    # Given topk_idx [[2, 3]] on row 0: 1/4 and 1/4 renormalised: 1/2 each.
    weights, idx = route_both(x[:1], w, 2, torch.tensor([[2, 3]]))
    assert idx.tolist() == [[2, 3]] and weights.tolist() == [[0.5, 0.5]]


def test_routing_weights_by_hand_closed_form():
    # Renormalising over the chosen experts cancels the softmax denominator: w_i = exp(l_i) / sum_{j chosen} exp(l_j),
    # whatever the other experts' logits. Computed here in float64 from the logits alone.
    logits = [[1.0, -0.5, 2.0, 0.25, -3.0], [0.0, 4.0, -1.0, 3.5, 3.0], [-2.0, -2.5, -1.0, 0.5, 0.0]]
    x, w = logits_input(logits)
    for topk in (1, 2, 3):
        weights, idx = route_both(x, w, topk)
        for row, chosen in zip(logits, idx.tolist()):
            assert chosen == sorted(range(len(row)), key=lambda e: -row[e])[:topk]  # the K largest, descending
        for r, chosen in enumerate(idx.tolist()):
            total = sum(math.exp(logits[r][e]) for e in chosen)
            for k, e in enumerate(chosen):
                want = math.exp(logits[r][e]) / total
                assert abs(weights[r, k].item() - want) <= 1e-6 * want, (r, k, weights[r, k].item(), want)
        assert torch.allclose(weights.sum(dim=1), torch.ones(3), rtol=0, atol=1e-6)
    # Given topk_idx: the weights of those experts (any order, not the largest), renormalised over them.
    given = torch.tensor([[4, 0], [2, 1], [3, 3]])
    weights, idx = route_both(x, w, 2, given)
    assert torch.equal(idx, given)
    for r in range(3):
        a, b = (math.exp(logits[r][e]) for e in given[r].tolist())
        assert weights[r].tolist() == pytest.approx([a / (a + b), b / (a + b)], rel=1e-6)


def test_routing_weights_rows_sum_to_one_on_random_inputs():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 16, generator=g), torch.randn(32, 16, generator=g)
    for topk in (1, 2, 4, 8):
        weights, idx = route_both(x, w, topk)
        assert (weights > 0).all() and weights.dtype == torch.float32 and idx.dtype == torch.int64
        assert torch.allclose(weights.sum(dim=1), torch.ones(64), rtol=0, atol=1e-6), topk
        assert (weights[:, :-1] >= weights[:, 1:]).all()  # the chosen in descending probability


def library_functions():
    """(module, name) of every function the modules on nn.MoE's path define or import from one another (so that a
function moved to another module is still found under the name its users call)."""
    from flatep import _bootstrap, _tensors, autograd, buffer, distributed, ffn, launch, nn, ops, pools

    modules = (nn, ffn, fp8, buffer, pools, ops, autograd, distributed, launch, _bootstrap, _tensors)
    names = {module.__name__ for module in modules}
    found = []
    for module in modules:
        for name, value in vars(module).items():
            if inspect.isfunction(value) and value.__module__ in names:
                found.append((module, name))
    return found


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_dense_reference_calls_no_library_function(activation, monkeypatch):
    functions = library_functions()
    assert len(functions) > 20
    reference = {}
    for fp8_rows in (False, True):
        dense = testing.DenseMoE(128, 8, 4, 2, seed=1, activation=activation, fp8=fp8_rows, shared_ffn=6)
        x = torch.randn(10, 128, generator=torch.Generator().manual_seed(2)).requires_grad_()
        y = dense(x, chunks=[4, 6])
        y.float().square().sum().backward()
        reference[fp8_rows] = (y, x.grad, dense.w1.grad, dense.router_weight.grad)

    def broken(module, name):
        def call(*args, **kwargs):
            raise AssertionError(f"the dense reference called {module.__name__}.{name}")

        return call

    for module, name in functions:
        monkeypatch.setattr(module, name, broken(module, name))
    monkeypatch.setattr(testing, "_C", None)  # nor the C++ extension
    for fp8_rows in (False, True):
        dense = testing.DenseMoE(128, 8, 4, 2, seed=1, activation=activation, fp8=fp8_rows, shared_ffn=6)
        x = torch.randn(10, 128, generator=torch.Generator().manual_seed(2)).requires_grad_()
        y = dense(x, chunks=[4, 6])
        y.float().square().sum().backward()
        for got, want in zip((y, x.grad, dense.w1.grad, dense.router_weight.grad), reference[fp8_rows]):
            assert torch.equal(got, want)


def sweep_rows():
    """bf16 rows [n, 256] over the whole range: random magnitudes from 2^-130 to 2^120 per block, exact e4m3 ties,
    zero blocks, blocks of tiny values (subnormal scales, inverse overflowing fp32), NaN and Inf."""
    g = torch.Generator().manual_seed(7)
    n = 512
    x = torch.randn(n, 256, generator=g) * torch.pow(2.0, torch.randint(-130, 121, (n, 2, 1), generator=g).float()
                                                     ).expand(n, 2, 128).reshape(n, 256)
    x = x.to(BF16)
    # Ties: amax 448 (inverse 1), values halfway between e4m3 neighbours (1.0625 between 1 and 1.125, 0.5 * 2^-9).
    x[0, :128] = 0
    x[0, 0], x[0, 1], x[0, 2], x[0, 3], x[0, 4] = 448, 1.0625, -1.1875, 2.0**-10, 3 * 2.0**-10
    x[1, :128] = 0  # a block of zeros
    x[2, :128] = 2.0**-133  # bf16 subnormals: the inverse overflows fp32
    x[3, 5], x[3, 6], x[3, 7] = float("nan"), float("inf"), float("-inf")
    x[4, 128:] = -0.0
    return x


def test_dense_fp8_round_trip_equals_the_bit_rule():
    x = sweep_rows()
    want = fp8.dequantize(*fp8.quantize(x), dtype=BF16).float()
    got = testing.fp8_round_trip(x.float())
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert nan.sum().item() >= 1
    bits_got, bits_want = got[~nan].view(torch.int32), want[~nan].view(torch.int32)
    bad = (bits_got != bits_want).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} values differ, first at {bad[0].item()}: got {got[~nan][bad[0]].item()}"
    # Spot values by hand: 448 -> 448 (scale 1); 1.0625 ties to 1 (even code), -1.1875 to -1.25; 2^-10 (half of
    # the smallest subnormal 2^-9) ties to 0, 3 * 2^-10 to 2 * 2^-9.
    assert got[0, :5].tolist() == [448.0, 1.0, -1.25, 0.0, 2.0**-8]
    assert got[1, :128].eq(0).all()
    assert torch.equal(got[4, 128:].view(torch.int32), x[4, 128:].float().view(torch.int32))  # -0 stays -0


def test_dense_init_is_the_layers_and_one_rank_gives_its_output():
    flatep.testing.release_all()
    H, FFN, E, K, S = 16, 8, 4, 2, 12
    for activation in ("swiglu", "silu"):
        moe = flatep.nn.MoE(H, FFN, E, K, num_tokens=S, align=1, seed=5, activation=activation, shared_ffn=4)
        dense = testing.DenseMoE(H, FFN, E, K, seed=5, activation=activation, shared_ffn=4)
        assert torch.equal(moe.router.weight, dense.router_weight)
        assert torch.equal(moe.w1.float(), dense.w1.to(BF16).float())
        assert torch.equal(moe.w2.float(), dense.w2.to(BF16).float())
        assert torch.equal(moe.shared_w1, dense.shared_w1) and torch.equal(moe.shared_w2, dense.shared_w2)
        x = torch.randn(S, H, generator=torch.Generator().manual_seed(9))
        got, want = moe(x), dense(x)
        assert ((got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs().max()).all(), activation
    flatep.testing.release_all()
