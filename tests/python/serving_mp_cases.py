"""Per-rank body of the multi-process serving test (module level, so torch.multiprocessing can import it).

Every rank (a process of its own, joined by gloo) builds flatep.nn.MoE with B replica slots over serving pools, whose
weight view maps every process's own experts in place, runs one prefill step with the balanced planner and decode
steps with the owner planner over the same weights (ragged ranks, one of them empty), and compares its rows with the
dense reference it computes itself on the CPU; rank 0 writes every rank's measurements to a JSON file.
"""

import json

import torch
import torch.distributed as dist

import flatep
from flatep.testing import DenseMoE, sample_topk

S, H, F, E, K = 32, 16, 24, 16, 2
DECODE_S = 4


def rel_err(a, b):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def step(moe, rank, R, counts, seed, device):
    """One inference step with `counts[r]` tokens on rank r: (this rank's error against the dense layer, the
    plan's slot experts, the rows every rank computes, this rank's output shape)."""
    idx_all = [sample_topk(E, S, K, r, sigma=1.5, seed=seed)[: counts[r]] for r in range(R)]
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(sum(counts), H, generator=g)
    lo = sum(counts[:rank])
    mine = slice(lo, lo + counts[rank])
    with torch.no_grad():
        out = moe(x_all[mine].to(device), idx_all[rank].to(device))
        ref = DenseMoE(H, F, E, K, seed=7)(x_all, torch.cat(idx_all), chunks=counts)
    plan = moe.last_plan
    loads = list(plan.stats["loads"])
    err = rel_err(out, ref[mine]) if counts[rank] > 0 else 0.0
    return err, plan.slot_expert.cpu().tolist(), loads, tuple(out.shape)


def main(rank, R, device_name, num_slots, out_path):
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    moe = flatep.nn.MoE(H, F, E, K, num_tokens=S, align=4, seed=7, num_slots=num_slots, device=device)
    pools = moe.pools
    result = {"serving": pools.serving, "view_rows": pools.view_rows if pools.serving else None,
              "view_stride": pools.view_stride, "steps": []}
    prefill = [S if r != 1 else 0 for r in range(R)]  # rank 1 is empty
    result["steps"].append(("balanced", prefill) + step(moe, rank, R, prefill, 11, device))
    moe.use_planner("owner", DECODE_S)
    for t in range(2):
        decode = [(DECODE_S - r - t) % (DECODE_S + 1) for r in range(R)]  # ragged, some ranks empty
        result["steps"].append(("owner", decode) + step(moe, rank, R, decode, 20 + t, device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    gathered = [None] * R
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
