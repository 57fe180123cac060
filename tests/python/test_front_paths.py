"""Paths of the Python front that no other CPU test took (issue 62's coverage report), each with its outcome: the
torch.distributed bootstrap naming several missing peers of a subgroup by their global ranks, flatep.fp8's refusals of
what is not a tensor, dispatch without routing weights in its zero-copy and FP8 forms, a Plan's cached real_rows, an
adapter's own weights given as the library's memory in another dtype, torchtitan's combine of an experts module that
returned only its groups' rows, nn.MoE's FP8 layer serving and training with the input or the router frozen, a rank
that receives no rows in backward, set_placement before the layer has a Buffer, pools ops without a layer argument,
MainGradOptimizer.zero_grad(set_to_none=False) over a parameter without gradient, and flatep.testing.free_port.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_front_paths.py
"""

import ctypes
import socket

import pytest
import torch
import torch.distributed as dist

import flatep
from flatep import distributed, testing, virtual
from flatep import fp8 as fp8_rule
from flatep._bootstrap import PeerTimeout
from flatep._tensors import tensor_at
from flatep.integrations import ReplicatedExperts, ServingExperts, torchtitan

S, H, E, K = 8, 16, 4, 2
BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("fresh_caches")


def plan_of(buffer, seed=0):
    g = torch.Generator().manual_seed(seed)
    return buffer.plan(torch.randint(0, buffer.num_experts, (buffer.num_tokens, buffer.topk), generator=g))


# ---- the torch.distributed bootstrap over a subgroup, peers missing ----


class _Work:
    def __init__(self, outcome):
        self.outcome = outcome

    def wait(self, timeout=None):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def _fake_gloo_group(monkeypatch, size, outcomes):
    """A gloo subgroup of `size` ranks (this process its rank 0; group rank r is global rank 10 + r) whose peers'
    arrival messages end as `outcomes[peer]`: True (arrived), False (a wait that returns False), or an exception that
    posting ('post') or waiting raises. Returns (group, the global ranks posted to)."""
    group = object()
    posted = []

    def post(tensor, peer_global, group_, tag):
        assert group_ is group and tag == distributed._ARRIVAL_TAG
        posted.append(peer_global)
        outcome = outcomes[peer_global - 10]
        if isinstance(outcome, tuple):  # ("post", error): posting fails at once
            raise outcome[1]
        return _Work(outcome)

    monkeypatch.setattr(dist, "get_rank", lambda g=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: size)
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "gloo")
    monkeypatch.setattr(dist, "get_global_rank", lambda g, r: 10 + r, raising=False)
    monkeypatch.setattr(dist, "irecv", post)
    monkeypatch.setattr(dist, "isend", post)

    def gather(out, obj, group=None):
        out[:] = [obj + bytes([r]) for r in range(size)]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    return group, posted


