"""Per-rank bodies of the multi-process tests (module level, so torch.multiprocessing can import them).

Every rank runs every case and compares its share of the results with the dense reference it computes itself;
rank 0 writes all ranks' measurements to a JSON file that the pytest functions check.
"""

import json

import torch
import torch.distributed as dist

import flatep
from flatep.testing import DenseMoE, sample_topk, sigma_for_maxvio

# Small sizes: E/K = 32 leaves room for maxvio up to 31.
S, H, F, E, K = 48, 16, 24, 64, 2


def case_name(case):
    return "-".join(f"{k}{v}" for k, v in sorted(case.items()))


def rel_err(a, b):
    """max |a - b| / max |b| (0 when both vanish)."""
    a, b = a.detach().float(), b.detach().float()
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def run_moe_case(rank, R, case):
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
        H, F, E, K, num_tokens=S, align=case["align"], capacity_factor=case["cf"], planner=case["planner"], seed=seed
    )
    x = x_all[mine].clone().requires_grad_()
    out = moe(x, idx_all[rank])
    (out.float() * gout_all[mine]).sum().backward()
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # the router is replicated: its gradient is the sum over ranks

    dense = DenseMoE(H, F, E, K, seed=seed)
    xr = x_all.clone().requires_grad_()
    ref = dense(xr, torch.cat(idx_all), chunks=tokens)
    (ref.float() * gout_all).sum().backward()

    e_lo, e_hi = moe.expert_offset, moe.expert_offset + moe.experts_per_rank
    stats = moe.last_plan.stats
    tpe = moe.last_plan.tpe_all
    return {
        "out": rel_err(out, ref[mine]),
        "grad_x": rel_err(x.grad, xr.grad[mine]),
        "grad_router": rel_err(router_grad, dense.router_weight.grad),
        "grad_w1": rel_err(moe.w1.grad, dense.w1.grad[e_lo:e_hi]),
        "grad_w2": rel_err(moe.w2.grad, dense.w2.grad[e_lo:e_hi]),
        "replicas": stats["replicas"],
        "P": stats["P"],
        "loads": stats["loads"],
        "capacity": moe.buffer.capacity,
        "maxvio": flatep.testing.maxvio(tpe),
    }


def check_errors(rank, R):
    """Bad arguments in a multi-rank world: every rank raises the same ValueError before any collective."""
    messages = {}
    try:
        flatep.Buffer(None, S, H, R + 1, K)
    except ValueError as e:
        messages["E_not_multiple"] = str(e)
    try:
        flatep.nn.MoE(H, F, R + 1, K)
    except ValueError as e:
        messages["moe_E_not_multiple"] = str(e)
    # A plan of one Buffer used with another (same config): rejected locally.
    a = flatep.Buffer(None, S, H, E, K, align=8)
    b = flatep.Buffer(None, S, H, E, K, align=8)
    plan = a.plan(sample_topk(E, S, K, rank, seed=3))
    try:
        b.dispatch(plan, torch.zeros(S, H, dtype=torch.bfloat16))
    except ValueError as e:
        messages["foreign_plan"] = str(e)
    return messages


def main(rank, R, cases, out_path):
    results = {"cases": {}, "errors": None}
    for case in cases:
        results["cases"][case_name(case)] = run_moe_case(rank, R, case)
    results["errors"] = check_errors(rank, R)
    gathered = [None] * R
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
