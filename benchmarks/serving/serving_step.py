#!/usr/bin/env python3
"""A whole serving step through the public Python API, expert GEMM included, on R virtual ranks of one GPU (issue 43).

Each rank runs ``flatep.nn.MoE(..., num_slots=B)`` forward under ``torch.inference_mode()``: router (the routing is
given: topk_idx), plan, dispatch, prefetch of the B slots (serving: a pull; B = epn is the training layout, a push),
the grouped GEMM of the expert FFN over the weights view with offs = cu_seqlens (torch._grouped_mm on a GPU; on the
CPU backend nn.MoE's loop over groups, flatep.ffn.grouped_ffn) and the weighted combine. Rows (modes), per preset:

    s = S (prefill) and s = --decode-tokens (128):  balanced_b<B> (B = --slots, 4), balanced_bepn (B = epn)
    s = --decode-tokens:                            owner (the owner planner on the B-slot layer: no replica, no
                                                    prefetch; MoE.use_planner("owner", s))

Every mode plans for its own s: the layer's Buffer is the one for (planner, s) (MoE.use_planner(planner, s)), so a
decode step's receive rows are sized for decode, as a server would run it.

    python3 benchmarks/serving/serving_step.py --preset deepep --ffn 1536 --iters 10 --csv serving_step_deepep.csv
    python3 benchmarks/serving/serving_step.py --preset k3 --iters 10 --csv serving_step_k3.csv
    PYTHONPATH=python:build/python /usr/bin/python3 benchmarks/serving/serving_step.py --quick --device cpu \
        --csv /tmp/q.csv

Presets: deepep (R=8, S=4096, E=256, H=7168, K=8, F=2048, uniform routing), k3 (R=8, S=4096, E=896, H=7168, K=8,
F=512, routing skew maxvio 1 as serving_bench's k3: sigma by bisection, seed 42); --ffn overrides F, --quick is a tiny
shape (R=4, S=256, E=32, H=64, K=4, F=32, maxvio 1).

Timing. CUDA: each rank's step is captured as one CUDA graph on its own stream (after two eager steps); before
timing, replays on two sets of inputs must equal the eager steps on the same inputs bitwise (the script exits 1
otherwise). A timed step: every rank's stream waits for one event recorded after a --gate-ms spin on a gate stream
(so the host has enqueued every rank's replay before any starts), then replays its graph; the time runs from that
event to the last rank's end event (CUDA events). enqueue_us is the host's time to enqueue the R replays; 'late'
counts timed steps whose enqueueing outlasted the gate (their ranks did not start together). The R ranks share one
GPU (its SMs and HBM): a step's time is R ranks' work on one GPU, so compare modes (the ratio columns), not absolute
numbers against one rank of a real cluster. FLATEP_NUM_SMS is set to SMs / R unless given (co-resident ranks).
CPU backend (no graphs): eager steps, the R ranks on R threads, from a common start to the last rank's end.
Reported: median, min and max over --iters after --warmup.

Ratios (columns vs, ratio): balanced_b<B> / balanced_bepn at each s, owner / balanced_b<B> at s = --decode-tokens.

Weights. nn.MoE draws its experts on the host (seeded torch.randn, about 0.1 s per K3 expert per core, for every
layer built: minutes at these shapes); here the layers are built with that draw swapped for zeros (no_host_init)
and each rank's experts are then drawn on the device, in place, at nn.MoE's scales (fill_experts). --library-init
keeps nn.MoE's own init.

Memory. The B = epn layer is the training layout (nn.MoE with num_slots=epn): its pools hold the own bf16 weights,
epn slots, fp32 gradients and fp32 reduce pools, 6x the own weights; the B-slot layer holds the own weights and B
slots. The two layers run one after the other (the first is released before the second is built). Before allocating
anything the script prints its estimate of each phase's bytes per rank and refuses (exit 2, one line naming the
largest --ffn that fits) when R ranks would not fit the free device memory (--memory-gib overrides it). deepep at
F=2048 needs about 154 GiB for 8 ranks at B = epn, more than one H200 holds: scripts/device_serving.sh runs it at
F=1536 (about 118 GiB).
"""

