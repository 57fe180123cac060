"""Per-rank bodies of the multi-process tests (module level, so torch.multiprocessing can import them).

Every rank runs every case on its device ('cpu', or 'cuda': every rank on cuda:0, the processes sharing the GPU) and
compares its share of the results with the dense reference it computes itself on the CPU; rank 0 writes all ranks'
measurements to a JSON file that the pytest functions check.
"""

import contextlib
import json
import os

import torch
import torch.distributed as dist

import flatep
from flatep.testing import DenseMoE, sample_topk, sigma_for_maxvio

# Small sizes: E/K = 32 leaves room for maxvio up to 31.
S, H, F, E, K = 48, 16, 24, 64, 2


def cuda_unavailable_reason():
    """Why the 'cuda' parameters cannot run here (None when they can)."""
    if not flatep._C.has_cuda:
        return "FlatEP was built without CUDA (flatep._C.has_cuda is False)"
    if not torch.cuda.is_available():
        return f"no usable CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


def flatep_env(**extra):
    """os.environ for a child python3 (an example, a benchmark) that imports flatep from where this process does (the
    source package and the compiled extension, ahead of any PYTHONPATH), with `extra` variables set."""
    paths = [os.path.dirname(p) for p in flatep.__path__] + [os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **extra)


def rank_device(name):
    """The torch.device a rank runs on: every rank shares GPU 0 on 'cuda' (processes time-slice it)."""
    if name == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def case_name(case):
    return "-".join(f"{k}{v}" for k, v in sorted(case.items()))


def rel_err(a, b):
    """max |a - b| / max |b| (0 when both vanish), computed on the CPU."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def run_moe_case(rank, R, case, device):
    seed = 100 + int(case["maxvio"] * 10)
    tokens = [S - (r if case.get("ragged") else 0) for r in range(R)]  # ragged: rank r passes S - r tokens
    sigma = sigma_for_maxvio(case["maxvio"], R, E, S, K, seed=seed)
    idx_all = [sample_topk(E, S, K, r, sigma=sigma, seed=seed)[: tokens[r]] for r in range(R)]
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(sum(tokens), H, generator=g)
    gout_all = torch.randn(sum(tokens), H, generator=g)
    lo = sum(tokens[:rank])
    mine = slice(lo, lo + tokens[rank])

    moe = flatep.nn.MoE(
        H, F, E, K, num_tokens=S, align=case["align"], capacity_factor=case["cf"], planner=case["planner"], seed=seed,
        device=device,
    )
    x = x_all[mine].clone().to(device).requires_grad_()
    out = moe(x, idx_all[rank].to(device))
    (out.float() * gout_all[mine].to(device)).sum().backward()
    router_grad = moe.router.weight.grad.detach().cpu().clone()  # gloo: reduce a CPU copy
    dist.all_reduce(router_grad)  # the router is replicated: its gradient is the sum over ranks

    dense = DenseMoE(H, F, E, K, seed=seed)  # the reference always runs on the CPU
    xr = x_all.clone().requires_grad_()
    ref = dense(xr, torch.cat(idx_all), chunks=tokens)
    (ref.float() * gout_all).sum().backward()

    moe.buffer.check_status()  # on a GPU: reports a timed-out wait (naming op and peer) instead of wrong numbers
    e_lo, e_hi = moe.expert_offset, moe.expert_offset + moe.experts_per_rank
    stats = moe.last_plan.stats
    tpe = moe.last_plan.tpe_all
    return {
        "out": rel_err(out, ref[mine]),
        "grad_x": rel_err(x.grad, xr.grad[mine]),
        "grad_router": rel_err(router_grad, dense.router_weight.grad),
        "grad_w1": rel_err(moe.w1.main_grad, dense.w1.grad[e_lo:e_hi]),
        "grad_w2": rel_err(moe.w2.main_grad, dense.w2.grad[e_lo:e_hi]),
        "replicas": stats["replicas"],
        "P": stats["P"],
        "loads": stats["loads"],
        "capacity": moe.buffer.capacity,
        "maxvio": flatep.testing.maxvio(tpe),
    }


# ---- the device backend against the CPU backend (the oracle), bitwise ----

BACKEND_CASES = [
    dict(maxvio=20.0, cf=1.0, align=8, tokens=S, side_stream=False),
    dict(maxvio=5.0, cf=1.25, align=1, tokens=S - 5, side_stream=True),
]


def _bits(t):
    """The tensor's bit patterns on the CPU (bf16 -> int16, fp32 -> int32), so that equality is bitwise."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def first_mismatch(name, oracle, got):
    """None when `got` equals `oracle` bitwise, else one line naming the first differing element."""
    a, b = _bits(oracle), _bits(got)
    if tuple(a.shape) != tuple(b.shape):
        return f"{name}: shape {list(b.shape)}, expected {list(a.shape)}"
    diff = (a != b).nonzero()
    if diff.shape[0] == 0:
        return None
    at = tuple(diff[0].tolist())
    return (
        f"{name}: {diff.shape[0]} of {a.numel()} elements differ, first at {list(at)}: "
        f"{got.detach().cpu()[at].item()!r} (bits {b[at].item()}) vs CPU backend {oracle.detach().cpu()[at].item()!r} "
        f"(bits {a[at].item()})"
    )


