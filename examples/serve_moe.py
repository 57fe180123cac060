#!/usr/bin/env python3
"""Serves an MoE layer with FlatEP on R virtual ranks: one prefill step, then decode steps, checked against the dense
reference.

One flatep.nn.MoE per rank over serving pools with B replica slots (num_slots=B < epn): the layer's own expert
weights are symmetric memory every rank maps, and the experts' grouped GEMM runs on the [R*Q + B] weights view with
the plan's cu_seqlens (a replica beyond the B slots is read in place from its owner; no weight is copied per step).
Prefill plans with the balanced planner (every rank computes the same number of rows, at most B slots); decode
switches the same layer, the same pools and weights, to a second Buffer with the owner planner (no replicas, no
prefetch: each row goes to its expert's home rank) and a small S. Ranks are ragged, one of them empty, in every step.

    PYTHONPATH=python:build/python /usr/bin/python3 examples/serve_moe.py             # CPU backend, 4 ranks
    PYTHONPATH=python:build/python python3 examples/serve_moe.py --device cuda        # 4 virtual ranks on one GPU

Prints per step the planner, the tokens per rank, the rows each rank computed and the error against
flatep.testing.DenseMoE (the same weights, every expert in one process); exits 1 when an error exceeds --tolerance.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))  # source checkout: python/ (the extension: PYTHONPATH)

from flatep import virtual  # noqa: E402  (first: it sets CUDA's loading mode before CUDA starts)
import torch  # noqa: E402

import flatep  # noqa: E402
from flatep import testing  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--slots", type=int, default=1, help="B: replica slots per rank (< experts / ranks)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=32)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--prefill-tokens", type=int, default=64, help="S of the prefill step (tokens per rank)")
    p.add_argument("--decode-tokens", type=int, default=4, help="S of a decode step (the owner planner's R*S*K rows)")
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--sigma", type=float, default=1.5, help="routing skew (hot experts)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=2.0**-6, help="max |out - ref| / max |ref|")
    return p.parse_args(argv)


def ragged(total, ranks, step):
    """Tokens per rank: rank (step % R) passes none, the others a share of `total` each (at most total)."""
    return [0 if r == step % ranks else max(1, total - (r * total) // (2 * ranks)) for r in range(ranks)]


def main(argv=None):
    args = parse_args(argv)
    R, E, K, H = args.ranks, args.experts, args.topk, args.hidden
    device = torch.device(args.device)
    ranks = virtual.virtual_ranks(R, device, timeout_s=60)
    moes = virtual.run_threads(R, lambda r: flatep.nn.MoE(
        H, args.ffn, E, K, ranks[r], num_tokens=args.prefill_tokens, num_slots=args.slots, seed=args.seed,
        device=device, align=8))
    dense = testing.DenseMoE(H, args.ffn, E, K, seed=args.seed)
    streams = [torch.cuda.Stream(device) for _ in range(R)] if device.type == "cuda" else [None] * R
    pools = moes[0].pools
    print(f"R={R} E={E} epn={E // R} B={pools.num_slots} view rows {pools.view_rows} (Q={pools.view_stride}), "
          f"slots hold {pools.num_slots} of epn={E // R} experts per rank and projection")
    worst = 0.0
    steps = [("balanced", args.prefill_tokens)] + [("owner", args.decode_tokens)] * args.decode_steps
    for step, (planner, S) in enumerate(steps):
        counts = ragged(S, R, step)
        g = torch.Generator().manual_seed(args.seed * 1009 + step)
        xs = [torch.randn(s, H, generator=g) for s in counts]
        idx = [testing.sample_topk(E, S, K, r, sigma=args.sigma, seed=args.seed + step)[:s].long()
               for r, s in enumerate(counts)]
        virtual.run_threads(R, lambda r: moes[r].use_planner(planner, S))  # collective the first time only

        def run(r):
            with torch.inference_mode():
                if streams[r] is None:
                    return moes[r](xs[r].to(device), idx[r].to(device))
                with torch.cuda.stream(streams[r]):
                    out = moes[r](xs[r].to(device), idx[r].to(device))
                    streams[r].synchronize()
                    return out

        outs = virtual.run_threads(R, run)
        plans = [m.last_plan for m in moes]
        assert all(int((p.slot_expert >= 0).sum()) <= args.slots for p in plans), "a plan used more than B slots"
        ref = dense(torch.cat(xs), torch.cat(idx), chunks=counts)
        out = torch.cat([o.cpu() for o in outs])
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-12)).item()
        worst = max(worst, err)
        stats = plans[0].stats
        print(f"step {step} {planner:8s} S={S:3d} tokens {counts} rows {stats['loads']} (without FlatEP "
              f"{stats['loads_before']}), replicas {stats['replicas']}, error {err:.2e}")
    ok = worst <= args.tolerance
    print(f"{'OK' if ok else 'FAILED'}: worst error {worst:.2e} (tolerance {args.tolerance:.2e})")
    testing.release_all()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