import argparse
import contextlib
import csv
import gc
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))  # source checkout: python/ (the extension: PYTHONPATH)
sys.path.insert(0, os.path.join(HERE, "..", "common"))  # bench_timing

from flatep import virtual  # noqa: E402  (first: it sets CUDA's loading mode before CUDA starts)
import torch  # noqa: E402

import bench_timing  # noqa: E402
import flatep  # noqa: E402
from flatep import testing  # noqa: E402
from flatep.nn import DEFAULT_ALIGN  # noqa: E402

GIB = 1 << 30
BF16 = torch.bfloat16
PRESETS = {
    "deepep": dict(ranks=8, tokens=4096, experts=256, hidden=7168, topk=8, ffn=2048, maxvio=0.0),
    "k3": dict(ranks=8, tokens=4096, experts=896, hidden=7168, topk=8, ffn=512, maxvio=1.0),
    # Kimi K3's model shape (H=3584, K=16, E=896) at the k3 preset's F and skew
    "k3model": dict(ranks=8, tokens=4096, experts=896, hidden=3584, topk=16, ffn=512, maxvio=1.0),
    "quick": dict(ranks=4, tokens=256, experts=32, hidden=64, topk=4, ffn=32, maxvio=1.0),
}
COLUMNS = ["preset", "device", "timing", "R", "S", "E", "H", "K", "F", "maxvio", "s", "mode", "planner", "B",
           "view_rows", "recv_rows", "rows_max", "replicas", "experts_max", "experts_mean", "weight_mb_max",
           "weight_mb_sum", "median_us", "min_us", "max_us", "iters", "enqueue_us", "late", "vs", "ratio",
           "bytes_ratio"]
SLACK_BYTES = 3 * GIB // 2  # torch's context growth, cuBLAS workspaces, allocator rounding (besides 2% of the total)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["deepep", "k3", "k3model"], default="deepep")
    p.add_argument("--quick", action="store_true", help="a tiny shape (R=4, S=256, E=32, H=64, K=4, F=32)")
    p.add_argument("--ffn", type=int, default=None, help="F of the expert FFN (default: the preset's)")
    p.add_argument("--slots", type=int, default=4, help="B of the serving layer (< epn)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens per call of the decode rows (<= S)")
    p.add_argument("--decode-sweep", type=lambda t: [int(v) for v in t.split(",")], default=None,
                   help="decode only: balanced B=--slots and owner at each s of this comma list (e.g. 1,16,128,512), "
                        "no prefill and no B=epn layer")
    p.add_argument("--maxvio", type=float, default=None, help="routing skew (default: the preset's; 0 = uniform)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gate-ms", type=float, default=10.0, help="CUDA: spin before each timed step (see docstring)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory to fit in (default: free device memory; CPU: available host memory)")
    p.add_argument("--library-init", action="store_true",
                   help="nn.MoE's own expert init (seeded draws on the host: minutes at the presets' shapes) instead "
                        "of device randoms written into the layers' weights (see build_layers)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any cross-rank wait may take")
    p.add_argument("--csv", default=None)
    a = p.parse_args(argv)
    a.preset_name = "quick" if a.quick else a.preset
    shape = PRESETS[a.preset_name]
    for key, value in shape.items():
        if key == "ffn" and a.ffn is not None or key == "maxvio" and a.maxvio is not None:
            continue
        setattr(a, key, value)
    a.align = DEFAULT_ALIGN
    a.epn = a.experts // a.ranks
    for name, value, ok, accepted in (
        ("--ffn", a.ffn, a.ffn >= 1 and a.ffn * a.hidden % 8 == 0, "a positive int with F*H a multiple of 8"),
        ("--slots", a.slots, 0 <= a.slots < a.epn, f"in [0, epn={a.epn})"),
        ("--decode-tokens", a.decode_tokens, 1 <= a.decode_tokens <= a.tokens, f"in [1, S={a.tokens}]"),
        ("--decode-sweep", a.decode_sweep, all(1 <= v <= a.tokens for v in a.decode_sweep or [1]),
         f"a comma list of ints in [1, S={a.tokens}]"),
        ("--iters", a.iters, a.iters >= 1, ">= 1"),
        ("--warmup", a.warmup, a.warmup >= 0, ">= 0"),
        ("--maxvio", a.maxvio, a.maxvio >= 0, ">= 0"),
    ):
        if not ok:
            p.error(f"{name} must be {accepted}, got {value}")
    return a


