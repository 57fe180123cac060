#!/usr/bin/env python3
"""One MoE layer forward + backward: FlatEP against the standard expert-parallel baseline, same run, same routing.

    # GPU, 8 ranks on 8 GPUs (NCCL all-to-all for the baseline), the MoonEP and DeepEP configs:
    python3 benchmarks/layer/moe_layer.py --config moonep --device cuda
    python3 benchmarks/layer/moe_layer.py --config deepep --device cuda
    # CPU smoke run through gloo (minutes-scale sizes only; its numbers are not results):
    /usr/bin/python3 benchmarks/layer/moe_layer.py --ranks 2 --tokens 64 --hidden 64 --ffn 32 --experts 8 --topk 2 \\
        --iters 2 --warmup 1 --out /tmp/moe_layer

Both implementations run the same layer: router (fp32 softmax over x @ Wr^T, the generator's top-K experts, weights
renormalised), the expert FFN y = silu(x W1) W2 per expert (torch._grouped_mm on a GPU that has it, else a loop over
groups: flatep.nn.grouped_ffn for both), and the weighted sum of each token's K expert outputs.

* flatep: Buffer.plan -> dispatch -> ExpertPools.prefetch -> grouped FFN over own experts + replica slots ->
  combine; backward: combine's backward (a dispatch), the FFN's backward, reduce_grad, dispatch's backward (a combine).
* baseline (what EP users run today, e.g. Megatron's all-to-all dispatcher): count exchange (all_to_all of
  per-expert counts, then .tolist(): a host sync), permute by expert, exact-size all_to_all_single of the rows,
  regroup by local expert, grouped FFN over the received rows, the reverse path and the weighted sum on the source
  rank; backward by autograd through torch.distributed.nn.functional.all_to_all_single.

One process per rank. Phases are timed per rank (CUDA events on GPU, perf_counter on CPU) between barriers (so a
phase's time on a rank is its own work plus its waits inside that phase's collectives); the CSV reports per phase
the slowest rank (the critical path R real GPUs wait for), median over --iters. Separately, 'layer' is the
end-to-end forward+backward time with no barriers between phases (from a common barrier to the last rank's end).
Before timing, every maxvio's first iteration checks that both implementations give the same output, input gradient,
router gradient and expert-weight gradients within bf16 tolerance, and the run fails if they do not.
"""

import argparse
import csv
import math
import os
import re
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))  # source checkout: python/ (the extension: PYTHONPATH)

import flatep  # noqa: E402
from flatep import testing  # noqa: E402
from flatep.baseline import (  # noqa: E402, F401 - the baseline's helpers (one copy, in flatep.baseline)
    UNPERMUTE_CHUNK_ROWS, _WeightedSum, all_to_all_rows, by_expert, by_local_expert, weighted_sum,
    weighted_unpermute_backward,
)
from flatep.nn import DEFAULT_ALIGN, grouped_ffn, route  # noqa: E402

sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "common"))
import bench_timing  # noqa: E402
import layer_probe  # noqa: E402

