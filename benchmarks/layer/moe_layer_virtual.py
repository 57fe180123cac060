#!/usr/bin/env python3
"""One MoE layer forward + backward on R *virtual* ranks in one process (one GPU): FlatEP against the standard EP
baseline, every rank's share of every phase timed, and the critical path (the slowest rank per phase) reported.

    # one GPU, MoonEP's shape with H'=1024 (eight ranks' weights, pools and fp32 gradients must fit one GPU):
    python3 benchmarks/layer/moe_layer_virtual.py --config moonep --ffn 1024 --device cuda
    python3 benchmarks/layer/moe_layer_virtual.py --config deepep --ffn 1024 --device cuda
    # CPU smoke run (its numbers are not results):
    /usr/bin/python3 benchmarks/layer/moe_layer_virtual.py --device cpu --ranks 4 --tokens 64 --hidden 64 --ffn 32 \\
        --experts 16 --topk 2 --iters 2 --warmup 1 --out /tmp/moe_layer_virtual

The layer and both implementations are those of benchmarks/layer/moe_layer.py (router, grouped FFN y = silu(x W1) W2 per
expert, weighted sum of each token's K outputs, fp32 expert gradients), written out phase by phase because the R
ranks live in one process (flatep.virtual: R ranks over the ipc transport, one CUDA stream each). How a phase is
timed depends on what it is:

* local phases (router, permutes, expert GEMMs, gradient conversion): each rank runs alone on the whole GPU, one
  after the other, and its time is what one real GPU would take;
* communication phases (FlatEP's plan, dispatch, combine, prefetch, reduce_grad; the baseline's all-to-alls): all
  ranks run at once, each on its own stream (FlatEP kernels with an SM budget of SMs / R blocks per launch, so that
  every rank's kernels are co-resident), and a rank's time runs from the common start to the end of its part
  (its own copies and its waits for the peers); a 40 ms spin on every stream before the phase lets the host enqueue
  every rank's part first, so the ranks start together rather than in launch order. The ranks share one GPU's HBM and SMs: a rank gets about 1/R of
  the GPU's bandwidth (on an H200 about as much as one NVLink direction), not a GPU of its own;
* the baseline's count exchange ends with the host learning the split sizes (a host sync), timed on the host.

Phase time of a rank = the sum of its parts in that phase; the CSV reports per phase the slowest rank (median over
--iters) and 'layer' = the sum over phases of the slowest rank (there is no end-to-end time on virtual ranks).
Before timing, each maxvio's first iteration checks that FlatEP and the baseline agree (output, input gradient,
router gradient, expert-weight gradients, within bf16 tolerance) on every rank.

FlatEP's local ops (combine_grad, write_grads) run like the local torch ops, on the whole GPU: the SM budget of
SMs / R blocks that the communication phases need (the Buffers' and pools' num_sms, set here unless FLATEP_NUM_SMS
is) is lifted for them. FlatEP's combine backward is flatep.autograd's: the output gradient is
dispatched into the receive region (zero copy) and combine_grad reads it there. The baseline's weighted-sum backward
is chunked (--baseline-unpermute lean; 'autograd' is the expression autograd runs, four [S*K, H] fp32 tensors per
rank, cached per stream: with 8 ranks on one GPU the suspected cause of the caching allocator freeing and mapping
memory again inside combine_bwd at maxvio 20, which the allocator columns show).
Both implementations add their bf16 expert gradients into fp32 main gradients (--wgrad-mode). Besides time,
per (maxvio, implementation): memory per rank (benchmarks/layer/layer_probe.py: static, the step's peak, from one extra
untimed step) and per phase the caching allocator's cache-flushing retries and device allocations (the timed
iterations). --profile-baseline DIR captures one baseline step at --profile-maxvio with torch.profiler (tables of
the top ops and kernels, the phases' ranges, a chrome trace).
"""

import argparse
import contextlib
import math
import os
import statistics
import sys
import time

# Before CUDA starts: every rank's stream on its own hardware queue (a spinning kernel must not block a peer's).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "common"))

import bench_timing  # noqa: E402
import flatep  # noqa: E402
import layer_probe  # noqa: E402
import moe_layer as ml  # noqa: E402
from flatep import testing, virtual  # noqa: E402
from flatep.nn import grouped_ffn, route  # noqa: E402