def test_bootstrap_names_every_missing_peer_of_a_subgroup_by_its_group_rank(monkeypatch):
    outcomes = {
        1: False,  # a backend that reports a timeout by returning False
        2: ("post", RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:1234")),
        3: RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 250ms for recv operation"),
        4: RuntimeError("Connection reset by peer"),
    }
    group, posted = _fake_gloo_group(monkeypatch, 5, outcomes)
    boot = distributed.TorchBootstrap(group, timeout_s=0.25)
    assert (boot.rank(), boot.size()) == (0, 5)
    with pytest.raises(PeerTimeout) as info:
        boot.all_gather(b"x")
    assert str(info.value) == (
        "torch.distributed bootstrap all_gather #0 on rank 0: rank 1, rank 3 did not arrive within 0.25 s; rank 2, "
        "rank 4 left the job (connection closed) without arriving"
    )
    # Posted to the peers' global ranks: a receive and a send each, but one receive for the peer whose post failed.
    assert posted == [11, 11, 12, 13, 13, 14, 14]


@pytest.mark.parametrize("kind", ["timed out", "left"])
def test_bootstrap_names_one_kind_of_missing_peer_alone(monkeypatch, kind):
    """Peers that all stalled, or all left: one clause, the other kind not mentioned (no empty "rank  ... " clause)."""
    if kind == "timed out":
        outcomes = {1: True, 2: RuntimeError("Timed out waiting 500ms for recv operation"), 3: False}
        want = "rank 2, rank 3 did not arrive within 0.5 s"
    else:
        outcomes = {1: RuntimeError("Connection closed by peer"), 2: True, 3: ("post", RuntimeError("reset"))}
        want = "rank 1, rank 3 left the job (connection closed) without arriving"
    group, _ = _fake_gloo_group(monkeypatch, 4, outcomes)
    boot = distributed.TorchBootstrap(group, timeout_s=0.5)
    with pytest.raises(PeerTimeout) as info:
        boot.all_gather(b"x")
    assert str(info.value) == f"torch.distributed bootstrap all_gather #0 on rank 0: {want}"
    with pytest.raises(PeerTimeout, match=r"^torch.distributed bootstrap all_gather #1 on rank 0: "):
        boot.all_gather(b"x")  # the next call counts on


def test_bootstrap_over_a_subgroup_gathers_once_every_peer_arrived(monkeypatch):
    group, posted = _fake_gloo_group(monkeypatch, 3, {1: True, 2: True})
    boot = distributed.TorchBootstrap(group, timeout_s=1.0)
    assert boot.all_gather(b"b") == [b"b\x00", b"b\x01", b"b\x02"]
    assert posted == [11, 11, 12, 12]
    assert distributed._global_rank(None, 3) == 3 and distributed._global_rank(dist.group.WORLD, 3) == 3


# ---- flatep.fp8's refusals ----


def test_fp8_refuses_rows_and_scales_that_are_not_float32_tensors():
    with pytest.raises(ValueError, match=r"^quantize: x must be a torch.Tensor, got list$"):
        fp8_rule.quantize([[1.0] * 128])
    q, scales = fp8_rule.quantize(torch.ones(2, 128, dtype=BF16))
    with pytest.raises(ValueError, match=r"^dequantize: scales must be a float32 tensor, got list$"):
        fp8_rule.dequantize(q, scales.tolist())
    with pytest.raises(ValueError, match=r"^dequantize: scales must be a float32 tensor, got float16$"):
        fp8_rule.dequantize(q, scales.half())
    assert torch.equal(fp8_rule.dequantize(q, scales), torch.ones(2, 128))


# ---- tensors over the library's memory, dispatch without weights, real_rows ----


def test_tensor_at_without_an_owner_reads_the_memory_in_place():
    raw = (ctypes.c_float * 4)(1.0, 2.0, 3.0, 4.0)
    t = tensor_at(ctypes.addressof(raw), (2, 2), torch.float32)
    assert not hasattr(t, "_flatep_owner")
    assert t.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    raw[3] = 9.0  # no copy: the tensor sees the write
    assert t[1, 1].item() == 9.0
    owned = tensor_at(ctypes.addressof(raw), (4,), torch.float32, owner=raw)
    assert owned._flatep_owner is raw


def test_dispatch_without_weights_gives_every_row_weight_1_plain_zero_copy_and_fp8():
    buffer = flatep.Buffer(None, S, 128, E, K, align=1, capacity_factor=2.0)
    plan = plan_of(buffer)
    real = plan.real_rows
    assert 0 < int(real.sum()) < buffer.num_recv_rows
    x = torch.randn(S, 128).to(BF16)
    rows, weights, cu = buffer.dispatch(plan, x)
    view, view_weights, _ = buffer.dispatch(plan, x, zero_copy=True)
    assert torch.equal(view[real], rows[real])  # before the FP8 rows land in the same receive region
    (q, s), fp8_weights, fp8_cu = buffer.dispatch(plan, x, fp8=True)
    for w in (weights, view_weights, fp8_weights):  # rows past the groups are unspecified
        assert w.dtype == torch.float32 and torch.equal(w[real], torch.ones(int(real.sum())))
    assert torch.equal(fp8_cu, cu)
    assert torch.equal(fp8_rule.dequantize(q[real], s[real], BF16),
                       fp8_rule.dequantize(*fp8_rule.quantize(rows[real]), BF16))


def test_real_rows_is_read_once_and_counts_every_entry():
    buffer = flatep.Buffer(None, S, H, E, K, align=1, capacity_factor=2.0)
    plan = plan_of(buffer)
    first = plan.real_rows
    assert plan.real_rows is first  # cached: the second access reads nothing back
    assert first.dtype == torch.bool and first.shape == (buffer.num_recv_rows,)
    assert int(first.sum()) == len({(int(r), int(w)) for r, w in zip(plan.entry_ranks.flatten(),
                                                                     plan.entry_rows.flatten())})


# ---- adapters ----


def test_adapters_convert_own_weights_given_as_their_memory_in_another_dtype():
    """The own weights are skipped only when they are the library's memory in its dtype: a float16 view of that
    memory is read as float16 values and written back rounded to bf16."""
    buffer = flatep.Buffer(None, S, H, E, K, align=1)
    plan = plan_of(buffer)
    experts = ReplicatedExperts(None, E, [(H, 8), (8, H)], copy=False)
    serving = ServingExperts(None, E, [(H, 8), (8, H)], num_slots=1)
    for adapter in (experts, serving):
        own = [adapter.layer.own_weights(p) for p in range(2)]
        for w in own:
            w.fill_(1.0)  # bf16 0x3f80: read as float16, 1.875
        if adapter is serving:
            plan = plan_of(flatep.Buffer(None, S, H, E, K, align=1, pools=serving.pools))
        views = adapter(plan, own[0], own[1].view(torch.float16))
        assert torch.equal(views[0][:E], torch.ones(E, H, 8, dtype=BF16))  # its own memory in bf16: kept
        assert torch.equal(views[1][:E], torch.full((E, 8, H), 1.875, dtype=BF16))  # converted in place
        assert torch.equal(own[1], torch.full((E, 8, H), 1.875, dtype=BF16))


def test_torchtitan_pads_an_experts_output_of_only_its_groups_rows():
    buffer = flatep.Buffer(None, S, H, E, K, align=1, capacity_factor=2.0)
    d = torchtitan.FlatEPTokenDispatcher(buffer)
    x = torch.randn(S, H)
    idx = torch.tensor([[t % E, (t + 1) % E] for t in range(S)])
    rows, sizes, meta = d.dispatch(x, torch.rand(S, K), idx)
    used = int(meta.plan.cu_seqlens[-1])
    assert used == int(sizes.sum()) == S * K < buffer.num_recv_rows  # slack rows past the groups
    full = d.combine(rows, meta, x)
    short = d.combine(rows[:used], meta, x)
    assert torch.equal(short, full)
    assert torch.equal(d.combine(rows[:used] * 0, meta, x), torch.zeros(S, H))


# ---- nn.MoE ----

R2, S2, H2, FFN2, E2 = 2, 12, 128, 16, 4


def test_set_placement_before_the_layer_has_a_buffer_names_how_to_get_one():
    moe = flatep.nn.MoE(H, 8, E, K, planner="static")
    assert moe.buffer is None
    with pytest.raises(ValueError, match=r"^MoE.set_placement: the layer has no Buffer yet \(S unknown\): pass "
                                         r"num_tokens= at construction or call use_planner\('static', num_tokens\) "
                                         r"first$"):
        moe.set_placement([[-1] * E])
    moe.use_planner("static", S)
    moe.set_placement([[-1] * E])  # one rank: every expert at home, no replica
    assert moe.buffer.placement.tolist() == [[-1] * E]


def test_fp8_serving_layer_is_the_fp8_dense_reference():
    moe = flatep.nn.MoE(H2, FFN2, E2, K, num_tokens=S2, num_slots=1, seed=3, fp8=True, align=1)
    assert moe.serving and moe.fp8
    x = torch.randn(S2, H2, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = moe(x)
    want = testing.DenseMoE(H2, FFN2, E2, K, seed=3, fp8=True)(x).detach()
    assert torch.equal(got, want)


def _fp8_step(moe, x, gout, freeze_router, x_grad):
    moe.zero_main_grad()
    moe.router.weight.grad = None
    moe.router.weight.requires_grad_(not freeze_router)
    xi = x.clone().requires_grad_(x_grad)
    out = moe(xi, torch.tensor([[t % E2, (t + 1) % E2] for t in range(S2)]))
    (out.float() * gout).sum().backward()
    return out.detach(), moe.w1.main_grad.clone(), moe.w2.main_grad.clone(), moe.router.weight.grad, xi.grad


def test_fp8_layer_gives_the_same_weight_gradients_with_the_input_or_the_router_frozen():
    moe = flatep.nn.MoE(H2, FFN2, E2, K, num_tokens=S2, seed=3, fp8=True, align=1)
    g = torch.Generator().manual_seed(6)
    x, gout = torch.randn(S2, H2, generator=g), torch.randn(S2, H2, generator=g)
    out, w1, w2, router, grad_x = _fp8_step(moe, x, gout, freeze_router=False, x_grad=True)
    assert router is not None and grad_x is not None and w1.abs().sum() > 0
    frozen = _fp8_step(moe, x, gout, freeze_router=True, x_grad=False)  # neither x nor the weights' gradient
    assert torch.equal(frozen[0], out) and torch.equal(frozen[1], w1) and torch.equal(frozen[2], w2)
    assert frozen[3] is None and frozen[4] is None
    # Experts frozen too, the router trained: backward computes no expert gradient, only the router's.
    moe.w1.requires_grad_(False)
    moe.w2.requires_grad_(False)
    only_router = _fp8_step(moe, x, gout, freeze_router=False, x_grad=False)
    assert torch.equal(only_router[3], router)
    assert not only_router[1].any() and not only_router[2].any()  # main_grad untouched (zeroed before the step)


def test_a_rank_that_receives_no_rows_gives_zero_expert_gradients():
    testing.release_all()
    ranks = virtual.virtual_ranks(R2)
    moes = virtual.run_threads(R2, lambda r: flatep.nn.MoE(H2, FFN2, E2, K, group=ranks[r], num_tokens=S2, align=1,
                                                           seed=3, planner="owner"))
    to_rank0 = torch.tensor([[t % 2, (t + 1) % 2] for t in range(S2)])  # experts 0 and 1: rank 0's only
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(S2, H2, generator=g).requires_grad_() for _ in range(R2)]
    outs = virtual.run_threads(R2, lambda r: moes[r](xs[r], to_rank0))
    virtual.run_threads(R2, lambda r: outs[r].float().sum().backward())
    assert moes[1].last_plan.stats["loads"] == [2 * R2 * S2, 0]
    assert not moes[1].w1.main_grad.any() and not moes[1].w2.main_grad.any()
    assert moes[0].w1.main_grad.abs().sum() > 0 and moes[0].w2.main_grad.abs().sum() > 0
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in xs)
    testing.release_all()