BF16 = torch.bfloat16
PRESETS = {
    # MoonEP's configuration.
    "moonep": dict(ranks=8, tokens=8192, experts=384, hidden=7168, topk=8, ffn=2048, maxvio=[0.2, 1, 10, 20]),
    # DeepEP's benchmark configuration: uniform random routing (maxvio 0 = sigma 0).
    "deepep": dict(ranks=8, tokens=4096, experts=256, hidden=7168, topk=8, ffn=2048, maxvio=[0]),
}
# Phases in execution order; a phase an implementation does not have is absent from its rows.
PHASES = [
    "router_fwd", "plan", "dispatch_fwd", "prefetch", "gemm_fwd", "combine_fwd",
    "combine_bwd", "prefetch_bwd", "gemm_bwd", "wgrad_fp32", "reduce_grad", "dispatch_bwd", "router_bwd",
]
IMPLS = ["baseline", "flatep"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(PRESETS), help="preset; explicit flags override its values")
    p.add_argument("--ranks", type=int, help="R processes (ignored under torchrun); default 2")
    p.add_argument("--tokens", type=int, help="S tokens per rank; default 64")
    p.add_argument("--hidden", type=int, help="H; default 64")
    p.add_argument("--ffn", type=int, help="H' expert FFN size; default 32")
    p.add_argument("--experts", type=int, help="E; default 8")
    p.add_argument("--topk", type=int, help="K; default 2")
    p.add_argument("--maxvio", type=float, nargs="+", help="router imbalance targets (0: uniform); default 0.2 1 10 20")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per mode (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first (the first one is checked)")
    p.add_argument("--align", type=int, default=DEFAULT_ALIGN, help="FlatEP row-group padding (default: nn.MoE's)")
    p.add_argument("--capacity-factor", type=float, default=1.0, help="FlatEP capacity factor (1: exact mode)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--tolerance", type=float, default=2e-2, help="equality check: max relative L2 error")
    p.add_argument("--out", default=os.path.join(HERE, "..", "results"), help="directory of the CSV and PNGs")
    p.add_argument("--tag", default=None, help="device tag in the file names (default: from the device name)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--wgrad-mode", choices=["accumulate", "overwrite"], default="accumulate",
                   help="fp32 expert gradients, both implementations: added into main_grad (nn.MoE, Megatron) or "
                        "overwritten (a first micro-batch); the equality check always overwrites")
    p.add_argument("--baseline-unpermute", choices=["lean", "autograd"], default="lean",
                   help="the baseline's weighted-sum backward: 'lean' (chunked, no [S*K, H] fp32 temporaries) or "
                        "'autograd' (autograd of the forward expression: four [S*K, H] fp32 tensors)")
    p.add_argument("--inject-mismatch", action="store_true", help=argparse.SUPPRESS)  # tests: the check must fail
    args = p.parse_args(argv)
    defaults = dict(ranks=2, tokens=64, hidden=64, ffn=32, experts=8, topk=2, maxvio=[0.2, 1, 10, 20])
    preset = PRESETS.get(args.config, {})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, value))
    if args.experts % args.ranks:
        p.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    args.command = " ".join(["benchmarks/layer/moe_layer.py"] + (sys.argv[1:] if argv is None else list(argv)))
    return args


# ---- timing ----