BF16 = ml.BF16
# FlatEP's A/B switches of this benchmark: (flag, choices with the default first, help); the second choices are the
# issue-48 run's (benchmarks/layer/moe_layer.py has the baseline's, --baseline-unpermute and --wgrad-mode)
AB_SWITCHES = (
    ("--flatep-local-ops", ["uncapped", "capped"],
     "FlatEP's local ops (combine_grad, write_grads) on the whole GPU or under the comm phases' SM budget"),
    ("--flatep-combine-bwd", ["region", "copy"],
     "FlatEP's combine backward rows: left in the receive region (flatep.autograd) or copied into a tensor"),
)
GATE_S = 0.04  # seconds every rank's stream waits before a communication phase (covers the host's enqueueing)


class Clock:
    """Per-rank phase times of one iteration (ms), or nothing when disabled."""

    def __init__(self, R, devices):
        self.R, self.cuda = R, devices[0].type == "cuda"
        self.devices = devices  # per rank
        self.streams = [torch.cuda.Stream(device=d) for d in devices] if self.cuda else [None] * R
        if self.cuda:  # GATE_S of spinning (see together), from the SM clock
            self.gate_cycles = bench_timing.gate_cycles(devices[0], GATE_S)
        self.enabled = False
        self.times = {}
        self.counters = layer_probe.PhaseCounters()
        self.memory = None  # a layer_probe.RankMemory during a memory step
        self._rank_memory = layer_probe.RankMemory(self.streams, devices) if self.cuda else None
        self.profiling = False  # record_function ranges "phase/<phase>/r<rank>" (under --profile-baseline)

    def sync(self):
        if self.cuda:
            for d in sorted({d.index for d in self.devices}):
                torch.cuda.synchronize(d)

    def rank_stream(self, r):
        """Context: rank r's device and stream current."""
        return _RankStream(self.devices[r], self.streams[r]) if self.cuda else contextlib.nullcontext()

    def start(self, enabled, memory=False):
        """A new step: timed when `enabled`; with `memory` (CUDA) every rank's peak memory is followed (slow: an
        untimed step)."""
        self.enabled, self.times = enabled, {}
        self.counters = layer_probe.PhaseCounters()
        self.memory = self._rank_memory if memory and self.cuda else None
        if self.memory is not None:
            self.sync()
            self.memory.start()

    def _alloc_counters(self):
        return layer_probe.alloc_counters(self.devices) if self.cuda else {}

    def _range(self, phase, r):
        return torch.profiler.record_function(f"phase/{phase}/r{r}") if self.profiling else contextlib.nullcontext()

    def _add(self, phase, r, ms):
        if self.enabled:
            self.times.setdefault(phase, [0.0] * self.R)[r] += ms

    def local(self, phase, fn):
        """fn(r) for every rank, one rank at a time; returns [fn(r)]."""
        return self.local_steps([(phase, fn)])

    def local_steps(self, steps):
        """For every rank in turn, each (phase, fn) of `steps` in order, each timed: fn(r, previous result) after the
        first (fn(r)). A rank's temporaries die before the next rank starts. Returns [last result of rank r]."""
        out = [None] * self.R
        for r in range(self.R):
            res = None
            for i, (phase, fn) in enumerate(steps):
                if self.cuda:
                    s = self.streams[r]
                    self.sync()
                    before = self._alloc_counters()
                    call = (lambda: fn(r)) if i == 0 else (lambda res=res: fn(r, res))

                    def timed(r=r, phase=phase, call=call):
                        with self.rank_stream(r), self._range(phase, r):
                            return call() if self.memory is None else self.memory.local(r, call)

                    ms, res = bench_timing.time_on_stream(s, timed)
                    self._add(phase, r, ms)
                    self.counters.add(phase, before, self._alloc_counters())
                else:
                    def timed_cpu(r=r, phase=phase, fn=fn, i=i, res=res):
                        with self._range(phase, r):
                            return fn(r) if i == 0 else fn(r, res)

                    ms, res = bench_timing.wall_ms(timed_cpu)
                    self._add(phase, r, ms)
            out[r] = res
        return out

    def together(self, phase, fn, finish=None):
        """fn(r) for every rank at once (CUDA: enqueued rank by rank, each on its stream; CPU: R threads), then
        finish(r) (on rank r's stream after every rank's fn: e.g. waiting for the peers' copies); returns [fn(r)]."""
        if not self.cuda:
            import threading

            barrier = threading.Barrier(self.R)
            times = [0.0] * self.R

            def body(r):
                barrier.wait()
                t0 = time.perf_counter()
                res = fn(r)
                barrier.wait()  # a collective ends when every rank's part is done
                if finish is not None:
                    finish(r)
                times[r] = (time.perf_counter() - t0) * 1e3
                return res

            out = virtual.run_threads(self.R, body)
            for r in range(self.R):
                self._add(phase, r, times[r])
            return out
        if self.memory is not None:
            return self.memory.collective(lambda: self._together_cuda(phase, fn, finish))
        return self._together_cuda(phase, fn, finish)

    def _together_cuda(self, phase, fn, finish):
        self.sync()
        before = self._alloc_counters()

        def ranged(r):
            with self._range(phase, r):
                return fn(r)

        # A gate: every stream first spins for GATE_S, longer than the host takes to enqueue every rank's part, so the
        # ranks start together (as R processes would) instead of in host launch order; the timing starts after it.
        t = bench_timing.ranks_together(self.streams, ranged, self.gate_cycles, finish=finish, enter=self.rank_stream,
                                        sync=self.sync)
        for r in range(self.R):
            self._add(phase, r, t.ms[r])
        self.counters.add(phase, before, self._alloc_counters())
        return t.out

    def host(self, phase, fn):
        """fn() once (it involves every rank and a host sync); its host time counts for every rank."""
        self.sync()
        before = self._alloc_counters()
        ms, res = bench_timing.wall_ms(fn)
        for r in range(self.R):
            self._add(phase, r, ms)
        self.counters.add(phase, before, self._alloc_counters())
        return res


