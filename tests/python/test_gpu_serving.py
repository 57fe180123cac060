"""Serving on virtual CUDA ranks (issues 43 and 47), against the CPU backend and as CUDA graphs:

* nn.MoE inference with num_slots B in {0, 1, epn-1, epn} and the owner planner, ragged ranks with an empty one, on
  4 virtual ranks of one GPU and of the CPU backend with the same weights and inputs: the plans (slot_expert, and
  the rows of every expert's group and every slot's, found through view_row since the view stride Q follows each
  backend's mapping granularity) and the prefetched slots' bytes bitwise equal, both outputs within one bf16 ulp of
  the dense reference;
* a whole inference step (router, plan, dispatch, prefetch, grouped GEMM on the [R*Q + B] view, combine) captured
  as one CUDA graph per rank (capture_error_mode "global"), replayed with new tokens and routing, bitwise equal to
  the same step run eagerly; prefill (balanced, B = 1) and decode (owner) graphs over the same layer.

Reproduce on a GPU: python3 -m pytest -q tests/python/test_gpu_serving.py
"""

import pytest
import torch

import mp_cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
R, EPN, S, H, F, K = 4, 4, 64, 128, 64, 2
E = R * EPN
COUNTS = [S, 0, 37, 5]
TOL = 2.0**-7


def rel_err(a, b):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def inputs(counts, seed):
    from flatep import testing

    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, H, generator=g) for s in counts]
    idx = [testing.sample_topk(E, S, K, r, sigma=1.5, seed=seed)[:s].long() for r, s in enumerate(counts)]
    return xs, idx


def serve(device, num_slots, planner, xs, idx):
    """One inference step on R virtual ranks of `device`: (outputs on the CPU, plans, layers)."""
    import flatep
    from flatep import virtual

    ranks = virtual.virtual_ranks(R, device, timeout_s=60)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=8, seed=3,
                                                          num_slots=num_slots, planner=planner, device=device))
    streams = [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in range(R)]

    def run(r):
        with torch.inference_mode():
            if streams[r] is None:
                return moes[r](xs[r], idx[r])
            with torch.cuda.stream(streams[r]):
                out = moes[r](xs[r].to(device), idx[r].to(device))
                streams[r].synchronize()
                return out.cpu()

    return virtual.run_threads(R, run), [m.last_plan for m in moes], moes


