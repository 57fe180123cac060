"""nn.MoE's expert parameters are the library's memory (design §5): w1 / w2 are bf16 tensors over the own part of
the ExpertPools compute views, their fp32 gradient is main_grad, the own part of the gradient view. Nothing is copied
into the views in forward or cloned out of them in backward; backward accumulates into main_grad; state_dict
round-trips bitwise and in place; converting the parameters is refused; MainGradOptimizer steps fp32 masters.
CPU backend, two virtual ranks."""

import pytest
import torch

import flatep
from flatep import testing, virtual

R, S, H, F, E, K = 2, 24, 16, 8, 8, 2


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture()
def world():
    testing.release_all()
    ranks = virtual.virtual_ranks(R)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, group=ranks[r], num_tokens=S, align=1, seed=4))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(R * S, H, generator=g)
    idx = [testing.sample_topk(E, S, K, r, sigma=1.5, seed=2).long() for r in range(R)]
    yield moes, x, idx
    testing.release_all()


def run(moes, x, idx, gout=None):
    xs = [x[r * S:(r + 1) * S].clone().requires_grad_() for r in range(R)]
    outs = virtual.run_threads(R, lambda r: moes[r](xs[r], idx[r]))
    if gout is not None:
        virtual.run_threads(R, lambda r: (outs[r].float() * gout[r * S:(r + 1) * S]).sum().backward())
    return outs, xs


def test_parameters_are_the_pools_memory(world):
    moes, _, _ = world
    for m in moes:
        layer, epn = m.expert_layer, m.experts_per_rank
        for p, param in enumerate(m.expert_parameters()):
            assert param.dtype == torch.bfloat16 and param.main_grad.dtype == torch.float32
            assert param.data_ptr() == layer.own_weights(p).data_ptr()
            assert param.main_grad.data_ptr() == layer.own_grads(p).data_ptr()
            assert param.shape == layer.own_weights(p).shape and param.main_grad.shape == param.shape
            # The compute view's own part is the same memory (on the CPU backend through a second mapping).
            assert torch.equal(layer.weights(p)[:epn].view(torch.int16), param.detach().view(torch.int16))
            with torch.no_grad():
                param[0, 0, 0] = 3.0
                param.main_grad[-1, -1, -1] = 5.0
            assert layer.weights(p)[0, 0, 0].item() == 3.0 and layer.grads(p)[epn - 1, -1, -1].item() == 5.0
        assert m.replicated_parameters() == [m.router.weight]


