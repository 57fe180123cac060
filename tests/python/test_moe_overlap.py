"""nn.MoE's overlap (issue 20, item 2): the shared expert (MoE(shared_ffn=F_s): a dense FFN on every token, added to
the routed output, computed on the compute stream while plan + dispatch run on the Buffer's comm_stream) and the
micro-batch pipeline (MoE.forward_microbatches: the dispatch of micro-batch i+1 during the expert GEMMs of i, the
combine of i during the shared expert and GEMMs of i+1).

CPU backend (virtual ranks; no streams, every op synchronous, run in the schedule's order):
* the shared expert against flatep.testing.DenseMoE(shared_ffn=...) forward and backward (output, input gradient,
  router and shared-expert gradients summed over ranks, both projections' main_grad), both activations, bf16
  tolerance as test_moe_activation.py;
* overlap=True against overlap=False (the serial path), bitwise;
* forward_microbatches bitwise equal to calling the layer on the micro-batches one after the other: outputs, input
  gradients, router and shared-expert .grad, main_grad, on 2 and 4 ranks, with and without a shared expert, equal and
  unequal micro-batch sizes;
* the arguments' checks.
GPU (marker cuda; skipped without one): the same comparisons on virtual ranks of one GPU, overlapped (comm_stream)
against serial (current stream), bitwise, in a process of its own with CUDA_MODULE_LOADING=EAGER (see
step_graph_cases.run_virtual for why), each rank's forward and backward on a thread of its own, with no warm-up of
the layer's kernels (FlatEP's ops meet on the host first). It caught the backward of every rank run on torch's one
autograd thread of the device: its first GEMM of a kind waited for a rank's collective kernel, which waited for a
peer that thread had yet to enqueue (a hang until the timeout; flatep.virtual now runs a rank's backward on it).

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_moe_overlap.py
"""

import json

import pytest
import torch

import flatep
import mp_cases
from flatep import testing, virtual

S, H, FFN, E, K, SHARED = 24, 16, 12, 8, 2, 20
BF16_TOL = 2.0**-6  # as test_moe_activation.py: relative to the reference's largest magnitude
CUDA_SKIP = mp_cases.cuda_unavailable_reason()


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max()).item()


def build(R, shared_ffn=SHARED, seed=4, activation="swiglu", device=None, **kw):
    ranks = virtual.virtual_ranks(R, device) if device is not None else virtual.virtual_ranks(R)
    return virtual.run_threads(
        R, lambda r: flatep.nn.MoE(H, FFN, E, K, group=ranks[r], num_tokens=S, align=1, seed=seed,
                                   activation=activation, shared_ffn=shared_ffn, device=device, **kw)
    )


def inputs(R, sizes, seed=3):
    """Per rank, per micro-batch: x [s, H] fp32 (leaf, requires grad), topk_idx [s, K], output gradient [s, H]."""
    g = torch.Generator().manual_seed(seed)
    xs = [[torch.randn(s, H, generator=g) for s in sizes] for _ in range(R)]
    gouts = [[torch.randn(s, H, generator=g) for s in sizes] for _ in range(R)]
    idx = [[testing.sample_topk(E, s, K, R * m + r, sigma=1.5, seed=2).long() for m, s in enumerate(sizes)]
           for r in range(R)]
    return xs, idx, gouts


def step(moes, xs, idx, gouts, pipelined):
    """Forward and backward of every rank's micro-batches; returns per rank every result that must match."""
    R = len(moes)
    for m in moes:
        m.zero_main_grad()
        for p in m.replicated_parameters():
            p.grad = None
    leaves = [[x.clone().requires_grad_() for x in xs[r]] for r in range(R)]

    def run(r):
        m = moes[r]
        if pipelined:
            outs = m.forward_microbatches(leaves[r], idx[r])
        else:
            outs = [m(x, i) for x, i in zip(leaves[r], idx[r])]
        sum((o.float() * g).sum() for o, g in zip(outs, gouts[r])).backward()
        return outs

    outs = virtual.run_threads(R, run)
    results = []
    for r, m in enumerate(moes):
        res = {f"out{i}": o.detach().clone() for i, o in enumerate(outs[r])}
        res.update({f"grad_x{i}": x.grad.clone() for i, x in enumerate(leaves[r])})
        res["w1.main_grad"], res["w2.main_grad"] = m.w1.main_grad.clone(), m.w2.main_grad.clone()
        for name, p in m.named_parameters():
            if p.grad is not None:
                res[name + ".grad"] = p.grad.clone()
        results.append(res)
    return results