class _RankStream:
    def __init__(self, device, stream):
        self.dev, self.stream = torch.cuda.device(device), torch.cuda.stream(stream)

    def __enter__(self):
        self.dev.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *a):
        self.stream.__exit__(*a)
        self.dev.__exit__(*a)
        return False


class World:
    """Everything both implementations share: sizes, per-rank inputs and weights, the clock."""

    def __init__(self, args, devices):
        self.args, self.devices = args, devices  # devices[r]: rank r's
        self.R, self.S, self.H, self.F = args.ranks, args.tokens, args.hidden, args.ffn
        self.E, self.K = args.experts, args.topk
        self.epn = self.E // self.R
        self.clock = Clock(self.R, devices)
        gr = torch.Generator(device=devices[0]).manual_seed(args.seed)
        router = torch.randn(self.E, self.H, device=devices[0], generator=gr) / self.H**0.5
        self.routers = [router.to(d, copy=True) for d in devices]  # replicated router: one copy per rank
        self.x, self.grad_out = [], []
        for r, dev in enumerate(devices):
            g = torch.Generator(device=dev).manual_seed(args.seed * 7919 + r + 1)
            self.x.append(torch.randn(self.S, self.H, device=dev, generator=g).to(BF16))
            self.grad_out.append(torch.randn(self.S, self.H, device=dev, generator=g).to(BF16))

    def route_fwd(self, r, topk_idx, router):
        """Router of rank r with autograd (x and router leaves); returns (x_leaf, weights, idx, xb)."""
        x = self.x[r].detach().requires_grad_()
        with torch.enable_grad():
            weights, idx = route(x, router, self.K, topk_idx)
        return x, weights, idx, x.detach().to(BF16)

    def router_bwd(self, r, x_leaf, weights, grad_weights, grad_xb):
        """Rank r's router backward (autograd through route from the routing weights' gradient) and its input
        gradient from both paths, x.grad + the rows' gradient grad_xb [S, H] bf16, summed in fp32 (one pass over
        grad_xb): the same code for both implementations."""
        torch.autograd.backward(weights, grad_weights)
        return x_leaf.grad.float().add_(grad_xb)