# ---- pools, optimizer, launcher helpers ----


def test_pools_ops_take_the_only_layer_when_none_is_named():
    buffer = flatep.Buffer(None, S, H, E, K, align=1)
    pools = flatep.ExpertPools(None, E, [(H, 8)])
    plan = plan_of(buffer)
    with pytest.raises(ValueError, match=r"^prefetch: layer is required when 0 layers are registered \(not 1\)$"):
        pools.prefetch(plan)
    layer = pools.register_layer()
    layer.own_weights(0).fill_(2.0)
    pools.prefetch(plan)  # the one layer
    pools.register_layer()
    with pytest.raises(ValueError, match=r"^reduce_grad: layer is required when 2 layers are registered \(not 1\)$"):
        pools.reduce_grad(plan)
    pools.reduce_grad(plan, layer)


def test_zero_grad_in_place_leaves_a_parameter_without_gradient_without_one():
    expert = torch.nn.Parameter(torch.ones(2, 2).to(BF16))
    expert.main_grad = torch.ones(2, 2)
    never = torch.nn.Parameter(torch.ones(3))  # no backward reached it
    opt = flatep.optim.MainGradOptimizer(torch.optim.SGD, [expert, never], lr=0.5)
    opt.zero_grad(set_to_none=False)
    assert never.grad is None and not expert.main_grad.any()