def assert_bitwise(got, want):
    for r, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"rank {r}: {sorted(g)} != {sorted(w)}"
        for key in w:
            assert g[key].dtype == w[key].dtype and torch.equal(g[key], w[key]), f"rank {r}: {key} differs"


# ---- shared expert ----


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_shared_expert_matches_dense_reference_forward_and_backward(activation):
    testing.release_all()
    R = 2
    moes = build(R, activation=activation)
    cols = 2 * SHARED if activation == "swiglu" else SHARED
    assert moes[0].shared_w1.shape == (H, cols) and moes[0].shared_w2.shape == (SHARED, H)
    assert moes[0].shared_w1.dtype == torch.float32
    assert moes[0].replicated_parameters()[1:] == [moes[0].shared_w1, moes[0].shared_w2]
    xs, idx, gouts = inputs(R, [S])
    res = step(moes, xs, idx, gouts, pipelined=False)
    assert moes[0].last_plan.stats["replicas"] >= 1
    dense = testing.DenseMoE(H, FFN, E, K, seed=4, activation=activation, shared_ffn=SHARED)
    x = torch.cat([xs[r][0] for r in range(R)]).requires_grad_()
    ref = dense(x, torch.cat([idx[r][0] for r in range(R)]), chunks=[S] * R)
    (ref.float() * torch.cat([gouts[r][0] for r in range(R)])).sum().backward()
    for name in ("router.weight", "shared_w1", "shared_w2"):  # replicated: the sum over ranks
        total = sum(res[r][name + ".grad"] for r in range(R))
        want = dense.router_weight.grad if name == "router.weight" else getattr(dense, name).grad
        assert rel_err(total, want) < BF16_TOL, name
    for r, m in enumerate(moes):
        rows, lo, hi = slice(r * S, (r + 1) * S), r * (E // R), (r + 1) * (E // R)
        assert rel_err(res[r]["out0"], ref[rows]) < BF16_TOL, f"rank {r}: out"
        assert rel_err(res[r]["grad_x0"], x.grad[rows]) < BF16_TOL, f"rank {r}: grad x"
        assert rel_err(res[r]["w1.main_grad"], dense.w1.grad[lo:hi]) < BF16_TOL, f"rank {r}: w1 main_grad"
        assert rel_err(res[r]["w2.main_grad"], dense.w2.grad[lo:hi]) < BF16_TOL, f"rank {r}: w2 main_grad"
    # the shared expert is there: without it the output is another one
    plain = testing.DenseMoE(H, FFN, E, K, seed=4, activation=activation)
    assert rel_err(plain(x.detach(), torch.cat([idx[r][0] for r in range(R)]), chunks=[S] * R), ref) > 0.05
    testing.release_all()


def test_shared_expert_overlapped_is_bitwise_the_serial_path():
    testing.release_all()
    R = 2
    moes = build(R)
    xs, idx, gouts = inputs(R, [S])
    overlapped = step(moes, xs, idx, gouts, pipelined=False)
    for m in moes:
        m.overlap = False
    serial = step(moes, xs, idx, gouts, pipelined=False)
    assert_bitwise(overlapped, serial)
    testing.release_all()


def test_load_dense_copies_the_shared_expert_and_checks_it():
    testing.release_all()
    dense = testing.DenseMoE(H, FFN, E, K, seed=9, shared_ffn=SHARED)
    moe = flatep.nn.MoE(H, FFN, E, K, num_tokens=S, seed=1, shared_ffn=SHARED)
    moe.load_dense(dense)
    assert torch.equal(moe.shared_w1, dense.shared_w1) and torch.equal(moe.shared_w2, dense.shared_w2)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(5))
    assert rel_err(moe(x), dense(x)) < BF16_TOL
    assert "shared_w1" in moe.state_dict() and "shared_ffn=20" in repr(moe)
    with pytest.raises(ValueError, match="shared_ffn is None, this layer's 20"):
        moe.load_dense(testing.DenseMoE(H, FFN, E, K))
    testing.release_all()