class Baseline:
    """Count exchange with a host sync, permute, exact-size all-to-all, grouped FFN, the reverse path."""

    name = "baseline"

    def __init__(self, w, own_weights, own_grads):
        self.w = w
        R = w.R
        self.routers = [t.clone().requires_grad_() for t in w.routers]
        self.w1 = [own_weights[r][0] for r in range(R)]  # the same expert weights as FlatEP's own experts
        if w.args.inject_mismatch:  # tests: the equality check must catch a baseline that computes something else
            self.w1 = [(t.float() * 1.25).to(BF16) for t in self.w1]
        self.w2 = [own_weights[r][1] for r in range(R)]
        self.main = own_grads  # fp32 main gradients (shared memory with FlatEP's own grads; timing only)
        self.keep_grads = False  # the equality check sets it: keep fp32 copies of the weight gradients
        self.lean = w.args.baseline_unpermute == "lean"
        # persistent bytes per rank of a real baseline: its bf16 expert weights and their fp32 main gradients
        self.static_bytes = layer_probe.tensor_bytes(self.w1[0], self.w2[0], *self.main[0])

    def a2a(self, phase, send, send_splits, recv_splits):
        """send[r]: rows of rank r ordered by destination, send_splits[r][d] rows for d. Returns recv[d], rows by
        source. Every rank copies its blocks into the destinations' buffers at once; a rank is done when every
        block it receives has arrived."""
        w, R = self.w, self.w.R
        recv = []
        for d in range(R):  # on the destination's stream: its memory is the destination rank's
            with w.clock.rank_stream(d):
                recv.append(torch.empty(sum(recv_splits[d]), w.H, dtype=BF16, device=w.devices[d]))
        sent_ev = [None] * R
        in_off = [[sum(recv_splits[d][:s]) for s in range(R)] for d in range(R)]

        def copy(r):
            o = 0
            for d in range(R):
                n = send_splits[r][d]
                if n:
                    recv[d][in_off[d][r]:in_off[d][r] + n].copy_(send[r][o:o + n], non_blocking=True)
                o += n
            if w.clock.cuda:
                sent_ev[r] = torch.cuda.Event()
                sent_ev[r].record()

        def wait_peers(d):
            if w.clock.cuda:
                for s in range(R):
                    torch.cuda.current_stream().wait_event(sent_ev[s])

        w.clock.together(phase, copy, wait_peers)
        return recv

    def step(self, topk_idx, timed, memory=False, accumulate=True):
        w, R, K, epn, E = self.w, self.w.R, self.w.K, self.w.epn, self.w.E
        c = w.clock
        c.start(timed, memory)
        for r in range(R):
            self.routers[r].grad = None
        fwd = c.local("router_fwd", lambda r: w.route_fwd(r, topk_idx[r], self.routers[r]))
        xs, weights, idxs, xbs = zip(*fwd)
        counts_host = c.host("plan", lambda: [
            torch.bincount(i.reshape(-1), minlength=E).cpu().tolist() for i in idxs
        ])
        send_splits = [[sum(counts_host[r][d * epn:(d + 1) * epn]) for d in range(R)] for r in range(R)]
        recv_matrix = [[counts_host[s][d * epn:(d + 1) * epn] for s in range(R)] for d in range(R)]  # [d][s][j]
        recv_splits = [[sum(recv_matrix[d][s]) for s in range(R)] for d in range(R)]

        def permute(r):
            order, token_of = ml.by_expert(idxs[r], K)
            return order, token_of, xbs[r].index_select(0, token_of)

        orders, token_ofs, sent = zip(*c.local("dispatch_fwd", permute))
        recv = self.a2a("dispatch_fwd", sent, send_splits, recv_splits)

        def regroup(d):
            order, offs = ml.by_local_expert(torch.tensor(recv_matrix[d], device=w.devices[d]))  # [s][j]
            return order, offs, recv[d].index_select(0, order)

        regroups, offs, recv_x = zip(*c.local("dispatch_fwd", regroup))
        del recv

        def gemm(d):
            leaf = recv_x[d].detach().requires_grad_()
            w1 = self.w1[d].detach().requires_grad_()
            w2 = self.w2[d].detach().requires_grad_()
            with torch.enable_grad():
                y = grouped_ffn(leaf, w1, w2, offs[d])
            return y, leaf, w1, w2

        graphs = c.local("gemm_fwd", gemm)
        del recv_x

        def unpermute(d):
            inverse = torch.empty_like(regroups[d])
            inverse[regroups[d]] = torch.arange(regroups[d].numel(), device=w.devices[d])
            return graphs[d][0].detach().index_select(0, inverse)

        back_send = c.local("combine_fwd", unpermute)
        back = self.a2a("combine_fwd", back_send, recv_splits, send_splits)
        del back_send

        def weighted_sum(r):
            w_sorted = weights[r].detach().reshape(-1).index_select(0, orders[r])
            return ml.weighted_sum(back[r], w_sorted, token_ofs[r], w.S), w_sorted

        outs, w_sorted = zip(*c.local("combine_fwd", weighted_sum))

        # ---- backward ----
        def combine_bwd_local(r):
            if self.lean:  # chunked: no [S*K, H] fp32 temporaries
                grad_back, grad_w_sorted = ml.weighted_unpermute_backward(w.grad_out[r], token_ofs[r], back[r],
                                                                          w_sorted[r])
            else:  # what autograd runs for the forward expression: four [S*K, H] fp32 tensors
                g = w.grad_out[r].float().index_select(0, token_ofs[r])
                grad_w_sorted = (g * back[r].float()).sum(1)
                grad_back = (g * w_sorted[r].unsqueeze(1)).to(BF16)
            grad_w = torch.empty_like(grad_w_sorted)
            grad_w[orders[r]] = grad_w_sorted
            return grad_back, grad_w.view(w.S, K)

        grad_back, grad_weights = zip(*c.local("combine_bwd", combine_bwd_local))
        del back
        grad_perm = self.a2a("combine_bwd", grad_back, send_splits, recv_splits)
        del grad_back
        grad_y = c.local("combine_bwd", lambda d: grad_perm[d].index_select(0, regroups[d]))
        del grad_perm

        gw_check = [None] * R

        def gemm_bwd(d):
            y, leaf, w1, w2 = graphs[d]
            graphs[d] = None
            g = torch.autograd.grad(y, [w1, w2, leaf], grad_y[d])
            grad_y[d] = None
            return g

        def wgrad(d, g):
            with torch.no_grad():
                for main, grad in zip(self.main[d], g[:2]):
                    if accumulate:  # Megatron's main_grad
                        main.add_(grad)
                    else:
                        main.copy_(grad)
            if self.keep_grads:
                gw_check[d] = (g[0], g[1])  # bf16, as computed
            return g[2]

        def to_sources(d, grad_recv):
            g = torch.empty_like(grad_recv)
            g[regroups[d]] = grad_recv
            return g

        graphs, grad_y = list(graphs), list(grad_y)
        grad_recv_perm = c.local_steps([("gemm_bwd", gemm_bwd), ("wgrad_fp32", wgrad), ("dispatch_bwd", to_sources)])
        grad_sent = self.a2a("dispatch_bwd", grad_recv_perm, recv_splits, send_splits)
        del grad_recv_perm

        def scatter_tokens(r):  # fp32 sums of a token's K row gradients, one rounding: the gradient of bf16 rows
            g = torch.zeros(w.S, w.H, dtype=torch.float32, device=w.devices[r])
            return g.index_add_(0, token_ofs[r], grad_sent[r].float()).to(BF16)

        grad_xb = c.local("dispatch_bwd", scatter_tokens)
        del grad_sent

        grad_x = c.local("router_bwd", lambda r: w.router_bwd(r, xs[r], weights[r], grad_weights[r], grad_xb[r]))
        loads = [sum(recv_splits[d]) for d in range(R)]
        result = dict(out=outs, grad_x=grad_x, grad_router=[t.grad for t in self.routers],
                      grad_w1=[g[0] for g in gw_check] if self.keep_grads else None,
                      grad_w2=[g[1] for g in gw_check] if self.keep_grads else None, rows_max=max(loads))
        return result, c.times