def group_rows(plan, pools):
    """{('expert', e): rows, ('slot', j): rows} of this rank's groups (the layout's rows, whatever Q is)."""
    cu = plan.cu_seqlens.cpu().tolist()
    sizes = [cu[0]] + [max(0, b - a) for a, b in zip(cu, cu[1:])]
    rows = {}
    for e in range(E):
        row = pools.view_row(e) if pools.serving else (e % EPN if e // EPN == pools.rank else None)
        if row is not None:
            rows[("expert", e)] = sizes[row]
    first = R * pools.view_stride if pools.serving else EPN
    for j in range(pools.num_slots):
        rows[("slot", j)] = sizes[first + j]
    return rows


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
@pytest.mark.parametrize("num_slots,planner", [(0, "balanced"), (1, "balanced"), (EPN - 1, "balanced"),
                                               (EPN, "balanced"), (1, "owner")])
def test_serving_on_virtual_cuda_ranks_equals_the_cpu_backend(num_slots, planner):
    from flatep import testing

    xs, idx = inputs(COUNTS, 7)
    results = {}
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        testing.release_all()
        outs, plans, moes = serve(device, num_slots, planner, xs, idx)
        layers = [m.expert_layer for m in moes]
        slots = []
        for r in range(R):
            pools = moes[r].pools
            first = R * pools.view_stride if pools.serving else EPN
            slots.append([layers[r].weights(p)[first:first + pools.num_slots].cpu().view(torch.int16).clone()
                          for p in range(2)])
        results[device.type] = (outs, [p.slot_expert.cpu().clone() for p in plans],
                                [group_rows(p, m.pools) for p, m in zip(plans, moes)], slots)
    testing.release_all()
    (cpu_out, cpu_se, cpu_rows, cpu_slots), (gpu_out, gpu_se, gpu_rows, gpu_slots) = results["cpu"], results["cuda"]
    ref = testing.DenseMoE(H, F, E, K, seed=3)(torch.cat(xs), torch.cat(idx), chunks=COUNTS)
    for r in range(R):
        assert torch.equal(cpu_se[r], gpu_se[r]), f"rank {r}: slot_expert"
        assert cpu_rows[r] == gpu_rows[r], f"rank {r}: group rows"
        for p in range(2):
            used = cpu_se[r][:num_slots] >= 0
            assert torch.equal(cpu_slots[r][p][used], gpu_slots[r][p][used]), f"rank {r} projection {p}: slots"
        assert int((cpu_se[r] >= 0).sum()) <= num_slots
    assert rel_err(torch.cat(cpu_out), ref) < TOL and rel_err(torch.cat(gpu_out), ref) < TOL


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_inference_step_replays_as_one_cuda_graph_per_rank_bitwise():
    import flatep
    from flatep import testing, virtual

    device = torch.device("cuda", 0)
    ranks = virtual.virtual_ranks(R, device, timeout_s=60)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=8, seed=3,
                                                          num_slots=1, device=device))
    decode_s = 8
    streams = [torch.cuda.Stream(device) for _ in range(R)]
    for planner, s_max in (("balanced", S), ("owner", decode_s)):
        virtual.run_threads(R, lambda r: moes[r].use_planner(planner, s_max))
        counts = [s_max, 0, s_max // 2, 1]
        x = [torch.zeros(c, H, device=device) for c in counts]
        idx = [torch.zeros(c, K, dtype=torch.int64, device=device) for c in counts]

        def write_inputs(trial):
            xs, ids = inputs(counts, 100 * trial + s_max)
            for r in range(R):
                x[r].copy_(xs[r])
                idx[r].copy_(ids[r])
            torch.cuda.synchronize()

        def eager():
            outs = []
            for r in range(R):  # one thread enqueues every rank's step (no op of the step blocks the host)
                with torch.cuda.stream(streams[r]), torch.inference_mode():
                    outs.append(moes[r](x[r], idx[r]))
            torch.cuda.synchronize()
            return [o.clone() for o in outs]

        write_inputs(0)
        eager()  # warm-up outside capture
        graphs, static = [], []
        for r in range(R):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=streams[r], capture_error_mode="global"), torch.no_grad():
                static.append(moes[r](x[r], idx[r]))
            graphs.append(graph)
        torch.cuda.synchronize()
        for trial in range(1, 6):
            write_inputs(trial)
            for r in range(R):
                with torch.cuda.stream(streams[r]):
                    graphs[r].replay()
            torch.cuda.synchronize()
            replayed = [o.clone() for o in static]
            want = eager()
            for r in range(R):
                assert torch.equal(replayed[r].view(torch.int16), want[r].view(torch.int16)), (
                    f"{planner} trial {trial} rank {r}: the replayed step differs from the eager one")
        ref = testing.DenseMoE(H, F, E, K, seed=3)(torch.cat([t.cpu() for t in x]), torch.cat([t.cpu() for t in idx]),
                                                   chunks=counts)
        assert rel_err(torch.cat(want), ref) < TOL, planner
    testing.release_all()


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_training_layout_inference_is_its_autograd_forward_bitwise(device_type, monkeypatch):
    """nn.MoE in the training layout (B = epn) under torch.no_grad() takes the serving FFN (no autograd graph; on a
    GPU the activation and zeroing kernels bounded by the last group end), and its output is bitwise the forward that
    records autograd, on ragged ranks with an empty one."""
    if device_type == "cuda" and CUDA_SKIP is not None:
        pytest.skip(f"cuda: {CUDA_SKIP}")
    import flatep
    from flatep import testing, virtual

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    calls = []
    real = flatep.nn.serving_experts
    monkeypatch.setattr(flatep.nn, "serving_experts", lambda *a: calls.append(1) or real(*a))
    xs, idx = inputs(COUNTS, 11)
    ranks = virtual.virtual_ranks(R, device, timeout_s=60)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(H, F, E, K, ranks[r], num_tokens=S, align=8, seed=3,
                                                          device=device))
    streams = [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in range(R)]

    def run(r, grad):
        with torch.enable_grad() if grad else torch.no_grad():
            x = xs[r].to(device).requires_grad_(grad)
            if streams[r] is None:
                return moes[r](x, idx[r]).detach().clone()
            with torch.cuda.stream(streams[r]):
                out = moes[r](x, idx[r].to(device)).detach().cpu()
                streams[r].synchronize()
                return out

    recorded = virtual.run_threads(R, lambda r: run(r, True))
    assert not calls, "the forward that records autograd must keep the autograd function"
    inference = virtual.run_threads(R, lambda r: run(r, False))
    testing.release_all()
    assert len(calls) == R, "no_grad: every rank's experts through serving_experts"
    for r in range(R):
        assert torch.equal(recorded[r].view(torch.int16), inference[r].view(torch.int16)), f"rank {r}"
    assert any(o.shape[0] > 0 and o.abs().max() > 0 for o in inference)