def _run_backend(buffer, pools, layer, idx, x, w, y, row_values, weights, grads):
    """One step of every op on (buffer, pools): returns the outputs as CPU tensors (plan arrays included)."""
    device = buffer.device
    with torch.no_grad():
        for p in range(2):
            layer.own_weights(p).copy_(weights[p])
            layer.grads(p).copy_(grads[p])
    plan = buffer.plan(idx.to(device))
    recv_x, recv_w, cu = buffer.dispatch(plan, x.to(device), w.to(device))
    end = int(cu[-1])  # rows past the last group end are unspecified (not written): compare the defined ones
    out = {
        "cu_seqlens": cu.cpu(),
        "slot_expert": plan.slot_expert.cpu(),
        "recv_x": recv_x[:end].cpu(),
        "recv_w": recv_w[:end].cpu(),
        "combine_weighted": buffer.combine(plan, y.to(device), recv_w).cpu(),
        "combine_unweighted": buffer.combine(plan, y.to(device)).cpu(),
        "entry_values": buffer.entry_values(plan, row_values.to(device)).cpu(),
    }
    grad_y, grad_weights = buffer._combine_grad_raw(plan, recv_x, y.to(device), recv_w)
    out["combine_grad_y"], out["combine_grad_weights"] = grad_y.cpu(), grad_weights.cpu()
    pools.prefetch(plan, layer)
    for p in range(2):
        out[f"weights_view{p}"] = layer.weights(p).cpu().clone()  # own experts and the slots prefetch filled
    pools.reduce_grad(plan, layer)
    for p in range(2):
        # A snapshot: on the CPU backend .cpu() would return the live view, which write_grads changes next.
        out[f"grads_view{p}"] = layer.grads(p).cpu().clone()  # owners' sums and zeroed consumed slots
    for p in range(2):  # a bf16 GEMM gradient into the views: own groups and used slots written, the rest kept
        pools.write_grads(plan, layer, p, grads[p].to(torch.bfloat16).to(device))
        out[f"write_grads_view{p}"] = layer.grads(p).cpu().clone()
    for name in ("tpe_all", "alloc", "entry_ranks", "entry_rows"):  # host copies of the plan (diagnostics)
        out[name] = getattr(plan, name)
    out["slot_expert_all"] = torch.stack([plan.slot_expert_of(r) for r in range(buffer.num_ranks)])
    out["loads"] = torch.tensor(plan.stats["loads"])
    out["replicas"] = plan.stats["replicas"]
    return out