class Timer:
    """Per-rank phase times of one iteration. begin() waits for every rank (device sync + gloo barrier) when
    `phased`, so each phase starts together on all ranks; end() records the rank's own end."""

    def __init__(self, device, ctrl):
        self.cuda = device.type == "cuda"
        self.device = device
        self.ctrl = ctrl
        self.enabled = False
        self.marks = []
        self.counters = layer_probe.PhaseCounters()
        self._opened = {}

    def _stamp(self):
        return bench_timing.stamp(self.cuda)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(group=self.ctrl)

    def begin(self, name):
        if self.enabled:
            self.sync()
            self._opened[name] = layer_probe.alloc_counters([self.device])
            self.marks.append([name, self._stamp(), None])

    def end(self, name):
        if self.enabled:
            assert self.marks and self.marks[-1][0] == name and self.marks[-1][2] is None, (name, self.marks[-1:])
            self.marks[-1][2] = self._stamp()
            # the allocator works when ops are enqueued: the host's counters at the end cover the phase
            self.counters.add(name, self._opened.pop(name), layer_probe.alloc_counters([self.device]))

    def start(self, enabled):
        self.enabled, self.marks = enabled, []
        self.counters = layer_probe.PhaseCounters()

    def collect(self):
        """{phase: ms} of this iteration (a phase met twice is summed)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for name, a, b in self.marks:
            assert b is not None, f"phase {name} never ended"
            ms = bench_timing.elapsed_ms(a, b)
            out[name] = out.get(name, 0.0) + ms
        self.enabled, self.marks = False, []
        return out


class Mark(torch.autograd.Function):
    """Identity in forward; in backward ends phase `end` and begins phase `begin` (either may be None): the phase
    boundaries of the backward pass, which autograd runs in reverse order of the forward."""

    @staticmethod
    def forward(ctx, timer, end, begin, *tensors):
        ctx.timer, ctx.end_name, ctx.begin_name = timer, end, begin
        outs = tuple(t.view_as(t) for t in tensors)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        if ctx.end_name:
            ctx.timer.end(ctx.end_name)
        if ctx.begin_name:
            ctx.timer.begin(ctx.begin_name)
        return (None, None, None) + grads


# ---- the baseline ----


class Baseline:
    """Standard EP: count exchange with a host sync, permute, exact-size all-to-all, grouped FFN, reverse path."""

    def __init__(self, st):
        self.st = st
        self.w1 = (st.w1 * (1.25 if st.inject_mismatch else 1.0)).requires_grad_()
        self.w2 = st.w2.clone().requires_grad_()
        self.router = st.router.clone().requires_grad_()
        # fp32 main gradients of the experts, as Megatron keeps them in bf16 training: each step's bf16 weight
        # gradients are added into them (FlatEP writes its GEMM gradients into the fp32 grads views, phase wgrad_fp32).
        self.main_grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (self.w1, self.w2)]

    def grads(self):
        return self.router.grad, self.w1.grad, self.w2.grad

    def after_backward(self):
        T = self.st.timer
        T.begin("wgrad_fp32")
        with torch.no_grad():
            for main, w in zip(self.main_grads, (self.w1, self.w2)):
                if self.st.wgrad_accumulate():
                    main.add_(w.grad)
                else:
                    main.copy_(w.grad)
        T.end("wgrad_fp32")

    def zero_grad(self):
        for t in (self.w1, self.w2, self.router):
            t.grad = None

    def forward(self, x, topk_idx):
        st, T = self.st, self.st.timer
        R, epn, K, group = st.R, st.epn, st.K, st.a2a_group
        x = Mark.apply(T, "router_bwd", None, x)
        T.begin("router_fwd")
        weights, idx = route(x, self.router, K, topk_idx)
        xb = x.to(BF16)
        T.end("router_fwd")
        xb, weights = Mark.apply(T, "dispatch_bwd", "router_bwd", xb, weights)
        T.begin("plan")  # count exchange: per-expert counts to the experts' owners, then a host sync for the splits
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=st.E).to(torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send_splits = counts.view(R, epn).sum(1).tolist()
        recv_matrix = recv_counts.view(R, epn)  # [source rank, local expert]
        recv_splits = recv_matrix.sum(1).tolist()
        T.end("plan")
        T.begin("dispatch_fwd")
        order, token_of = by_expert(idx, K)
        sent = xb.index_select(0, token_of)
        recv = all_to_all_rows(sent, recv_splits, send_splits, group)  # rows by [source][local expert]
        regroup, offs = by_local_expert(recv_matrix)  # rows by [local expert][source]
        recv_x = recv.index_select(0, regroup)
        T.end("dispatch_fwd")
        recv_x = Mark.apply(T, "gemm_bwd", "dispatch_bwd", recv_x)
        T.begin("gemm_fwd")
        y = grouped_ffn(recv_x, self.w1, self.w2, offs)
        T.end("gemm_fwd")
        y = Mark.apply(T, "combine_bwd", "gemm_bwd", y)
        T.begin("combine_fwd")
        inverse = torch.empty_like(regroup)
        inverse[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        back = all_to_all_rows(y.index_select(0, inverse), send_splits, recv_splits, group)  # my entries, by expert
        w_sorted = weights.reshape(-1).index_select(0, order)
        if st.lean_unpermute:
            out = _WeightedSum.apply(back, w_sorted, token_of, x.shape[0])
        else:  # autograd of the expression (its backward materialises [S*K, H] fp32 tensors)
            out = torch.zeros(x.shape[0], st.H, dtype=torch.float32, device=x.device)
            out = out.index_add(0, token_of, back.float() * w_sorted.unsqueeze(1)).to(BF16)
        T.end("combine_fwd")
        return Mark.apply(T, None, "combine_bwd", out)


# ---- FlatEP ----


class _FlatExperts(torch.autograd.Function):
    """prefetch + grouped FFN over the compute views (own experts, then replica slots); backward: the FFN's
    backward into the grads views, reduce_grad. As flatep.nn's expert function, with the phases timed."""

    @staticmethod
    def forward(ctx, impl, plan, recv_x):
        T = impl.st.timer
        pools, layer = impl.pools, impl.layer
        T.begin("prefetch")
        pools.prefetch(plan, layer)
        T.end("prefetch")
        T.begin("gemm_fwd")
        on_views = recv_x.is_cuda and hasattr(torch, "_grouped_mm")
        with torch.enable_grad():
            x_leaf = recv_x.detach().requires_grad_()
            w1 = (layer.weights(0) if on_views else layer.weights(0).float()).detach().requires_grad_()
            w2 = (layer.weights(1) if on_views else layer.weights(1).float()).detach().requires_grad_()
            y = grouped_ffn(x_leaf, w1, w2, plan.cu_seqlens)
        T.end("gemm_fwd")
        ctx.impl, ctx.plan, ctx.on_views, ctx.graph = impl, plan, on_views, (y, x_leaf, w1, w2)
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        impl, plan = ctx.impl, ctx.plan
        T, pools, layer = impl.st.timer, impl.pools, impl.layer
        y, x_leaf, w1, w2 = ctx.graph
        ctx.graph = None
        if ctx.on_views:  # the slot pool is shared by layers: a real model prefetches again before backward
            T.begin("prefetch_bwd")
            pools.prefetch(plan, layer)
            T.end("prefetch_bwd")
        T.begin("gemm_bwd")
        g1, g2, gx = torch.autograd.grad(y, [w1, w2, x_leaf], grad_y.to(y.dtype))
        T.end("gemm_bwd")
        T.begin("wgrad_fp32")  # the GEMM's bf16 gradients into the fp32 grads views (own experts, used slots)
        accumulate = impl.st.wgrad_accumulate()
        pools.write_grads(plan, layer, 0, g1, accumulate=accumulate)
        pools.write_grads(plan, layer, 1, g2, accumulate=accumulate)
        T.end("wgrad_fp32")
        T.begin("reduce_grad")
        pools.reduce_grad(plan, layer)
        T.end("reduce_grad")
        return None, None, gx