def test_fp8_layer_with_a_shared_expert_runs_the_serial_path():
    testing.release_all()
    h = 128
    moe = flatep.nn.MoE(h, FFN, E, K, num_tokens=S, seed=2, shared_ffn=SHARED, fp8=True)
    dense = testing.DenseMoE(h, FFN, E, K, seed=2, shared_ffn=SHARED, fp8=True)
    x = torch.randn(S, h, generator=torch.Generator().manual_seed(6))
    assert rel_err(moe(x), dense(x)) < BF16_TOL
    outs = moe.forward_microbatches([x[:10], x[10:]])
    assert torch.equal(torch.cat(outs), torch.cat([moe(x[:10]), moe(x[10:])]))
    testing.release_all()


# ---- micro-batches ----


@pytest.mark.parametrize("R, shared_ffn, sizes", [
    (2, SHARED, [S, S]),
    (2, None, [S, S]),
    (4, SHARED, [S, 17]),
    (4, None, [9, S]),
])
def test_microbatches_are_bitwise_the_micro_batches_one_after_the_other(R, shared_ffn, sizes):
    testing.release_all()
    moes = build(R, shared_ffn=shared_ffn)
    xs, idx, gouts = inputs(R, sizes)
    serial = step(moes, xs, idx, gouts, pipelined=False)
    last = moes[0].last_plan.generation  # the serial loop's second plan
    pipelined = step(moes, xs, idx, gouts, pipelined=True)
    assert_bitwise(pipelined, serial)
    assert len(moes[0].last_plans) == 2 and moes[0].last_plan is moes[0].last_plans[-1]
    assert [p.generation - last for p in moes[0].last_plans] == [1, 2]  # one plan each, in order
    for m in moes:  # overlap=False: the plain loop, the same bits
        m.overlap = False
    assert_bitwise(step(moes, xs, idx, gouts, pipelined=True), serial)
    testing.release_all()


def test_three_microbatches_forward_is_bitwise_the_loop():
    testing.release_all()
    R = 2
    moes = build(R)
    xs, idx, _ = inputs(R, [S, 11, S])
    with torch.no_grad():
        loop = virtual.run_threads(R, lambda r: [moes[r](x, i) for x, i in zip(xs[r], idx[r])])
        piped = virtual.run_threads(R, lambda r: moes[r].forward_microbatches(xs[r], idx[r]))
    for r in range(R):
        for a, b in zip(piped[r], loop[r]):
            assert torch.equal(a, b)
    testing.release_all()


def test_microbatch_and_shared_expert_arguments_are_checked():
    testing.release_all()
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="MoE: shared_ffn must be"):
            flatep.nn.MoE(H, FFN, E, K, num_tokens=S, shared_ffn=bad)
    with pytest.raises(ValueError, match="MoE: overlap must be a bool"):
        flatep.nn.MoE(H, FFN, E, K, num_tokens=S, overlap=1)
    moe = flatep.nn.MoE(H, FFN, E, K, num_tokens=S)
    assert moe.shared_ffn is None and moe.shared_w1 is None and moe.overlap is True
    assert moe.replicated_parameters() == [moe.router.weight]
    x = torch.randn(S, H)
    for bad in ([], x, None):
        with pytest.raises(ValueError, match="xs must be a non-empty list"):
            moe.forward_microbatches(bad)
    with pytest.raises(ValueError, match="topk_idx has 1 items for 2 micro-batches"):
        moe.forward_microbatches([x, x], [None])
    with pytest.raises(ValueError, match=r"xs\[1\] must be a \[s, H=16\] tensor"):
        moe.forward_microbatches([x, x[:, :8]])
    one = moe.forward_microbatches([x])
    assert len(one) == 1 and torch.equal(one[0], moe(x))
    testing.release_all()