# ---- memory estimate ----


def round_up(v, m):
    return (v + m - 1) // m * m


def recv_rows(a, planner, s):
    """NvS of the Buffer for (planner, s) (design §4/§5): balanced, exact mode: round_up(s*K + 2*epn*(align-1));
    owner: round_up(R*s*K + epn*(align-1))."""
    if planner == "owner":
        return round_up(a.ranks * s * a.topk + a.epn * (a.align - 1), a.align)
    return round_up(s * a.topk + 2 * a.epn * (a.align - 1), a.align)


def expert_bytes(a, ffn):
    """One expert's bf16 weights, swiglu: W1 [H, 2F] and W2 [F, H]."""
    return (a.hidden * 2 * ffn + ffn * a.hidden) * 2


def phase_bytes(a, ffn, num_slots, steps):
    """(static per rank, step temporaries per rank, warm-up transient of one rank, parts) in bytes for the layer of
    num_slots B and its steps [(planner, s)]."""
    eb, epn, H, E = expert_bytes(a, ffn), a.epn, a.hidden, a.experts
    own = epn * eb
    training = num_slots == epn
    pools = own * 6 if training else own + num_slots * eb + 4 * 2 * 2**20  # + a shared gap granule per projection
    # symmetric region: receive rows and combine partials (bf16 [NvS, H] each), weights, chain staging, marks
    buffers = sum(recv_rows(a, pl, s) * (4 * H + 16) + 16 * 2**20 for pl, s in steps)
    nvs = max(recv_rows(a, pl, s) for pl, s in steps)
    s_max = max(s for _, s in steps)
    # The expert FFN's live tensors over NvS rows: recv_x, h [2F], h in fp32, silu(gate) and the product (fp32);
    # later recv_x, h, a [F] and y. Per token: the input, its fp32 copy (route), the output, logits and softmax.
    temps = nvs * max(2 * H + 20 * ffn, 4 * H + 6 * ffn) + s_max * (H * 8 + E * 12)
    parts = dict(own_weights=own, pools=pools, buffers=buffers, temps=temps)
    return pools + buffers, temps, parts


def phase_need(a, ffn, num_slots, steps):
    static, temps, parts = phase_bytes(a, ffn, num_slots, steps)
    peak = a.ranks * (static + temps)
    return int(peak * 1.02) + (SLACK_BYTES if a.device == "cuda" else 0), parts


def size_text(n):
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def available_bytes(a):
    if a.memory_gib is not None:
        return int(a.memory_gib * GIB), "--memory-gib"
    if a.device == "cuda":
        return torch.cuda.mem_get_info(0)[0], "free on cuda:0"
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available host memory"