class FlatEP:
    def __init__(self, st):
        self.st = st
        self.router = st.router.clone().requires_grad_()
        self.buffer = flatep.Buffer(
            st.ctrl, st.S, st.H, st.E, st.K, st.align, st.capacity_factor, device=st.device
        )
        self.pools = flatep.ExpertPools(st.ctrl, st.epn, [(st.H, st.F), (st.F, st.H)], device=st.device)
        self.layer = self.pools.register_layer()
        with torch.no_grad():
            self.layer.own_weights(0).copy_(st.w1)
            self.layer.own_weights(1).copy_(st.w2)

    def grads(self):
        return self.router.grad, self.layer.own_grads(0).clone(), self.layer.own_grads(1).clone()

    def zero_grad(self):
        self.router.grad = None

    def after_backward(self):
        pass  # the own experts' fp32 gradients are the grads views' first half (written in backward)

    def forward(self, x, topk_idx):
        st, T = self.st, self.st.timer
        x = Mark.apply(T, "router_bwd", None, x)
        T.begin("router_fwd")
        weights, idx = route(x, self.router, st.K, topk_idx)
        xb = x.to(BF16)
        T.end("router_fwd")
        xb, weights = Mark.apply(T, "dispatch_bwd", "router_bwd", xb, weights)
        T.begin("plan")
        plan = self.buffer.plan(idx)
        T.end("plan")
        T.begin("dispatch_fwd")
        recv_x, recv_w, _ = self.buffer.dispatch(plan, xb, weights)
        T.end("dispatch_fwd")
        recv_x = Mark.apply(T, None, "dispatch_bwd", recv_x)
        y = _FlatExperts.apply(self, plan, recv_x)
        y = Mark.apply(T, "combine_bwd", None, y)
        T.begin("combine_fwd")
        out = self.buffer.combine(plan, y, recv_w)
        T.end("combine_fwd")
        self.plan = plan
        return Mark.apply(T, None, "combine_bwd", out)


