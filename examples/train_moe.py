#!/usr/bin/env python3
"""Trains a tiny MoE model with FlatEP across R processes and checks its loss curve against the dense reference.

Model: y = x + MoE(x) (flatep.nn.MoE: router, top-K SwiGLU experts y = (silu(x W1_gate) * x W1_up) W2, or with
--activation silu y = silu(x W1) W2), regressing a fixed random teacher
network, Adam (flatep.optim.MainGradOptimizer: fp32 masters of the bf16 expert weights, which are the library's
memory). Each rank trains on its own batch of S tokens per step; the router is replicated (its gradient is
all-reduced), the experts are sharded E/R per rank (their gradients, replicas included, come back
through reduce_grad). The dense single-process reference (flatep.testing.DenseMoE) is trained on the union of the
ranks' batches with the same init and optimizer; the two loss curves must agree within --tolerance.

    /usr/bin/python3 examples/train_moe.py                  # 2 processes on the CPU, 20 steps
    /usr/bin/python3 examples/train_moe.py --ranks 4 --steps 50 --capacity-factor 1.25
    python3 examples/train_moe.py --device cuda             # rank r on GPU r % device count (ranks may share one)
    torchrun --nproc-per-node 4 examples/train_moe.py       # launched by torchrun instead of spawning

Prints per step the loss, the reference's loss and the rows each rank computed (FlatEP keeps them equal in exact
mode) beside the rows each rank would have computed without replicas.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))  # source checkout: python/ (the extension: PYTHONPATH)

import flatep  # noqa: E402
from flatep.testing import DenseMoE  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=64, help="S: tokens per rank per step")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--align", type=int, default=8)
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--activation", default="swiglu", choices=flatep.nn.ACTIVATIONS,
                   help="expert FFN: swiglu (W1 [H, 2F] = gate and up fused) or silu (W1 [H, F])")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                   help="cpu, cuda (rank r on GPU r %% device count; FlatEP built with CUDA) or auto (cuda if present)")
    p.add_argument("--tolerance", type=float, default=2e-2, help="max relative loss difference to the reference")
    return p.parse_args(argv)


def batch(args, step, rank, device):
    """This rank's inputs of a step [S, H] (a deterministic function of seed, step and rank)."""
    g = torch.Generator().manual_seed(args.seed * 7919 + step * 1009 + rank + 1)
    return torch.randn(args.tokens, args.hidden, generator=g).to(device)


def teacher(args, x):
    g = torch.Generator().manual_seed(args.seed + 12345)
    a = torch.randn(args.hidden, args.hidden, generator=g).to(x.device) / args.hidden**0.5
    return torch.tanh(x @ a)


def train_dense(args, R, device):
    """The reference: one DenseMoE trained on every rank's batch, same init, same optimizer."""
    model = DenseMoE(args.hidden, args.ffn, args.experts, args.topk, seed=args.seed, activation=args.activation)
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        x = torch.cat([batch(args, step, r, device) for r in range(R)])
        y = x + model(x, chunks=R)
        loss = ((y - teacher(args, x)) ** 2).sum() / x.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train(rank, R, args):
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    moe = flatep.nn.MoE(
        args.hidden, args.ffn, args.experts, args.topk, num_tokens=args.tokens, align=args.align,
        capacity_factor=args.capacity_factor, seed=args.seed, device=device, activation=args.activation,
    )
    # The experts' bf16 weights are the library's memory and their fp32 gradients main_grad: Adam runs on fp32
    # masters (one copy back per step); the router is an ordinary fp32 parameter.
    opt = flatep.optim.MainGradOptimizer(torch.optim.Adam, moe.parameters(), lr=args.lr)
    if rank == 0:
        print(
            f"train_moe: R={R} device={device.type} S={args.tokens} H={args.hidden} F={args.ffn} E={args.experts} "
            f"K={args.topk} align={args.align} capacity_factor={args.capacity_factor} activation={args.activation}",
            flush=True,
        )
    losses = []
    for step in range(args.steps):
        x = batch(args, step, rank, device)
        y = x + moe(x)
        local = ((y - teacher(args, x)) ** 2).sum() / (x.numel() * R)  # this rank's share of the global mean
        opt.zero_grad()
        local.backward()
        for p in moe.replicated_parameters():  # data-parallel router: sum its gradient over the ranks
            grad = p.grad.cpu()
            dist.all_reduce(grad)
            p.grad.copy_(grad)
        opt.step()
        loss = local.detach().cpu()
        dist.all_reduce(loss)
        losses.append(loss.item())
        st = moe.last_plan.stats
        if rank == 0:
            print(
                f"step {step:3d}  loss {loss.item():.6f}  rank loads {st['loads']}  "
                f"(without replicas {st['loads_before']})  replicas {st['replicas']}  P {st['P']}",
                flush=True,
            )
    return losses


def run(rank, R, args):
    losses = train(rank, R, args)
    if rank != 0:
        return 0
    reference = train_dense(args, R, torch.device(args.device if args.device != "cuda" else "cuda:0"))
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))
    print("step  flatep      dense reference")
    for step, (a, b) in enumerate(zip(losses, reference)):
        print(f"{step:4d}  {a:.6f}  {b:.6f}")
    improved = losses[-1] < losses[0]
    ok = worst <= args.tolerance and (improved or args.steps < 2)
    print(
        f"loss {losses[0]:.6f} -> {losses[-1]:.6f}; max relative difference to the dense reference {worst:.2e} "
        f"(tolerance {args.tolerance:.0e}): {'OK' if ok else 'MISMATCH'}",
        flush=True,
    )
    return 0 if ok else 1


def main(argv=None):
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and flatep._C.has_cuda else "cpu"
    if args.device == "cuda" and not (torch.cuda.is_available() and flatep._C.has_cuda):
        why = "FlatEP was built without CUDA" if not flatep._C.has_cuda else "torch sees no CUDA device"
        sys.exit(f"train_moe: --device cuda is not available here ({why}); use --device cpu")
    return flatep.testing.launch(run, args.ranks, args)  # torchrun's ranks, or args.ranks spawned processes


if __name__ == "__main__":
    sys.exit(main())