def check_memory(a, phases):
    """Prints each phase's estimate; exits 2 with one line when one does not fit."""
    avail, where = available_bytes(a)
    worst = None
    for num_slots, steps in phases:
        need, parts = phase_need(a, a.ffn, num_slots, steps)
        layout = "training layout: own + epn slots + fp32 grads + fp32 reduce pools" if num_slots == a.epn else (
            f"serving: own + {num_slots} slots")
        print(f"memory estimate, B={num_slots} ({layout}): per rank pools {size_text(parts['pools'])} (own bf16 "
              f"weights {size_text(parts['own_weights'])}), buffers {size_text(parts['buffers'])}, step temporaries "
              f"{size_text(parts['temps'])}; {a.ranks} ranks with slack {size_text(need)} of {size_text(avail)} "
              f"{where}", flush=True)
        if need > avail and worst is None:
            worst = (num_slots, need)
    if worst is None:
        return
    step = 128 if a.ffn > 128 else 8
    fits = [f for f in range(a.ffn - step, 0, -step)
            if all(phase_need(a, f, b, st)[0] <= avail for b, st in phases)]
    hint = f"the largest --ffn that fits is {fits[0]}" if fits else "no --ffn fits"
    print(f"serving_step: does not fit: B={worst[0]} needs {size_text(worst[1])} for {a.ranks} ranks at F={a.ffn}, "
          f"{size_text(avail)} {where}; {hint}", file=sys.stderr, flush=True)
    sys.exit(2)


# ---- steps ----


def mismatches(got, want):
    """[(rank, values that differ bitwise)] over the ranks whose tensors differ (bf16 compared as int16 bits)."""
    out = []
    for r, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            out.append((r, max(g.numel(), w.numel())))
            continue
        n = int((g.contiguous().view(torch.int16) != w.contiguous().view(torch.int16)).sum())
        if n:
            out.append((r, n))
    return out


class Step:
    """One mode's inputs and its step on every rank (static input tensors the graphs read in place)."""

    def __init__(self, a, moes, planner, s, sigma, device, streams):
        self.a, self.moes, self.planner, self.s, self.sigma = a, moes, planner, s, sigma
        self.device, self.streams = device, streams
        self.x = [torch.empty(s, a.hidden, dtype=BF16, device=device) for _ in moes]
        self.idx = [torch.empty(s, a.topk, dtype=torch.long, device=device) for _ in moes]

    def write_inputs(self, seed):
        a = self.a
        for r in range(a.ranks):
            g = torch.Generator(device=self.device).manual_seed(seed * 1009 + r)
            self.x[r].copy_(torch.randn(self.s, a.hidden, generator=g, device=self.device))
            self.idx[r].copy_(testing.sample_topk(a.experts, self.s, a.topk, r, sigma=self.sigma, seed=seed).long())
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def forward(self, r):
        with torch.inference_mode():
            return self.moes[r](self.x[r], self.idx[r])

    def eager_cuda(self):
        """Every rank's step enqueued from this thread (no op of the step blocks the host); the outputs' copies."""
        outs = []
        for r in range(self.a.ranks):
            with torch.cuda.stream(self.streams[r]):
                outs.append(self.forward(r))
        torch.cuda.synchronize()
        return [o.cpu() for o in outs]  # references on the host: no device memory held while the graphs live

    def eager_cpu(self):
        """Every rank's step on its own thread from a common start: (outputs, microseconds to the last end)."""
        R = self.a.ranks
        barrier, starts, ends = threading.Barrier(R), [0.0] * R, [0.0] * R

        def body(r):
            barrier.wait()
            starts[r] = time.perf_counter()
            out = self.forward(r)
            ends[r] = time.perf_counter()
            return out

        outs = virtual.run_threads(R, body)
        return outs, (max(ends) - min(starts)) * 1e6

    def plan_columns(self):
        """The step's plan on every rank: rows, replicas, and the experts its GEMMs read (groups with rows: own
        experts and replicas, pulled or read in place) and their bf16 weight bytes, per rank (max, mean / sum)."""
        plan, pools, buffer = self.moes[0].last_plan, self.moes[0].pools, self.moes[0].buffer
        counts = torch.stack([torch.bincount(i.flatten().cpu(), minlength=self.a.experts) for i in self.idx])
        st = plan.stats
        active = []
        for m in self.moes:  # a diagnostic: reads the plans' device arrays on the host, outside any timing
            ends = m.last_plan.cu_seqlens.cpu().long()
            sizes = torch.diff(ends, prepend=ends.new_zeros(1))
            active.append(int((sizes > 0).sum()))
        eb = expert_bytes(self.a, self.a.ffn) / 1e6
        return dict(view_rows=pools.view_rows, recv_rows=buffer.num_recv_rows, rows_max=max(st["loads"]),
                    replicas=st["replicas"], maxvio=round(testing.maxvio(counts), 4), experts_max=max(active),
                    experts_mean=round(sum(active) / len(active), 2), weight_mb_max=round(max(active) * eb, 2),
                    weight_mb_sum=round(sum(active) * eb, 2))