# ---- one rank ----


class State:
    pass


def rel_l2(a, b):
    a, b = a.float(), b.float()
    if float(b.norm()) == 0.0:  # an all-zero reference would make any comparison pass: count it as a failure
        return float("nan")
    return float((a - b).norm() / b.norm())


def run_rank(rank, R, args, result_path):
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    ctrl = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    st = State()
    st.R, st.S, st.H, st.F, st.E, st.K = R, args.tokens, args.hidden, args.ffn, args.experts, args.topk
    st.epn, st.align, st.capacity_factor, st.device = st.E // R, args.align, args.capacity_factor, device
    st.ctrl = ctrl if ctrl is not None else dist.group.WORLD
    st.a2a_group = dist.group.WORLD
    st.timer = Timer(device, st.ctrl)
    st.inject_mismatch = args.inject_mismatch
    st.lean_unpermute = args.baseline_unpermute == "lean"
    st.checking = False  # the equality check's step: the fp32 expert gradients are overwritten, not accumulated
    st.wgrad_accumulate = lambda: args.wgrad_mode == "accumulate" and not st.checking
    g = torch.Generator(device=device).manual_seed(args.seed * 7919 + rank + 1)
    st.w1 = (torch.randn(st.epn, st.H, st.F, device=device, generator=g) / st.H**0.5).to(BF16)
    st.w2 = (torch.randn(st.epn, st.F, st.H, device=device, generator=g) / st.F**0.5).to(BF16)
    gr = torch.Generator(device=device).manual_seed(args.seed)  # the replicated router: same on every rank
    st.router = torch.randn(st.E, st.H, device=device, generator=gr) / st.H**0.5
    x_leaf = torch.randn(st.S, st.H, device=device, generator=g).to(BF16)
    grad_out = torch.randn(st.S, st.H, device=device, generator=g).to(BF16)
    baseline = Baseline(st)
    before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    impls = {"baseline": baseline, "flatep": FlatEP(st)}
    # Persistent memory per rank: FlatEP's Buffer and pools (device memory outside torch's allocator: the free
    # memory it took, less torch's own growth meanwhile; approximate where ranks share a GPU); the baseline's expert
    # weights and their fp32 main gradients (torch tensors).
    static = {"baseline": layer_probe.tensor_bytes(baseline.w1, baseline.w2, *baseline.main_grads), "flatep": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        grown = torch.cuda.memory_reserved(device) - reserved
        static["flatep"] = max(0, before - torch.cuda.mem_get_info(device)[0] - grown)
    records, checks = [], []

    def step(impl, topk_idx, timed):
        """One forward + backward: (out, x.grad, phase times or {}, the step's peak torch bytes above its start)."""
        x = x_leaf.detach().requires_grad_()
        impl.zero_grad()
        base = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        st.timer.start(timed)
        out = impl.forward(x, topk_idx)
        out.backward(grad_out)
        impl.after_backward()
        times = st.timer.collect() if timed else {}
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
        return out, x.grad, times, peak

    for target in args.maxvio:
        reachable = 0.9 * (st.E / st.K - 1)  # maxvio <= E/K - 1 (every token on the K hottest experts)
        if target > reachable and rank == 0:
            print(f"note: maxvio {target:g} is unreachable with E={st.E}, K={st.K}; using {reachable:g}", flush=True)
        goal = min(target, reachable)
        sigma = 0.0 if target == 0 else testing.sigma_for_maxvio(goal, R, st.E, st.S, st.K, seed=args.seed)
        counts = testing.generate_counts(R, st.E, st.S, st.K, sigma=sigma, seed=args.seed)
        realised = testing.maxvio(counts)
        loads_before = counts.sum(0).view(R, st.epn).sum(1).tolist()
        topk_idx = testing.sample_topk(st.E, st.S, st.K, rank, sigma=sigma, seed=args.seed).to(device).long()
        # Equality check on the first iteration (same x, routing, weights and output gradient for both).
        results = {}
        st.checking = True
        for name in IMPLS:
            out, gx, _, _ = step(impls[name], topk_idx, False)
            results[name] = (out.detach(), gx.detach()) + tuple(t.detach().float() for t in impls[name].grads())
        st.checking = False
        errors = {
            field: rel_l2(results["flatep"][i], results["baseline"][i])
            for i, field in enumerate(["out", "grad_x", "grad_router", "grad_w1", "grad_w2"])
        }
        all_errors = [None] * R
        dist.all_gather_object(all_errors, errors, group=st.ctrl)
        worst = {k: max(e[k] for e in all_errors) for k in errors}
        checks.append((target, worst))
        if any(not math.isfinite(v) or v > args.tolerance for v in worst.values()):
            raise RuntimeError(
                f"EQUALITY CHECK FAILED at maxvio {target:g}: FlatEP vs baseline relative L2 errors "
                f"{ {k: f'{v:.2e}' for k, v in worst.items()} } exceed tolerance {args.tolerance:g}"
            )
        stats = impls["flatep"].plan.stats
        rows = {"flatep": max(stats["loads"]), "baseline": max(loads_before)}
        for name in IMPLS:
            for _ in range(max(args.warmup - 1, 0)):
                step(impls[name], topk_idx, False)
        samples = {name: {"phases": [], "layer": [], "alloc": [], "peak": 0} for name in IMPLS}
        for it in range(args.iters):
            for name in IMPLS:  # interleaved, so drifts hit both alike
                _, _, phases, peak = step(impls[name], topk_idx, True)
                samples[name]["phases"].append(phases)
                samples[name]["alloc"].append(st.timer.counters.by_phase)
                samples[name]["peak"] = max(samples[name]["peak"], peak)
                st.timer.sync()
                t0 = st.timer._stamp()
                step(impls[name], topk_idx, False)
                t1 = st.timer._stamp()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                samples[name]["layer"].append(t0.elapsed_time(t1) if device.type == "cuda" else (t1 - t0) * 1e3)
        gathered = [None] * R
        dist.all_gather_object(gathered, samples, group=st.ctrl)
        if rank == 0:
            for name in IMPLS:
                memory = {} if device.type != "cuda" else layer_probe.memory_columns(
                    static[name], max(g_[name]["peak"] for g_ in gathered))
                per_iter = {}  # phase -> list over iterations of [ms per rank]
                for it in range(args.iters):
                    for phase in PHASES:
                        vals = [g_[name]["phases"][it].get(phase) for g_ in gathered]
                        if vals[0] is not None:
                            per_iter.setdefault(phase, []).append(vals)
                    per_iter.setdefault("sum_phases", []).append(
                        [sum(g_[name]["phases"][it].values()) for g_ in gathered]
                    )
                    per_iter.setdefault("layer", []).append([g_[name]["layer"][it] for g_ in gathered])
                for phase, its in per_iter.items():
                    counts = [_summed(g_[name]["alloc"][it].get(phase, {}) for g_ in gathered)
                              for it in range(args.iters)]
                    records.append(dict(
                        maxvio_target=target, maxvio=round(realised, 4), sigma=round(sigma, 5), impl=name,
                        phase=phase, median_ms=statistics.median(max(v) for v in its),
                        mean_rank_ms=statistics.median(sum(v) / len(v) for v in its),
                        min_rank_ms=statistics.median(min(v) for v in its), rows_max=rows[name],
                        **layer_probe.alloc_columns(counts), **memory,
                    ))
    if rank == 0:
        with open(result_path, "w") as f:
            import json

            json.dump({"records": records, "checks": checks}, f)


def _summed(dicts):
    out = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


# ---- process management and output ----


def device_name(args):
    if args.device == "cuda":
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU {platform.processor() or platform.machine()}"


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _worker(rank, R, init_file, args, result_path):
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)
    backend = "nccl" if args.device == "cuda" and R <= torch.cuda.device_count() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=R)
    try:
        run_rank(rank, R, args, result_path)
        dist.barrier()
    finally:
        from flatep.distributed import release_transports

        release_transports()
        dist.destroy_process_group()