class FlatEP:
    name = "flatep"

    def __init__(self, w, ranks, num_sms=None):
        self.w = w
        R, a = w.R, w.args
        devs = w.devices
        self.routers = [t.clone().requires_grad_() for t in w.routers]
        self.buffers = virtual.run_threads(
            R, lambda r: flatep.Buffer(ranks[r], w.S, w.H, w.E, w.K, a.align, a.capacity_factor, device=devs[r],
                                       num_sms=num_sms))
        self.pools = virtual.run_threads(
            R, lambda r: flatep.ExpertPools(ranks[r], w.epn, [(w.H, w.F), (w.F, w.H)], device=devs[r],
                                            num_sms=num_sms))
        self.layers = [p.register_layer() for p in self.pools]
        for r in range(R):
            dev = devs[r]
            g = torch.Generator(device=dev).manual_seed(a.seed * 7919 + 100 + r)
            with torch.no_grad():
                self.layers[r].own_weights(0).copy_(
                    (torch.randn(w.epn, w.H, w.F, device=dev, generator=g) / w.H**0.5).to(BF16))
                self.layers[r].own_weights(1).copy_(
                    (torch.randn(w.epn, w.F, w.H, device=dev, generator=g) / w.F**0.5).to(BF16))
        self.plans = None
        self.static_bytes = 0  # set by run(): the Buffer's and pools' device memory per rank
        self.local_uncapped = a.flatep_local_ops == "uncapped"
        self.rows_in_region = a.flatep_combine_bwd == "region"

    def own_weights(self):
        return [(L.own_weights(0), L.own_weights(1)) for L in self.layers]

    def own_grads(self):
        return [(L.own_grads(0), L.own_grads(1)) for L in self.layers]

    def _combine_grad(self, r, plan, rows, y, recv_w):
        # as flatep.autograd's combine backward (Buffer._combine_backward_raw: rows in the receive region), on the
        # whole GPU (num_sms 0 for this call: no cap) unless --flatep-local-ops capped: a local op
        num_sms = 0 if self.local_uncapped else -1
        return self.buffers[r]._combine_grad_raw(plan, rows, y, recv_w, num_sms=num_sms)

    def _write_grads(self, r, plan, grads, accumulate):
        num_sms = 0 if self.local_uncapped else None
        for p in range(2):  # own experts and the slots used this step, as flatep.nn does (accumulate: main_grad)
            self.pools[r].write_grads(plan, self.layers[r], p, grads[p], accumulate=accumulate, num_sms=num_sms)

    def _combine_bwd_rows(self, r, plan, grad_out):
        """The output gradient dispatched back to the rows: into the receive region (flatep.autograd's path) or,
        --flatep-combine-bwd copy, into a tensor of its own (the path before issue 48)."""
        if self.rows_in_region:
            return self.buffers[r]._dispatch_region_raw(plan, grad_out)
        return self.buffers[r]._dispatch_raw(plan, grad_out, None, want_weights=False, zero_fill=False)[0]

    def step(self, topk_idx, timed, memory=False, accumulate=True):
        w, R = self.w, self.w.R
        c, B, P, L = w.clock, self.buffers, self.pools, self.layers
        c.start(timed, memory)
        for r in range(R):
            self.routers[r].grad = None
        fwd = c.local("router_fwd", lambda r: w.route_fwd(r, topk_idx[r], self.routers[r]))
        xs, weights, idxs, xbs = zip(*fwd)
        plans = c.together("plan", lambda r: B[r].plan(idxs[r]))
        self.plans = plans
        recv = c.together("dispatch_fwd", lambda r: B[r]._dispatch_raw(plans[r], xbs[r], weights[r].detach()))
        c.together("prefetch", lambda r: P[r].prefetch(plans[r], L[r]))

        def gemm(r):
            leaf = recv[r][0].detach().requires_grad_()
            w1 = L[r].weights(0).detach().requires_grad_()
            w2 = L[r].weights(1).detach().requires_grad_()
            with torch.enable_grad():
                y = grouped_ffn(leaf, w1, w2, plans[r].cu_seqlens)
            return y, leaf, w1, w2

        graphs = c.local("gemm_fwd", gemm)
        outs = c.together("combine_fwd", lambda r: B[r]._combine_raw(plans[r], graphs[r][0].detach(), recv[r][1]))

        # ---- backward ----
        rows = c.together("combine_bwd", lambda r: self._combine_bwd_rows(r, plans[r], w.grad_out[r]))
        grads_y = c.local("combine_bwd", lambda r: self._combine_grad(r, plans[r], rows[r], graphs[r][0].detach(),
                                                                      recv[r][1]))
        del rows
        c.together("prefetch_bwd", lambda r: P[r].prefetch(plans[r], L[r]))

        graphs = list(graphs)

        def gemm_bwd(r):
            y, leaf, w1, w2 = graphs[r]
            graphs[r] = None
            return torch.autograd.grad(y, [w1, w2, leaf], grads_y[r][0])

        def wgrad(r, g):
            self._write_grads(r, plans[r], g, accumulate)
            return g[2].to(BF16).contiguous()

        grad_recv = c.local_steps([("gemm_bwd", gemm_bwd), ("wgrad_fp32", wgrad)])
        c.together("reduce_grad", lambda r: P[r].reduce_grad(plans[r], L[r]))
        grad_xb = c.together("dispatch_bwd", lambda r: B[r]._combine_raw(plans[r], grad_recv[r], None))
        del grad_recv
        grad_w = c.together("dispatch_bwd", lambda r: B[r]._entry_values_raw(plans[r], grads_y[r][1]))

        grad_x = c.local("router_bwd", lambda r: w.router_bwd(r, xs[r], weights[r], grad_w[r], grad_xb[r]))
        result = dict(out=outs, grad_x=grad_x, grad_router=[t.grad for t in self.routers],
                      grad_w1=[L[r].own_grads(0) for r in range(R)], grad_w2=[L[r].own_grads(1) for r in range(R)],
                      rows_max=max(plans[0].stats["loads"]))
        return result, c.times


