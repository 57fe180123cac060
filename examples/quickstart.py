#!/usr/bin/env python3
"""FlatEP's quick start: the three levels of its Python API on R processes (one per EP rank), each checked against
a dense computation of the same tokens with every expert in one place.

    python3 examples/quickstart.py                     # 2 processes, CPU backend
    python3 examples/quickstart.py --ranks 4           # 4 processes
    python3 examples/quickstart.py --device cuda       # FlatEP built with CUDA: rank r on GPU r % device count
    torchrun --nproc-per-node 2 examples/quickstart.py

Level 1, flatep.Buffer: plan, dispatch, combine; the expert computation is yours.
Level 2, flatep.ExpertPools: the experts' weights live in FlatEP's memory; replicas are prefetched into slots and
their gradients reduced into the owners'.
Level 3, flatep.nn.MoE: the whole layer (router, experts, autograd).

Prints one line per level and exits 1 when a check fails. README.md shows use_buffer, use_pools and use_moe as
written here (tests/python/test_readme.py keeps the two in step and runs this file).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))  # a source checkout

import flatep  # noqa: E402
from flatep.nn import expert_ffn, init_expert_weights  # noqa: E402 (the dense checks)

S, H, F, E, K = 64, 128, 64, 8, 2  # tokens per rank, hidden, expert FFN width, experts, experts per token


def use_buffer(group, device, x, topk_idx, topk_w):
    buf = flatep.Buffer(group, num_tokens=S, hidden=H, num_experts=E, topk=K, align=8, device=device)
    plan = buf.plan(topk_idx)  # collective: every rank's routing -> one plan; every rank gets S*K rows
    recv_x, recv_w, cu_seqlens = buf.dispatch(plan, x, topk_w)  # the rows this rank computes, grouped by expert
    # Group g < epn is own expert rank*epn + g; group epn + j holds a replica of expert plan.slot_expert[j].
    epn = buf.experts_per_rank
    experts = torch.cat([torch.arange(epn, device=device) + buf.rank * epn, plan.slot_expert.long()])
    sizes = torch.diff(cu_seqlens, prepend=cu_seqlens.new_zeros(1)).long()
    row_expert = torch.repeat_interleave(experts, sizes)  # the expert of each row in use (padding rows are zero)
    y = torch.zeros_like(recv_x)
    y[: len(row_expert)] = recv_x[: len(row_expert)] * (row_expert + 1).unsqueeze(1)  # "expert e" multiplies by e+1
    out = buf.combine(plan, y, recv_w)  # [S, H]: each token's K expert outputs, weighted by topk_w, summed
    return out, plan


def use_pools(group, device, x, topk_idx, topk_w):
    buf = flatep.Buffer(group, num_tokens=S, hidden=H, num_experts=E, topk=K, align=8, device=device)
    epn = buf.experts_per_rank
    pools = flatep.ExpertPools(group, epn, [(H, F), (F, H)], device=device)  # once per process and shape
    layer = pools.register_layer()  # once per layer
    own = range(buf.rank * epn, (buf.rank + 1) * epn)  # this rank's experts' ids
    w1, w2 = flatep.nn.init_expert_weights(H, F, own, seed=0, activation="silu")  # deterministic per expert id
    layer.own_weights(0).copy_(w1)  # this rank's experts, bf16 [epn, H, F] and [epn, F, H], in FlatEP's memory
    layer.own_weights(1).copy_(w2)
    plan = buf.plan(topk_idx)
    recv_x, recv_w, cu_seqlens = buf.dispatch(plan, x, topk_w)
    pools.prefetch(plan, layer)  # collective: the replicas this plan placed here land in the slots
    w = [layer.weights(p).detach().requires_grad_() for p in (0, 1)]  # [2*epn, ...]: own experts, then the slots
    y = flatep.nn.grouped_ffn(recv_x, w[0], w[1], cu_seqlens, "silu")  # silu(x W1) W2, group g with w[.][g]
    out = buf.combine(plan, y, recv_w)
    out.float().sum().backward()  # collective: combine's backward is a dispatch of the output gradient
    for p in (0, 1):
        pools.write_grads(plan, layer, p, w[p].grad)  # the GEMM's bf16 gradients into FlatEP's fp32 views
    pools.reduce_grad(plan, layer)  # collective: every replica's gradient is added into its owner's
    return out, [layer.own_grads(p) for p in (0, 1)]  # fp32 [epn, ...]: the gradients of this rank's experts


def use_moe(group, device, x):
    moe = flatep.nn.MoE(hidden=H, ffn=F, num_experts=E, topk=K, group=group, align=8, device=device)
    y = moe(x)  # router, plan, dispatch, prefetch, expert FFNs (SwiGLU), combine
    y.float().sum().backward()  # expert gradients land in moe.w1.main_grad and moe.w2.main_grad (fp32)
    # Then all-reduce the replicated router's gradients and step flatep.optim.MainGradOptimizer (see train_moe.py).
    return y, [moe.w1.main_grad, moe.w2.main_grad]


# ---- checks: the same tokens through a dense computation with every expert on this rank ----


def rel_error(got, want):
    return ((got.float().cpu() - want.float().cpu()).norm() / want.float().cpu().norm().clamp_min(1e-30)).item()


def summed(t):
    """t summed over the ranks (the dense gradients of every rank's tokens)."""
    t = t.detach().cpu().clone()
    dist.all_reduce(t)
    return t


def dense_silu_layer(x, topk_idx, topk_w):
    """use_pools' layer with every expert here: output and the fp32 gradients of all E experts' weights."""
    w1, w2 = (w.bfloat16().float().requires_grad_() for w in init_expert_weights(H, F, range(E), 0, "silu"))
    x, topk_idx, topk_w = x.cpu(), topk_idx.cpu(), topk_w.cpu()
    out = torch.zeros(S, H)
    for k in range(K):
        for e in range(E):
            t = topk_idx[:, k] == e
            out[t] += topk_w[t, k : k + 1] * expert_ffn(x[t], w1[e], w2[e], "silu").float()
    out = out.bfloat16()
    out.float().sum().backward()
    return out, [w1.grad, w2.grad]


def run(rank, R, device, seed):
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(S, H, generator=g).bfloat16().to(device)
    topk_idx = flatep.testing.sample_topk(E, S, K, rank, sigma=1.5, seed=seed).to(device)  # a few hot experts
    topk_w = torch.softmax(torch.randn(S, K, generator=g), dim=-1).to(device)
    own = slice(rank * (E // R), (rank + 1) * (E // R))
    lines, worst = [], 0.0

    out, plan = use_buffer(None, device, x, topk_idx, topk_w)
    want = x.float() * (topk_w * (topk_idx + 1)).sum(1, keepdim=True)
    err = rel_error(out, want)
    st = plan.stats
    lines.append(f"flatep.Buffer       rows per rank {st['loads']} (without replicas {st['loads_before']}); "
                 "combine against the dense sum: error {:.1e}")
    exact = all(load == S * K for load in st["loads"])
    errors = [err]

    out, grads = use_pools(None, device, x, topk_idx, topk_w)
    want_out, want_grads = dense_silu_layer(x, topk_idx, topk_w)
    errors.append(max([rel_error(out, want_out)] + [rel_error(g, summed(w)[own]) for g, w in zip(grads, want_grads)]))
    lines.append("flatep.ExpertPools  output and own experts' gradients against the dense layer: error {:.1e}")

    xf = x.float()
    y, grads = use_moe(None, device, xf)
    dense = flatep.testing.DenseMoE(H, F, E, K, seed=0)
    want_y = dense(xf.cpu())
    want_y.float().sum().backward()
    errors.append(max([rel_error(y, want_y)] + [rel_error(g, summed(w.grad)[own]) for g, w in
                                                 zip(grads, (dense.w1, dense.w2))]))
    lines.append("flatep.nn.MoE       output and expert gradients against flatep.testing.DenseMoE: error {:.1e}")

    # The worst error of any rank, on every rank.
    worst = torch.tensor(errors, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    tolerance = 2e-2  # bf16 rows and weights, fp32 sums
    ok = exact and bool((worst <= tolerance).all())
    if rank == 0:
        print(f"quickstart: {R} ranks (processes) on {device.type}; per rank S={S} tokens, H={H}, F={F}, E={E} "
              f"experts, top-{K}")
        for line, e in zip(lines, worst.tolist()):
            print(line.format(e) + ("" if e <= tolerance else f"  MISMATCH (tolerance {tolerance:.0e})"))
        if not exact:
            print(f"quickstart: a rank did not receive exactly S*K = {S * K} rows: MISMATCH")
        print(f"quickstart: {'OK' if ok else 'MISMATCH'} (errors: relative L2, tolerance {tolerance:.0e})", flush=True)
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes to spawn (ignored under torchrun); divides E=8")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.ranks < 1 or E % args.ranks:
        p.error(f"--ranks must divide E={E}, got {args.ranks}")
    if args.device == "cuda" and not (flatep._C.has_cuda and torch.cuda.is_available()):
        why = "FlatEP was built without CUDA" if not flatep._C.has_cuda else "torch sees no CUDA device"
        sys.exit(f"quickstart: --device cuda is not available here ({why}); use --device cpu")
    return flatep.testing.launch(run, args.ranks, args.device, args.seed)  # torchrun's ranks, or spawned ones


if __name__ == "__main__":
    sys.exit(main())