def print_memory(by, targets):
    """The memory table (GiB per rank: static + the step's peak, the largest rank) and the phases in which the
    caching allocator had to free its cache and retry (alloc_retries) or map / unmap memory (device_allocs)."""
    if not any(by.get((t, "baseline", "layer"), {}).get("peak_gb") is not None for t in targets):
        return
    print("\nmemory per rank (GiB; static + step peak = peak, the largest rank): baseline / flatep")
    print(f"{'':>13} " + " ".join(f"{'maxvio ' + format(t, 'g'):>19}" for t in targets))
    for col in layer_probe.MEMORY_COLUMNS:
        cells = [f"{by[(t, 'baseline', 'layer')][col]:8.2f} / {by[(t, 'flatep', 'layer')][col]:8.2f}" for t in targets]
        print(f"{col:>13} " + " ".join(f"{c:>19}" for c in cells))
    busy = [(t, i, p, r["alloc_retries"], r["device_allocs"]) for (t, i, p), r in by.items()
             if p not in ("layer", "sum_phases") and (r.get("alloc_retries") or r.get("device_allocs"))]
    if busy:
        print("allocator per timed iteration (summed over ranks): maxvio impl phase: retries (cache freed), "
              "device allocs / maps")
        for t, i, p, retries, allocs in busy:
            print(f"  {t:g} {i} {p}: {retries:g} retries, {allocs:g} allocs")
    else:
        print("allocator: no cache-flushing retry and no device allocation in any timed phase")