def ranks_num_sms(args, gpus):
    """Blocks per launch of every rank's FlatEP kernels, so that the R ranks' kernels of a collective phase are
    co-resident: the SMs of a GPU over the ranks it holds (None on the CPU, or where the environment sets the
    library's budget: FLATEP_NUM_SMS)."""
    if args.device != "cuda" or os.environ.get("FLATEP_NUM_SMS"):
        return None
    sms = torch.cuda.get_device_properties(gpus[0]).multi_processor_count
    return max(1, sms // (args.ranks // args.gpus))


def static_flatep_bytes(make, devices, R):
    """make() builds FlatEP's objects; returns (its result, device memory per rank they took outside torch's
    allocator: the free memory they took, less torch's own growth meanwhile)."""
    cuda = sorted({d.index for d in devices if d.type == "cuda"})
    for i in cuda:
        torch.cuda.synchronize(i)
    free = sum(torch.cuda.mem_get_info(i)[0] for i in cuda)
    reserved = sum(torch.cuda.memory_reserved(i) for i in cuda)
    made = make()
    for i in cuda:
        torch.cuda.synchronize(i)
    took = free - sum(torch.cuda.mem_get_info(i)[0] for i in cuda)
    grown = sum(torch.cuda.memory_reserved(i) for i in cuda) - reserved
    return made, max(0, took - grown) // R if cuda else 0


def records_of(samples, target, realised, sigma, rows, memory):
    """CSV records of one maxvio: per implementation and phase the slowest rank (median over iterations), the
    allocator's counts, the implementation's memory; then sum_phases and layer."""
    records = []
    for name, its in samples.items():
        per_phase = {}
        for times, _ in its:
            for phase, per_rank in times.items():
                per_phase.setdefault(phase, []).append(per_rank)
        crit = [sum(max(v) for v in times.values()) for times, _ in its]
        common = dict(maxvio_target=target, maxvio=round(realised, 4), sigma=round(sigma, 5), impl=name,
                      rows_max=rows[name], **memory.get(name, {}))
        for phase in ml.PHASES:
            if phase not in per_phase:
                continue
            vals = per_phase[phase]
            counts = layer_probe.alloc_columns([c.get(phase, {}) for _, c in its])
            records.append(dict(common, phase=phase, median_ms=statistics.median(max(v) for v in vals),
                                mean_rank_ms=statistics.median(sum(v) / len(v) for v in vals),
                                min_rank_ms=statistics.median(min(v) for v in vals), **counts))
        for phase in ("sum_phases", "layer"):
            records.append(dict(common, phase=phase, median_ms=statistics.median(crit),
                                mean_rank_ms=statistics.median(crit), min_rank_ms=statistics.median(crit)))
    return records


def profile_baseline(args, w, base, topk_idx, target):
    """One baseline step at this maxvio under torch.profiler into args.profile_baseline (layer_probe.profile_step),
    plus <tag>_clock.txt: the same step's phase times per rank and allocator counters."""
    tag = f"baseline_{args.baseline_unpermute}_maxvio{target:g}"
    w.clock.profiling = True
    try:
        accumulate = args.wgrad_mode == "accumulate"
        (_, times), paths = layer_probe.profile_step(lambda: base.step(topk_idx, True, accumulate=accumulate),
                                                     args.profile_baseline, tag, w.devices)
    finally:
        w.clock.profiling = False
    clock = os.path.join(args.profile_baseline, f"{tag}_clock.txt")
    with open(clock, "w") as f:
        f.write(f"# {tag}: the profiled step's phase times per rank (ms; local parts alone on the GPU) and the "
                f"caching allocator's counters per phase (summed over ranks)\n")
        for phase, per_rank in times.items():
            counts = w.clock.counters.by_phase.get(phase, {})
            f.write(f"{phase:>13} max {max(per_rank):9.3f}  ranks " + " ".join(f"{v:8.3f}" for v in per_rank)
                    + "  " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())) + "\n")
    for path in paths + [clock]:
        print(f"wrote {path}", flush=True)


