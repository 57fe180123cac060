"""Per-rank body of the multi-process static-planner test (module level, so torch.multiprocessing can import it).

Every rank (a process of its own, joined by gloo) builds flatep.nn.MoE(planner="static") with B slots (serving) or epn
(the training layout, run for inference), sets one placement, runs inference steps with new routing (ragged ranks,
one of them empty) and compares its rows with the dense reference it computes itself on the CPU, its plan's slot
table with the placement and the rows per rank with the split rule; rank 0 writes every rank's results to a JSON file.
"""

import json

import torch
import torch.distributed as dist

import flatep
from flatep.testing import DenseMoE, sample_topk

R, S, H, F, E, K = 3, 16, 16, 8, 12, 2
EPN = E // R


def placement_for(num_slots):
    rows = {2: [[4, 9], [-1, 1], [5, 0]], EPN: [[4, 9, -1, 6], [2, -1, 11, 1], [5, 0, 3, -1]]}
    return rows[num_slots]


def rel_err(a, b):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def split_loads(tpe_all, placement):
    """The static split rule written out: e's copies (home, then slot holders, ascending rank), round-robin from e mod
    n."""
    loads = [0] * R
    for e in range(E):
        copies = [d for d in range(R) if d == e // EPN or e in placement[d]]
        for i in range(int(tpe_all[:, e].sum())):
            loads[copies[(e % len(copies) + i) % len(copies)]] += 1
    return loads


def main(rank, world, device_name, num_slots, out_path):
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    moe = flatep.nn.MoE(H, F, E, K, num_tokens=S, align=4, seed=7, num_slots=num_slots, planner="static",
                        device=device)
    placement = placement_for(moe.num_slots)
    moe.set_placement(placement)
    dense = DenseMoE(H, F, E, K, seed=7)
    results = []
    for step in range(3):
        counts = [(S - 3 * step + 5 * r) % (S + 1) if r != 1 else 0 for r in range(R)]
        idx_all = [sample_topk(E, S, K, r, sigma=1.5, seed=30 + step)[: counts[r]].long() for r in range(R)]
        g = torch.Generator().manual_seed(40 + step)
        x_all = torch.randn(sum(counts), H, generator=g)
        lo = sum(counts[:rank])
        mine = slice(lo, lo + counts[rank])
        with torch.no_grad():
            out = moe(x_all[mine].to(device), idx_all[rank].to(device))
            ref = dense(x_all, torch.cat(idx_all), chunks=counts)
        plan = moe.last_plan
        err = rel_err(out, ref[mine]) if counts[rank] > 0 else 0.0
        want_slots = placement[rank] + [-1] * (EPN - len(placement[rank]))
        results.append((err, moe.last_placement_bytes, plan.slot_expert.cpu().tolist(), want_slots,
                        list(plan.stats["loads"]), split_loads(plan.tpe_all, placement)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