# ---- GPU: overlapped against serial, bitwise, on virtual ranks of one GPU ----

GPU_R, GPU_S, GPU_H, GPU_F, GPU_E, GPU_K, GPU_SHARED = 2, 256, 256, 128, 8, 2, 192


def run_gpu_case(rank, world_size, out_path):
    """Both modes (shared expert alone; two micro-batches with a shared expert), overlapped and serial, forward and
    backward, on GPU_R virtual ranks of cuda:0 driven by one host thread (each rank on its own stream); writes the
    mismatches (none expected) as JSON to out_path. CUDA_MODULE_LOADING=EAGER comes from the test, in the process's
    environment from its start: setting it here would be too late, since importing this module (CUDA_SKIP) has
    started the driver."""
    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(GPU_R, device, timeout_s=60)
    moes = virtual.run_threads(GPU_R, lambda r: flatep.nn.MoE(
        GPU_H, GPU_F, GPU_E, GPU_K, group=group[r], num_tokens=GPU_S, align=8, seed=3, device=device,
        shared_ffn=GPU_SHARED))
    for m in moes:  # every rank's communication kernels co-resident, the GEMMs on the rest
        m.buffer.num_sms = m.pools.num_sms = 8
    streams = [torch.cuda.Stream(device) for _ in range(GPU_R)]
    g = torch.Generator().manual_seed(11)
    sizes = [GPU_S // 2, GPU_S // 2]
    xs = [[torch.randn(s, GPU_H, generator=g).to(device) for s in sizes] for _ in range(GPU_R)]
    gouts = [[torch.randn(s, GPU_H, generator=g).to(device) for s in sizes] for _ in range(GPU_R)]

    def once(pipelined, overlap):
        for m in moes:
            m.overlap = overlap
            m.zero_main_grad()
            for p in m.replicated_parameters():
                p.grad = None
        leaves = [[x.clone().requires_grad_() for x in xs[r]] for r in range(GPU_R)]
        torch.cuda.synchronize()
        def step(r):  # a thread per rank (a library's first use of a kernel may block its thread), own stream
            with torch.cuda.stream(streams[r]):
                out = moes[r].forward_microbatches(leaves[r]) if pipelined else [moes[r](torch.cat(leaves[r]))]
                gs = gouts[r] if pipelined else [torch.cat(gouts[r])]
                sum((o.float() * gg).sum() for o, gg in zip(out, gs)).backward()
                return out

        outs = virtual.run_threads(GPU_R, step)
        torch.cuda.synchronize()
        res = []
        for r, m in enumerate(moes):
            d = {f"out{i}": o.detach().cpu() for i, o in enumerate(outs[r])}
            d.update({f"grad_x{i}": x.grad.cpu() for i, x in enumerate(leaves[r])})
            d["w1.main_grad"], d["w2.main_grad"] = m.w1.main_grad.cpu(), m.w2.main_grad.cpu()
            d.update({n + ".grad": p.grad.cpu() for n, p in m.named_parameters() if p.grad is not None})
            res.append(d)
        return res

    errors = []
    for pipelined in (False, True):
        once(pipelined, False)  # warm-up
        serial = once(pipelined, False)
        for trial in range(2):
            overlapped = once(pipelined, True)
            for r in range(GPU_R):
                for key, want in serial[r].items():
                    if not torch.equal(overlapped[r][key], want):
                        errors.append(f"pipelined={pipelined} trial {trial} rank {r}: {key} differs")
    for m in moes:
        m.buffer.check_status()
    with open(out_path, "w") as f:
        json.dump(errors, f)


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_overlapped_is_bitwise_serial_on_virtual_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")  # inherited by the child from its start (run_gpu_case says why)
    out = str(tmp_path / "moe_overlap_gpu.json")
    testing.spawn(run_gpu_case, 1, out)
    with open(out) as f:
        errors = json.load(f)
    assert errors == []