class Graphs:
    """Per rank one CUDA graph of its step, replayed on its own stream."""

    def __init__(self, step):
        self.step = step
        self.graphs, self.static = [], []
        for r in range(step.a.ranks):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=step.streams[r], capture_error_mode="global"):
                self.static.append(step.forward(r))
            self.graphs.append(g)
        torch.cuda.synchronize()
        self.gate = torch.cuda.Stream()
        self.gate_cycles = bench_timing.gate_cycles(0, step.a.gate_ms * 1e-3)

    def replay(self):
        for r, g in enumerate(self.graphs):
            with torch.cuda.stream(self.step.streams[r]):
                g.replay()
        torch.cuda.synchronize()
        return [o.cpu() for o in self.static]

    def timed(self):
        """(microseconds from the common start to the last rank's end, host enqueue microseconds)."""
        torch.cuda.synchronize()
        t = bench_timing.ranks_together(self.step.streams, lambda r: self.graphs[r].replay(), self.gate_cycles,
                                        gate_stream=self.gate)
        return t.max_ms * 1e3, t.enqueue_ms * 1e3


def measure_cuda(step, name):
    a = step.a
    seeds = (a.seed + 1, a.seed)  # the timed inputs (a.seed: the routing the skew was fitted to) last
    refs = []
    for seed in seeds:  # two eager steps: warm-up of the Buffer and the kernels, and the references
        step.write_inputs(seed)
        refs.append(step.eager_cuda())
    cols = step.plan_columns()
    for r, o in enumerate(refs[-1]):
        if not bool(torch.isfinite(o.float()).all()):
            sys.exit(f"serving_step: {name} s={step.s}: rank {r}'s eager output is not finite")
    graphs = Graphs(step)
    for seed, ref in zip(seeds, refs):
        step.write_inputs(seed)
        bad = mismatches(graphs.replay(), ref)
        if bad:
            sys.exit(f"serving_step: {name} s={step.s}: the replayed CUDA graphs differ from the eager step on the "
                     f"same inputs (seed {seed}; rank, values that differ: {bad}); no timing")
    print(f"  {name} s={step.s}: graph replays equal the eager steps bitwise (2 inputs, {a.ranks} ranks)", flush=True)
    del refs
    times, enqueue = [], []
    for i in range(a.warmup + a.iters):
        t, e = graphs.timed()
        if i >= a.warmup:
            times.append(t)
            enqueue.append(e)
    late = sum(e > a.gate_ms * 1e3 for e in enqueue)
    del graphs
    gc.collect()
    torch.cuda.empty_cache()
    return times, dict(cols, enqueue_us=round(statistics.median(enqueue), 1), late=late, timing="graph")


def measure_cpu(step, name):
    a = step.a
    step.write_inputs(a.seed)
    times = []
    for i in range(a.warmup + a.iters):
        _, t = step.eager_cpu()
        if i >= a.warmup:
            times.append(t)
    return times, dict(step.plan_columns(), enqueue_us="", late="", timing="eager")