def write_outputs(args, R, data, backend):

    device = device_name(args)
    cfg = args.config or "custom"
    name = f"moe_layer_{cfg}_R{R}_S{args.tokens}_E{args.experts}_H{args.hidden}_K{args.topk}_F{args.ffn}_" + (
        args.tag or slug(device)
    )
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, name + ".csv")
    fields = ["config", "ranks", "tokens", "hidden", "ffn", "experts", "topk", "maxvio_target", "maxvio", "sigma",
              "impl", "phase", "median_ms", "mean_rank_ms", "min_rank_ms", "rows_max"]
    fields += layer_probe.ALLOC_COLUMNS + layer_probe.MEMORY_COLUMNS
    with open(csv_path, "w", newline="") as f:
        f.write(f"# command: {args.command}\n# device: {device}; backend: {backend}; iters {args.iters}, "
                f"warmup {args.warmup}; median over iterations of the slowest rank per phase (ms)\n")
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for rec in data["records"]:
            w.writerow(dict(config=cfg, ranks=R, tokens=args.tokens, hidden=args.hidden, ffn=args.ffn,
                            experts=args.experts, topk=args.topk, **{k: (f"{v:.6g}" if isinstance(v, float) else v)
                                                                   for k, v in rec.items()}))
    print(f"wrote {csv_path}")
    by = {(r["maxvio_target"], r["impl"], r["phase"]): r for r in data["records"]}
    targets = list(dict.fromkeys(r["maxvio_target"] for r in data["records"]))
    print(f"\n{device}, {backend}, R={R} S={args.tokens} E={args.experts} H={args.hidden} K={args.topk} "
          f"F={args.ffn}: layer forward+backward, slowest rank (ms)")
    print(f"{'maxvio':>8} {'realised':>8} {'baseline':>10} {'flatep':>10} {'ratio':>7}   "
          f"{'base rows':>9} {'flat rows':>9}   sum of phases: {'baseline':>9} {'flatep':>9} {'ratio':>7}")
    for t in targets:
        b, f_ = by[(t, "baseline", "layer")], by[(t, "flatep", "layer")]
        bs, fs = by[(t, "baseline", "sum_phases")], by[(t, "flatep", "sum_phases")]
        print(f"{t:8g} {b['maxvio']:8.2f} {b['median_ms']:10.3f} {f_['median_ms']:10.3f} "
              f"{b['median_ms'] / f_['median_ms']:7.2f}   {b['rows_max']:9d} {f_['rows_max']:9d}   "
              f"{'':>15}{bs['median_ms']:9.3f} {fs['median_ms']:9.3f} {bs['median_ms'] / fs['median_ms']:7.2f}")
    print("\nper phase, slowest rank (ms): baseline / flatep")
    print(f"{'phase':>13} " + " ".join(f"{'maxvio ' + format(t, 'g'):>19}" for t in targets))
    for phase in PHASES + ["sum_phases", "layer"]:
        cells = []
        for t in targets:
            b, f_ = by.get((t, "baseline", phase)), by.get((t, "flatep", phase))
            fmt = lambda r: f"{r['median_ms']:8.3f}" if r else f"{'-':>8}"  # noqa: E731
            cells.append(f"{fmt(b)} / {fmt(f_)}")
        if any(by.get((t, i, phase)) for t in targets for i in IMPLS):
            print(f"{phase:>13} " + " ".join(f"{c:>19}" for c in cells))
    if len(targets) >= 2:
        lo, hi = min(targets), max(targets)
        for impl in IMPLS:
            r = by[(hi, impl, "layer")]["median_ms"] / by[(lo, impl, "layer")]["median_ms"]
            print(f"{impl} flatness: layer at maxvio {hi:g} / maxvio {lo:g} = {r:.3f}")
    print_memory(by, targets)
    worst = {}
    for _, errs in data["checks"]:
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    print("equality check passed: FlatEP vs baseline max relative L2 error "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tolerance {args.tolerance:g})")
    if not args.no_plot:
        sys.path.insert(0, HERE)
        from moe_layer_plot import plot

        for path in plot(csv_path, os.path.join(args.out, name)):
            print(f"wrote {path}")
    return csv_path


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not (torch.cuda.is_available() and flatep._C.has_cuda):
        sys.exit("moe_layer: --device cuda needs a GPU and FlatEP built with CUDA; use --device cpu")
    import json

    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
            rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if args.device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
            backend = "nccl" if args.device == "cuda" else "gloo"
            dist.init_process_group(backend)
            try:
                run_rank(rank, R, args, result_path)
                dist.barrier()
            finally:
                from flatep.distributed import release_transports

                release_transports()
                dist.destroy_process_group()
            if rank != 0:
                return 0
        else:
            import torch.multiprocessing as mp

            R = args.ranks
            backend = "nccl" if args.device == "cuda" and R <= torch.cuda.device_count() else "gloo"
            if args.device == "cuda" and backend == "gloo":
                print(f"note: {R} ranks on {torch.cuda.device_count()} GPU(s): ranks share GPUs and the baseline's "
                      "all-to-all runs through gloo; the times are contended, not those of R GPUs", flush=True)
            mp.spawn(_worker, args=(R, os.path.join(tmp, "rendezvous"), args, result_path), nprocs=R, join=True)
        with open(result_path) as f:
            data = json.load(f)
    write_outputs(args, R, data, backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