def check_backends(rank, R, device):
    """Runs plan, dispatch, both combines, combine_grad, entry_values, prefetch, reduce_grad and write_grads on `device`
    and on the CPU backend with the same inputs; returns {'mismatches': [one line per differing output], 'replicas':
    [per case]}. On a GPU the second case runs on a side stream (the ops must follow torch.cuda.current_stream). On the
    CPU this checks determinism: two Buffers, the same bits."""
    report = {"mismatches": [], "replicas": []}
    epn = E // R
    for c in BACKEND_CASES:
        seed = 7 + int(c["maxvio"])
        sigma = sigma_for_maxvio(c["maxvio"], R, E, S, K, seed=seed)
        idx = sample_topk(E, S, K, rank, sigma=sigma, seed=seed)[: c["tokens"]]
        g = torch.Generator().manual_seed(seed * 31 + rank)
        x = torch.randn(c["tokens"], H, generator=g).to(torch.bfloat16)
        w = torch.rand(c["tokens"], K, generator=g)
        weights = [(torch.randn(epn, *shape, generator=g) / 4).to(torch.bfloat16) for shape in ((H, F), (F, H))]
        grads = [torch.randn(2 * epn, *shape, generator=g) for shape in ((H, F), (F, H))]

        results = []
        for dev in (torch.device("cpu"), device):
            buffer = flatep.Buffer(None, S, H, E, K, align=c["align"], capacity_factor=c["cf"], device=dev)
            pools = flatep.ExpertPools(None, epn, [(H, F), (F, H)], device=dev)
            layer = pools.register_layer()
            rows = buffer.num_recv_rows
            y = torch.randn(rows, H, generator=torch.Generator().manual_seed(seed + rank)).to(torch.bfloat16)
            row_values = torch.randn(rows, generator=torch.Generator().manual_seed(seed + 1000 + rank))
            side = c["side_stream"] and dev.type == "cuda"
            stream = torch.cuda.Stream(dev) if side else None
            if side:
                stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream) if side else contextlib.nullcontext():
                results.append(_run_backend(buffer, pools, layer, idx, x, w, y, row_values, weights, grads))
            if side:
                torch.cuda.current_stream(dev).wait_stream(stream)
            if dev.type == "cuda":
                buffer.check_status()  # a synchronising point: reports a recorded timeout or bad id
                torch.cuda.synchronize(dev)
        oracle, got = results
        report["replicas"].append(oracle.pop("replicas"))
        if got.pop("replicas") != report["replicas"][-1]:
            report["mismatches"].append(f"{case_name(c)}: plan stats replicas differ")
        for name in oracle:
            line = first_mismatch(name, oracle[name], got[name])
            if line is not None:
                report["mismatches"].append(f"rank {rank} {case_name(c)}: {line}")
    return report


def check_errors(rank, R, device):
    """Bad arguments in a multi-rank world: every rank raises the same ValueError before any collective."""
    messages = {}
    try:
        flatep.Buffer(None, S, H, R + 1, K, device=device)
    except ValueError as e:
        messages["E_not_multiple"] = str(e)
    try:
        flatep.nn.MoE(H, F, R + 1, K, device=device)
    except ValueError as e:
        messages["moe_E_not_multiple"] = str(e)
    # A plan of one Buffer used with another (same config): rejected locally.
    a = flatep.Buffer(None, S, H, E, K, align=8, device=device)
    b = flatep.Buffer(None, S, H, E, K, align=8, device=device)
    plan = a.plan(sample_topk(E, S, K, rank, seed=3).to(device))
    try:
        b.dispatch(plan, torch.zeros(S, H, dtype=torch.bfloat16, device=device))
    except ValueError as e:
        messages["foreign_plan"] = str(e)
    return messages


def main(rank, R, device_name, cases, out_path):
    device = rank_device(device_name)
    results = {"cases": {}, "errors": None, "backends": None}
    for case in cases:
        results["cases"][case_name(case)] = run_moe_case(rank, R, case, device)
    results["backends"] = check_backends(rank, R, device)
    results["errors"] = check_errors(rank, R, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    gathered = [None] * R
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