@contextlib.contextmanager
def no_host_init(device):
    """While layers are built: flatep.nn.init_expert_weights (which MoE.__init__ calls: seeded torch.randn on the host,
    about 0.1 s per K3 expert per core, 112 experts per rank, once per layer built) gives zeros on `device` broadcast
    to every expert instead (no host work, no memory); fill_experts then writes the values. Restored on exit."""
    library = flatep.nn.init_expert_weights

    def zeros(hidden, ffn, expert_ids, seed, activation="swiglu"):
        cols, n = flatep.nn.w1_columns(ffn, activation), len(expert_ids)
        return (torch.zeros(1, hidden, cols, dtype=BF16, device=device).expand(n, hidden, cols),
                torch.zeros(1, ffn, hidden, dtype=BF16, device=device).expand(n, ffn, hidden))

    flatep.nn.init_expert_weights = zeros
    try:
        yield
    finally:
        flatep.nn.init_expert_weights = library


def fill_experts(moe, seed):
    """The layer's own experts drawn in place on its device, w1 ~ N(0, 1/H), w2 ~ N(0, 1/F) (nn.MoE's scales), from
    a generator of (seed, rank, projection): distinct experts, written where the library keeps them."""
    with torch.no_grad():
        for p, (param, fan_in) in enumerate(((moe.w1, moe.hidden), (moe.w2, moe.ffn))):
            g = torch.Generator(device=moe.device).manual_seed(seed * 1_000_003 + 2 * moe.rank + p)
            param.normal_(0.0, fan_in**-0.5, generator=g)


def build_layers(a, ranks, num_slots, device):
    """nn.MoE(..., num_slots=B) on every rank (collective: R threads), experts from fill_experts unless
    --library-init."""
    def make(r):
        return flatep.nn.MoE(a.hidden, a.ffn, a.experts, a.topk, ranks[r], num_tokens=a.tokens,
                             num_slots=num_slots, seed=a.seed, device=device)

    if a.library_init:
        return virtual.run_threads(a.ranks, make)
    with no_host_init(device):
        moes = virtual.run_threads(a.ranks, make)
    for m in moes:
        fill_experts(m, a.seed)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return moes


def run_phase(a, ranks, num_slots, steps, sigma, device, streams):
    """Builds the layer of B = num_slots on every rank, measures its steps [(planner, s)]; returns their records."""
    R = a.ranks
    t0 = time.perf_counter()
    moes = build_layers(a, ranks, num_slots, device)
    print(f"B={num_slots}: layers built in {time.perf_counter() - t0:.1f} s", flush=True)
    records = []
    for planner, s in steps:
        virtual.run_threads(R, lambda r: moes[r].use_planner(planner, s))
        name = "owner" if planner == "owner" else ("balanced_bepn" if num_slots == a.epn else f"balanced_b{num_slots}")
        want = recv_rows(a, planner, s)
        if moes[0].buffer.num_recv_rows != want:
            print(f"warning: memory estimate: receive rows differ for {name} s={s}: estimated {want}, the Buffer has "
                  f"{moes[0].buffer.num_recv_rows}", flush=True)
        step = Step(a, moes, planner, s, sigma, device, streams)
        t1 = time.perf_counter()
        times, cols = (measure_cuda if device.type == "cuda" else measure_cpu)(step, name)
        del step
        records.append(dict(cols, s=s, mode=name, planner=planner, B=num_slots,
                            median_us=round(statistics.median(times), 2), min_us=round(min(times), 2),
                            max_us=round(max(times), 2), iters=len(times)))
        print(f"  {name} s={s}: median {records[-1]['median_us']:.1f} us ({time.perf_counter() - t1:.1f} s)",
              flush=True)
    return records


def add_ratios(records, a):
    """vs / ratio: balanced_b<B> against balanced_bepn at the same s, owner against balanced_b<B> (rounded times);
    bytes_ratio: the same pair's expert-weight bytes read by the GEMMs, summed over the ranks (they share one GPU)."""
    by = {(r["mode"], r["s"]): r for r in records}
    bm = f"balanced_b{a.slots}"
    for r in records:
        vs = {bm: "balanced_bepn", "owner": bm}.get(r["mode"])
        other = by.get((vs, r["s"]))
        r["vs"], r["ratio"] = (vs, round(r["median_us"] / other["median_us"], 4)) if other else ("", "")
        r["bytes_ratio"] = round(r["weight_mb_sum"] / other["weight_mb_sum"], 4) if other else ""