def test_forward_reads_the_parameters_in_place_and_backward_accumulates_into_main_grad(world):
    moes, x, idx = world
    gout = torch.randn(R * S, H, generator=torch.Generator().manual_seed(9))
    dense = testing.DenseMoE(H, F, E, K, seed=4)
    with torch.no_grad():  # a change made in place to a parameter is what the next forward computes with
        for m in moes:
            m.w1.mul_(2)
        dense.w1.mul_(2)
    outs, xs = run(moes, x, idx, gout)
    xr = x.clone().requires_grad_()
    ref = dense(xr, torch.cat(idx), chunks=[S] * R)
    (ref.float() * gout).sum().backward()
    for r, m in enumerate(moes):
        lo, hi = r * (E // R), (r + 1) * (E // R)
        assert rel_err(outs[r], ref[r * S:(r + 1) * S]) < 2e-2, f"rank {r}: out"
        assert m.w1.grad is None and m.w2.grad is None, "expert gradients go to main_grad, not .grad"
        assert rel_err(m.w1.main_grad, dense.w1.grad[lo:hi]) < 2e-2, f"rank {r}: w1 main_grad"
        assert rel_err(m.w2.main_grad, dense.w2.grad[lo:hi]) < 2e-2, f"rank {r}: w2 main_grad"
    first = [[p.main_grad.clone() for p in m.expert_parameters()] for m in moes]
    assert moes[0].last_plan.stats["replicas"] >= 1  # replicas' gradients come back through reduce_grad
    run(moes, x, idx, gout)  # the same micro-batch again: main_grad doubles (one fp32 add per element)
    for r, m in enumerate(moes):
        for p, param in enumerate(m.expert_parameters()):
            torch.testing.assert_close(param.main_grad, 2 * first[r][p], rtol=1e-6, atol=1e-7)
        m.zero_main_grad()
        assert all(not p.main_grad.any() for p in m.expert_parameters())


def test_no_copy_into_the_views_and_no_clone_out_of_them(world):
    dispatch = pytest.importorskip("torch.utils._python_dispatch")
    moes, x, idx = world
    watched = {}
    for m in moes:
        for p in range(2):
            watched[m.expert_layer.own_weights(p).data_ptr()] = "own weights"
            watched[m.expert_layer.own_grads(p).data_ptr()] = "own grads"
    seen = []

    class Watch(dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors and ("copy_" in name or "clone" in name) and tensors[0].data_ptr() in watched:
                seen.append(f"{name} on {watched[tensors[0].data_ptr()]}")
            return func(*args, **(kwargs or {}))

    gout = torch.randn(R * S, H)
    xs = [x[r * S:(r + 1) * S].clone().requires_grad_() for r in range(R)]

    def body(r):  # dispatch modes are per thread: each rank's forward and backward inside its own
        with Watch():
            out = moes[r](xs[r], idx[r])
            (out.float() * gout[r * S:(r + 1) * S]).sum().backward()

    virtual.run_threads(R, body)
    assert seen == [], seen
    assert moes[0].w1.main_grad.any()  # backward did write main_grad


def test_state_dict_round_trips_bitwise_in_place(world):
    moes, x, idx = world
    ranks = [m.group for m in moes]
    others = virtual.run_threads(
        R, lambda r: flatep.nn.MoE(H, F, E, K, group=ranks[r], num_tokens=S, align=1, seed=77)
    )
    for m, o in zip(moes, others):
        assert not torch.equal(m.w1, o.w1)
        ptrs = [p.data_ptr() for p in o.expert_parameters()]
        state = m.state_dict()
        assert state["w1"].dtype == torch.bfloat16
        o.load_state_dict(state)
        assert [p.data_ptr() for p in o.expert_parameters()] == ptrs  # still the library's memory
        for name in ("w1", "w2", "router.weight"):
            assert torch.equal(o.state_dict()[name].view(torch.int16) if o.state_dict()[name].dtype == torch.bfloat16
                               else o.state_dict()[name], state[name].view(torch.int16)
                               if state[name].dtype == torch.bfloat16 else state[name]), name
    a, _ = run(moes, x, idx)
    b, _ = run(others, x, idx)
    for r in range(R):
        assert torch.equal(a[r], b[r]), f"rank {r}: outputs differ after load_state_dict"


def test_converting_the_parameters_is_refused(world):
    moes, x, idx = world
    moes[0].w1.data = moes[0].w1.data.float()
    with pytest.raises(ValueError, match=r"MoE: w1 is no longer the library's expert memory \(it is float32 on cpu"):
        moes[0](x[:S], idx[0])


def test_main_grad_optimizer_steps_fp32_masters_into_the_bf16_memory(world):
    moes, x, idx = world
    gout = torch.randn(R * S, H, generator=torch.Generator().manual_seed(5))
    opts = [flatep.optim.MainGradOptimizer(torch.optim.SGD, m.parameters(), lr=0.5) for m in moes]
    masters0 = [[mm.detach().clone() for mm in o.masters] for o in opts]
    for o in opts:
        o.zero_grad()
    run(moes, x, idx, gout)
    grads = [[p.main_grad.clone() for p in m.expert_parameters()] for m in moes]
    router = [m.router.weight.detach().clone() for m in moes]
    router_grad = [m.router.weight.grad.clone() for m in moes]
    for o in opts:
        o.step()
    for r, (m, o) in enumerate(zip(moes, opts)):
        for p, (param, master) in enumerate(zip(m.expert_parameters(), o.masters)):
            want = masters0[r][p] - 0.5 * grads[r][p]
            assert torch.equal(master.detach(), want), f"rank {r} projection {p}: master"
            assert torch.equal(param.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
            assert param.data_ptr() == m.expert_layer.own_weights(p).data_ptr()
        assert torch.equal(m.router.weight.detach(), router[r] - 0.5 * router_grad[r])
        o.zero_grad()
        assert all(not p.main_grad.any() for p in m.expert_parameters()) and m.router.weight.grad is None