def run(args):
    R = args.ranks
    if args.device == "cuda":
        gpus = [torch.device("cuda", i) for i in range(args.gpus)]
    else:
        gpus = [torch.device("cpu")]
        torch.set_num_threads(1)
    ranks = virtual.virtual_ranks(R, gpus, timeout_s=args.timeout)
    w = World(args, [v.device for v in ranks])
    flat, flat_static = static_flatep_bytes(lambda: FlatEP(w, ranks, ranks_num_sms(args, gpus)), w.devices, R)
    flat.static_bytes = flat_static
    base = Baseline(w, flat.own_weights(), flat.own_grads())
    impls = [base, flat]
    accumulate = args.wgrad_mode == "accumulate"
    profile_at = None
    if args.profile_baseline:
        profile_at = args.profile_maxvio if args.profile_maxvio is not None else max(args.maxvio)
    records, checks = [], []
    for target in args.maxvio:
        reachable = 0.9 * (w.E / w.K - 1)
        goal = min(target, reachable)
        if target > reachable:
            print(f"note: maxvio {target:g} is unreachable with E={w.E}, K={w.K}; using {reachable:g}", flush=True)
        sigma = 0.0 if target == 0 else testing.sigma_for_maxvio(goal, R, w.E, w.S, w.K, seed=args.seed)
        realised = testing.maxvio(testing.generate_counts(R, w.E, w.S, w.K, sigma=sigma, seed=args.seed))
        topk_idx = [testing.sample_topk(w.E, w.S, w.K, r, sigma=sigma, seed=args.seed).to(w.devices[r]).long()
                    for r in range(R)]
        # The check: same inputs, routing and weights for both; the baseline's results are kept (its weight gradients
        # in bf16, as computed) while FlatEP's are compared where they live (its fp32 own grads, overwritten in this
        # step, are also the baseline's main gradients in the timing steps later, which share that memory).
        base.keep_grads = True
        ref, _ = base.step(topk_idx, False, accumulate=False)
        base.keep_grads = False
        res, _ = flat.step(topk_idx, False, accumulate=False)
        worst = {}
        for field in ["out", "grad_x", "grad_router", "grad_w1", "grad_w2"]:
            worst[field] = max(ml.rel_l2(res[field][r], ref[field][r]) for r in range(R))
        rows = {"baseline": ref["rows_max"], "flatep": res["rows_max"]}
        del ref, res
        checks.append((target, worst))
        if any(not math.isfinite(v) or v > args.tolerance for v in worst.values()):
            raise RuntimeError(f"EQUALITY CHECK FAILED at maxvio {target:g}: FlatEP vs baseline relative L2 errors "
                               f"{ {k: f'{v:.2e}' for k, v in worst.items()} } exceed tolerance {args.tolerance:g}")
        for impl in impls:
            for _ in range(max(args.warmup - 1, 0)):
                impl.step(topk_idx, False, accumulate=accumulate)
        memory = {}
        if w.clock.cuda:  # one untimed step each, every rank's memory followed
            for impl in impls:
                impl.step(topk_idx, False, memory=True, accumulate=accumulate)
                peak = max(w.clock.memory.step_peak)
                memory[impl.name] = layer_probe.memory_columns(impl.static_bytes, peak)
        samples = {impl.name: [] for impl in impls}
        for _ in range(args.iters):
            for impl in impls:  # interleaved
                _, times = impl.step(topk_idx, True, accumulate=accumulate)
                samples[impl.name].append((times, w.clock.counters.by_phase))
        records += records_of(samples, target, realised, sigma, rows, memory)
        if profile_at is not None and math.isclose(target, profile_at):
            profile_baseline(args, w, base, topk_idx, target)
        print(f"maxvio {target:g} done", flush=True)
    for impl in impls:
        impl.__dict__.clear()
    return {"records": records, "checks": checks}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False)  # this script's flags; the rest are moe_layer.py's
    own.add_argument("--gpus", type=int, default=1, help="GPUs the R ranks are spread over (equal blocks)")
    own.add_argument("--timeout", type=float, default=60.0, help="seconds any cross-rank wait may take")
    own.add_argument("--profile-baseline", metavar="DIR", default=None,
                     help="capture one baseline step with torch.profiler at --profile-maxvio into DIR")
    own.add_argument("--profile-maxvio", type=float, default=None,
                     help="the maxvio (one of --maxvio) of --profile-baseline; default the largest")
    for flag, choices, what in AB_SWITCHES:  # the first choice is the default
        own.add_argument(flag, choices=choices, default=choices[0], help=what)
    extra, rest = own.parse_known_args(argv)
    args = ml.parse_args(rest)
    args.command = " ".join(["benchmarks/layer/moe_layer_virtual.py"] + argv)
    args.timeout, args.gpus = extra.timeout, extra.gpus
    args.profile_baseline, args.profile_maxvio = extra.profile_baseline, extra.profile_maxvio
    args.flatep_local_ops, args.flatep_combine_bwd = extra.flatep_local_ops, extra.flatep_combine_bwd
    if args.profile_maxvio is not None and not any(math.isclose(args.profile_maxvio, m) for m in args.maxvio):
        sys.exit(f"moe_layer_virtual: --profile-maxvio {args.profile_maxvio:g} is not one of --maxvio "
                 f"{' '.join(format(m, 'g') for m in args.maxvio)}")
    if args.device == "cuda" and (args.gpus < 1 or args.ranks % args.gpus or args.gpus > torch.cuda.device_count()):
        sys.exit(f"moe_layer_virtual: --gpus {args.gpus} must divide --ranks {args.ranks} and be at most the "
                 f"{torch.cuda.device_count()} GPUs here")
    if args.device == "cuda" and not (torch.cuda.is_available() and flatep._C.has_cuda):
        sys.exit("moe_layer_virtual: --device cuda needs a GPU and FlatEP built with CUDA; use --device cpu")
    if args.tag is None:
        args.tag = ml.slug(ml.device_name(args)) + "-virtual"
    data = run(args)
    where = "" if args.device == "cpu" else (f" on {args.gpus} GPUs ({args.ranks // args.gpus} per GPU)"
                                             if args.gpus > 1 else " on one GPU")
    ml.write_outputs(args, args.ranks, data, f"{args.ranks} virtual ranks in one process{where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