def main(argv=None):
    a = parse_args(argv)
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda" and not (torch.cuda.is_available() and flatep._C.has_cuda):
        sys.exit("serving_step: --device cuda needs a GPU and FlatEP built with CUDA; use --device cpu")
    S, d, B = a.tokens, a.decode_tokens, a.slots
    phases = [(B, [("balanced", S), ("balanced", d), ("owner", d)]), (a.epn, [("balanced", S), ("balanced", d)])]
    if a.decode_sweep:
        phases = [(B, [(planner, s) for s in a.decode_sweep for planner in ("balanced", "owner")])]
    print(f"serving_step: {a.preset_name} R={a.ranks} S={S} E={a.experts} H={a.hidden} K={a.topk} F={a.ffn} "
          f"epn={a.epn} B={B} decode s={d} maxvio {a.maxvio:g} on {device}", flush=True)
    check_memory(a, phases)
    sigma = 0.0 if a.maxvio == 0 else testing.sigma_for_maxvio(a.maxvio, a.ranks, a.experts, S, a.topk, seed=a.seed)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        os.environ.setdefault("FLATEP_NUM_SMS", str(max(1, sms // a.ranks)))
        streams = [torch.cuda.Stream(device) for _ in range(a.ranks)]
    else:
        torch.set_num_threads(1)
        streams = [None] * a.ranks
    ranks = virtual.virtual_ranks(a.ranks, device, timeout_s=a.timeout)
    records = []
    for i, (num_slots, steps) in enumerate(phases):
        if i:  # the previous layer is released: what is free now must hold this one
            check_memory(a, [(num_slots, steps)])
        records += run_phase(a, ranks, num_slots, steps, sigma, device, streams)
        testing.release_all()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            print(f"B={num_slots} released: {torch.cuda.mem_get_info(0)[0] / GIB:.1f} GiB free", flush=True)
    add_ratios(records, a)
    shape = dict(preset=a.preset_name, device=str(device), R=a.ranks, S=S, E=a.experts, H=a.hidden, K=a.topk,
                 F=a.ffn)
    rows = [{k: {**shape, **r}[k] for k in COLUMNS} for r in records]
    print(f"\n{'mode':>16} {'s':>6} {'B':>4} {'rows_max':>9} {'replicas':>8} {'experts':>11} {'weight_MB':>9} "
          f"{'median_us':>11} {'min_us':>11} {'max_us':>11} {'vs':>16} {'ratio':>7} {'bytes':>7}")
    for r in rows:
        print(f"{r['mode']:>16} {r['s']:>6} {r['B']:>4} {r['rows_max']:>9} {r['replicas']:>8} "
              f"{r['experts_max']:>5}/{r['experts_mean']:<5} {r['weight_mb_sum']:>9.1f} {r['median_us']:>11.1f} "
              f"{r['min_us']:>11.1f} {r['max_us']:>11.1f} {r['vs']:>16} {r['ratio']!s:>7} {r['bytes_ratio']!s:>7}")
    for r in rows:
        if r["vs"]:
            line = f"ratio {r['mode']} / {r['vs']} at s={r['s']}: {r['ratio']:.3f}"
            if r["mode"] == "owner":
                line += (f" (weight bytes {r['bytes_ratio']:.3f}; target <= bytes + 0.05 = "
                         f"{r['bytes_ratio'] + 0.05:.3f}: {'met' if r['ratio'] <= r['bytes_ratio'] + 0.05 else 'MISSED'})")
            print(line)
    if any(r["late"] for r in rows):
        print("warning: some timed steps were enqueued after the gate ended (column 'late'): raise --gate-ms")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