def test_free_port_is_a_port_nothing_listens_on():
    port = testing.free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: binds


# ---- argument checks of the EPLB placement helpers, static placements and virtual ranks' collectives ----


def test_eplb_refuses_shapes_and_copies_it_cannot_place():
    from flatep import eplb

    loads = [8, 4, 2, 1]
    with pytest.raises(ValueError, match=r"^pack: num_slots must be an int, got 1.5$"):
        eplb.pack(loads, [1, 1, 1, 1], 2, 1.5)
    with pytest.raises(ValueError, match=r"^pack: num_ranks must be an int, got True$"):
        eplb.pack(loads, [1, 1, 1, 1], True, 1)
    with pytest.raises(ValueError, match=r"^replicate: extra=3 copies do not fit R\*B=2 slots$"):
        eplb.replicate(loads, 2, 3, num_slots=1)
    with pytest.raises(ValueError, match=r"^pack: copies must be E=4 counts in \[1, R=2\] with at most R\*B=2 extra$"):
        eplb.pack(loads, [1, 1, 1], 2, 1)
    with pytest.raises(ValueError, match=r"^pack: copies must be E=4 counts in \[1, R=2\] with at most R\*B=2 extra$"):
        eplb.pack(loads, [3, 1, 1, 1], 2, 1)
    copies = eplb.replicate(loads, 2, 2, num_slots=1)
    # Expert 0's copy takes rank 1's only slot, so expert 1 (rank 0's too) cannot get one: expert 2 does, on rank 0.
    assert copies == [2, 1, 2, 1]
    assert eplb.pack(loads, copies, 2, 1) == [[2], [0]]


