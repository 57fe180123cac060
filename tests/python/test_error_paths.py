"""The less-travelled paths of the Python front, each with its outcome: one-line errors of the framework adapters,
the optimizer, the row kernels' front on the CPU, devices that are not there, a destroyed Buffer, pools of several
layers and of no slot; and what the paths that succeed must give (the optimizer's state round trip, zero_grad
keeping a gradient's memory, forward_microbatches making its Buffer, the adapters' weights written or used in place).
Found by the coverage report (scripts/coverage_ci.sh): branches no test took.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_error_paths.py
"""

from types import SimpleNamespace

import pytest
import torch

import flatep
from flatep import testing, virtual
from flatep.distributed import transport_for
from flatep.integrations import ReplicatedExperts, ServingExperts, megatron, torchtitan, vllm

S, H, E, K = 8, 16, 4, 2
BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("fresh_caches")


def one_line_error(error, call, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def plan_of(buffer, seed=0):
    g = torch.Generator().manual_seed(seed)
    return buffer.plan(torch.randint(0, buffer.num_experts, (buffer.num_tokens, buffer.topk), generator=g))


# ---- adapters ----

def test_replicated_experts_refuse_a_wrong_plan_count_shape_or_pools():
    buffer = flatep.Buffer(None, S, H, E, K, align=1)
    experts = ReplicatedExperts(None, E, [(H, 8), (8, H)])
    plan = plan_of(buffer)
    own = [experts.layer.own_weights(0), experts.layer.own_weights(1)]
    one_line_error(ValueError, lambda: experts("plan", *own), "ReplicatedExperts: plan must be a flatep.Plan, got str")
    one_line_error(ValueError, lambda: experts(plan, own[0]), "expected 2 own weight tensors, got 1")
    one_line_error(ValueError, lambda: experts(plan, own[0], own[0]),
                   r"own weights of projection 1 must have shape \[4, 8, 16\]")
    one_line_error(ValueError, lambda: ReplicatedExperts(None, E, [(H, 8)], pools=experts.pools),
                   r"pools must have epn=4 and projections \[\(16, 8\)\]")


def test_replicated_experts_copy_given_weights_and_take_their_own_in_place():
    buffer = flatep.Buffer(None, S, H, E, K, align=1)
    experts = ReplicatedExperts(None, E, [(H, 8), (8, H)])
    plan = plan_of(buffer)
    given = [torch.randn(E, H, 8), torch.randn(E, 8, H)]  # fp32: rounded to bf16 into the library's memory
    views = experts(plan, *given)
    for p in range(2):
        assert torch.equal(views[p][:E], given[p].to(BF16))
        assert torch.equal(experts.layer.own_weights(p), given[p].to(BF16))
    own = [experts.layer.own_weights(p) for p in range(2)]
    views = experts(plan, *own)  # the memory itself: nothing copied, the same values
    assert all(torch.equal(views[p][:E], own[p]) for p in range(2))


def test_serving_experts_refuse_wrong_arguments_and_write_given_weights():
    epn = E
    experts = ServingExperts(None, epn, [(H, 8), (8, H)], num_slots=1)
    buffer = flatep.Buffer(None, S, H, E, K, align=1, pools=experts.pools)
    plan = plan_of(buffer)
    one_line_error(ValueError, lambda: experts(None), "ServingExperts: plan must be a flatep.Plan, got NoneType")
    one_line_error(ValueError, lambda: experts(plan, torch.zeros(epn, H, 8)), r"expected 2 own weight tensors \(or none\)")
    one_line_error(ValueError, lambda: experts(plan, torch.zeros(epn, H, 8), torch.zeros(epn, H, 8)),
                   r"own weights of projection 1 must have shape \[4, 8, 16\]")
    one_line_error(ValueError, lambda: ServingExperts(None, epn, [(H, 8)], 2, pools=experts.pools),
                   "ServingExperts: pools must be serving pools with epn=4 and num_slots=2")
    given = [torch.randn(epn, H, 8), torch.randn(epn, 8, H)]
    views = experts(plan, *given)
    for p in range(2):
        assert torch.equal(views[p][:epn], given[p].to(BF16))  # rank 0's own experts: view rows [0, epn)


def test_megatron_refuses_tokens_of_another_width_and_a_routing_map_of_another_shape():
    d = megatron.FlatEPTokenDispatcher(flatep.Buffer(None, S, H, E, K, align=1))
    routing_map = torch.zeros(S, E, dtype=torch.bool)
    routing_map[:, :K] = True
    one_line_error(ValueError, lambda: d.dispatch_preprocess(torch.zeros(S, H + 8), routing_map, routing_map.float()),
                   r"tokens must end in H=16, got \[8, 24\]")
    one_line_error(ValueError, lambda: d.dispatch_preprocess(torch.zeros(S, H), routing_map.int(), routing_map.float()),
                   r"routing_map must be a \[T=8, E=4\] bool tensor, got \[8, 4\] torch.int32")


def test_torchtitan_refuses_meshes_and_padding_it_does_not_serve_and_pads_short_outputs():
    buffer = flatep.Buffer(None, S, H, E, K, align=1)
    d = torchtitan.FlatEPTokenDispatcher(buffer)
    one_line_error(NotImplementedError, lambda: d.wire_meshes(tp_mesh=SimpleNamespace(size=lambda: 2)),
                   "sequence-parallel shards")
    one_line_error(ValueError, lambda: d.wire_meshes(ep_mesh=SimpleNamespace(size=lambda: 2)),
                   "ep_mesh has 2 ranks, the Buffer's group 1")
    x = torch.randn(S, H)
    idx = torch.tensor([[t % E, (t + 1) % E] for t in range(S)])
    rows, _, meta = d.dispatch(x, torch.rand(S, K), idx)
    one_line_error(NotImplementedError, lambda: d.combine(rows, meta, x, num_local_tokens_after_padding=S + 1),
                   "padded sequence-parallel shards")
    used = int(meta.plan.cu_seqlens[-1])
    full = d.combine(rows, meta, x)
    short = d.combine(rows[:used], meta, x)  # an experts module that returned only its groups' rows
    assert torch.equal(short, full)


def test_vllm_refuses_router_weights_on_input_with_top2():
    pf = vllm.FlatEPPrepareAndFinalize(flatep.Buffer(None, S, H, E, K, align=1))
    ids = torch.tensor([[t % E, (t + 1) % E] for t in range(S)])
    one_line_error(ValueError, lambda: pf.prepare(torch.randn(S, H).to(BF16), torch.rand(S, K), ids, E, None, True,
                                                  None),
                   "apply_router_weight_on_input needs top-1 routing")


# ---- the optimizer ----

def test_main_grad_optimizer_refuses_a_main_grad_of_another_kind():
    p = torch.nn.Parameter(torch.zeros(4, 4, dtype=BF16))
    p.main_grad = torch.zeros(4, 4, dtype=BF16)
    one_line_error(ValueError, lambda: flatep.optim.MainGradOptimizer(torch.optim.SGD, [p], lr=0.1),
                   r"main_grad must be fp32 of the parameter's shape \[4, 4\], got bfloat16 \[4, 4\]")


def test_main_grad_optimizer_state_round_trip_and_zero_grad_in_place():
    torch.manual_seed(0)
    expert = torch.nn.Parameter(torch.randn(4, 4).to(BF16))
    expert.main_grad = torch.randn(4, 4)
    plain = torch.nn.Parameter(torch.randn(3))
    plain.grad = torch.ones(3)
    opt = flatep.optim.MainGradOptimizer(torch.optim.Adam, [expert, plain], lr=0.1)
    opt.step()
    state = opt.state_dict()
    after_one = (expert.detach().clone(), plain.detach().clone())
    opt.step()
    assert not torch.equal(expert, after_one[0])
    opt.load_state_dict(state)  # back to the state after one step: masters, the parameters from them, Adam's moments
    assert torch.equal(expert, after_one[0]) and torch.equal(opt.masters[0], state["masters"][0])
    assert not torch.equal(opt.masters[0], expert.float())  # the fp32 master, not the bf16 parameter
    one_line_error(ValueError, lambda: opt.load_state_dict({"optimizer": state["optimizer"], "masters": []}),
                   "state has 0 masters, this optimizer 1")
    grad = plain.grad
    opt.zero_grad(set_to_none=False)  # the plain gradient zeroed in its own memory, the main_grad too
    assert plain.grad is grad and not grad.any() and not expert.main_grad.any()
    opt.zero_grad()
    assert plain.grad is None


# ---- devices, kernels' front, a destroyed Buffer ----

def test_devices_that_are_not_there_are_refused():
    one_line_error(ValueError, lambda: transport_for(None, "meta"), "device must be 'cpu' or a CUDA device, got meta")
    if not flatep._C.has_cuda:
        one_line_error(ValueError, lambda: transport_for(None, "cuda"), "needs FlatEP built with CUDA")
        one_line_error(ValueError, lambda: virtual.virtual_ranks(2, "cuda"), "CUDA")


def test_the_row_kernels_front_refuses_cpu_tensors():
    h, y = torch.zeros(4, 16, dtype=BF16), torch.zeros(4, 8, dtype=BF16)
    ends = torch.tensor([2], dtype=torch.int32)
    one_line_error(ValueError, lambda: flatep.ffn.activate_rows(h, ends, "swiglu"),
                   "activate_rows: h must be on a CUDA device, got cpu")
    one_line_error(ValueError, lambda: flatep.ffn.zero_rows_from_end(y, ends),
                   "zero_rows_from_end: y must be on a CUDA device, got cpu")


def test_a_destroyed_buffer_refuses_every_op_and_capacity_factor_must_be_a_number():
    buffer = flatep.Buffer(None, S, H, E, K, align=1)
    plan = plan_of(buffer)
    buffer.destroy()
    for op, call in (("plan", lambda: plan_of(buffer)),
                     ("dispatch", lambda: buffer.dispatch(plan, torch.zeros(S, H, dtype=BF16))),
                     ("check_status", buffer.check_status), ("num_sms", lambda: buffer.num_sms)):
        one_line_error(RuntimeError, call, f"{op}: this Buffer was destroyed")
    one_line_error(ValueError, lambda: flatep.Buffer(None, S, H, E, K, capacity_factor="2"),
                   "Buffer: capacity_factor must be a float, got '2'")


# ---- pools and layers ----

def test_pools_need_a_projection_and_a_layer_when_they_have_several():
    one_line_error(ValueError, lambda: flatep.ExpertPools(None, E, []), "ExpertPools: at least one projection is needed")
    buffer = flatep.Buffer(None, S, H, E, K, align=1)
    pools = flatep.ExpertPools(None, E, [(H, 8)])
    first, second = pools.register_layer(), pools.register_layer()
    plan = plan_of(buffer)
    one_line_error(ValueError, lambda: pools.prefetch(plan), "prefetch: layer is required when 2 layers are registered")
    pools.prefetch(plan, second)
    assert first is not second


def test_serving_pools_of_no_slot_have_an_empty_slot_pool_and_no_gradients():
    pools = flatep.ExpertPools(None, E, [(H, 8)], num_slots=0)
    assert pools.slot_pool(0).shape == (0, H, 8) and pools.reduce_pool(0) is None
    layer = pools.register_layer()
    assert layer.weights(0).shape == (pools.view_rows, H, 8) and pools.view_rows == pools.view_stride


def test_moe_use_planner_needs_num_tokens_and_microbatches_make_the_buffer():
    moe = flatep.nn.MoE(H, 8, E, K, align=1, activation="silu")
    one_line_error(ValueError, lambda: moe.use_planner("owner"), "MoE.use_planner: num_tokens is needed")
    xs = [torch.randn(3, H), torch.randn(5, H)]
    outs = moe.forward_microbatches(xs)
    assert moe.buffer is not None and moe.num_tokens == 5 and [o.shape[0] for o in outs] == [3, 5]
    testing.release_all()
    serving = flatep.nn.MoE(H, 8, E, K, align=1, activation="silu", num_slots=1, num_tokens=S)
    serving.zero_main_grad()  # serving layers have no main_grad: nothing to zero, no error
    assert serving.w1.main_grad is None