def test_static_placement_refuses_ids_beyond_int32():
    buffer = flatep.Buffer(None, S, H, E, K, align=1, planner="static")
    with pytest.raises(ValueError, match=r"^set_placement: placement\[0\]\[2\] = 1099511627776 is not an expert id "
                                         r"\(int32\) or -1 \(empty\)$"):
        buffer.set_placement([[-1, -1, 2**40, -1]])
    buffer.set_placement([[-1] * E])
    assert buffer.placement.tolist() == [[-1] * E]


def test_a_static_layer_reuses_its_buffer_when_it_comes_back_to_a_token_count():
    moe = flatep.nn.MoE(H, 8, E, K, planner="static", num_tokens=S)
    first = moe.buffer
    moe.use_planner("balanced", S)
    assert moe.buffer is not first
    moe.use_planner("static", S)
    assert moe.buffer is first


def test_pools_placement_bytes_and_drifting_popularity_refuse_bad_arguments():
    pools = flatep.ExpertPools(None, E, [(H, 8)])
    with pytest.raises(ValueError,
                       match=r"^placement_bytes: plan must be a flatep.Plan from Buffer.plan\(\), got str$"):
        pools.placement_bytes("plan")
    for args in ((4, 0), (0, 3), (4, 3, 1.0, 0.05, -1)):
        with pytest.raises(ValueError, match=r"^drifting_popularity: num_steps and num_experts must be >= 1 and "
                                             r"shift_every >= 0, got "):
            testing.drifting_popularity(*args)
    assert testing.drifting_popularity(4, 3).shape == (3, 4)


def test_virtual_collectives_refuse_split_sizes_and_tensors_that_do_not_match():
    ranks = virtual.virtual_ranks(2)

    def outcome(fn):
        try:
            return fn()
        except ValueError as e:
            return str(e)

    def on_ranks(fn):
        return virtual.run_threads(2, lambda r: outcome(lambda: fn(r, ranks[r])))

    rows = torch.zeros(4, 2)
    assert on_ranks(lambda r, v: v.all_to_all_single(torch.zeros(4, 2), rows, [2, 2], [2, 1])) == [
        "all_to_all_single: split sizes sum to 3 (input) and 4 (output), the tensors have 4 and 4 rows"] * 2
    assert on_ranks(lambda r, v: v.all_to_all_single(torch.zeros(4, 2), rows, [2, 2], [4])) == [
        "all_to_all_single: input_split_sizes must be 2 non-negative ints, got [4]"] * 2
    assert on_ranks(lambda r, v: v.all_to_all_single(torch.zeros(4, 2), rows, [5, -1], [2, 2])) == [
        "all_to_all_single: output_split_sizes must be 2 non-negative ints, got [5, -1]"] * 2
    got = on_ranks(lambda r, v: v.all_reduce(torch.ones(2 + r)))
    assert got[0] == "virtual rank 0: all_reduce: rank 1's tensor is float32 [3], this rank's float32 [2]"
    assert got[1] == "virtual rank 1: all_reduce: rank 0's tensor is float32 [2], this rank's float32 [3]"
    sums = on_ranks(lambda r, v: v.all_reduce(torch.full((2,), float(r + 1))))
    assert all(torch.equal(t, torch.full((2,), 3.0)) for t in sums)
