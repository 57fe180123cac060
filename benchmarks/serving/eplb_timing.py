"""The GPU part of benchmarks/serving/eplb_compare.py (--time): every policy's serving step timed on every step of
the trace.

A policy's layer is flatep.nn.MoE(num_slots=B) on R virtual ranks of one GPU (serving_step.py's layers: experts drawn
on the device), its inference forward (plan, dispatch, the slots' pull for the balanced planner, both grouped GEMMs,
combine) captured once as one CUDA graph per rank, checked bitwise against the eager step, then replayed on every
step of the trace with that step's routing written into the graph's input (serving_step.Graphs: every rank's replay
from one gated start, the time to the last rank's end). Policies:

* flatep_b<B>, flatep_bepn: the balanced planner (B slots; B = epn: the training layout's pools);
* owner: the same B-slot layer with the owner planner;
* static_<N>: a layer with planner='static'; at steps t = 0, N, 2N, ... the placement from the N steps before
  (eplb_compare's) is set (collective, outside the graph: the plan kernel reads it from device memory the graph
  keeps) and its replicas' weights are moved by one collective prefetch, timed like a step (every rank's prefetch
  on its stream from one gated start) and added to that step's time.
"""

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "common"))

import torch  # noqa: E402

import bench_timing  # noqa: E402
import serving_step  # noqa: E402  (its layers, inputs and graph replays)
from flatep import eplb, testing, virtual  # noqa: E402


class Shape:
    """serving_step's argument object for the trace's shape."""

    def __init__(self, routing, args, device):
        self.ranks, self.tokens, self.experts, self.topk = routing.R, routing.S, routing.E, routing.K
        self.hidden, self.ffn = routing.hidden, routing.ffn
        self.epn, self.slots, self.align = routing.epn, args.slots, serving_step.DEFAULT_ALIGN
        self.seed, self.library_init, self.gate_ms, self.device = args.seed, False, 3.0, device.type
        self.decode_tokens = routing.S


class TraceStep(serving_step.Step):
    """serving_step.Step whose routing is the trace's: write_inputs(t) puts step t's ids into the graph's inputs
    (on the CPU backend: the eager step's inputs)."""

    def __init__(self, a, moes, routing, device, streams):
        super().__init__(a, moes, "trace", routing.S, 0.0, device, streams)
        self.routing = routing
        g = torch.Generator(device=device).manual_seed(a.seed)
        for x in self.x:  # the tokens stay; the routing changes
            x.copy_(torch.randn(x.shape, generator=g, device=device))

    def write_inputs(self, t):
        for r in range(self.a.ranks):
            self.idx[r].copy_(self.routing.topk_idx(t, r))
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def build(a, ranks, device, num_slots, planner):
    moes = serving_step.build_layers(a, ranks, num_slots, device)
    if planner != "balanced":
        virtual.run_threads(a.ranks, lambda r: moes[r].use_planner(planner, a.tokens))
    return moes


def capture(step, routing, first_step):
    """Two eager steps (the kernels loaded, a static layer's weights moved), then the graphs, checked bitwise."""
    refs = []
    for t in (first_step, first_step):
        step.write_inputs(t)
        refs.append(step.eager_cuda())
    graphs = serving_step.Graphs(step)
    step.write_inputs(first_step)
    bad = serving_step.mismatches(graphs.replay(), refs[-1])
    if bad:
        raise SystemExit(f"eplb_compare --time: the replayed graphs differ from the eager step (rank, values): {bad}")
    return graphs


def timed_move_cpu(moes):
    """The CPU backend's weight move: one collective prefetch on R threads (its wall time, microseconds)."""
    R = len(moes)

    def move(r):
        plan = moes[r].buffer.plan(torch.zeros(1, moes[r].topk, dtype=torch.long))
        moes[r].pools.prefetch(plan, moes[r].expert_layer)
        moes[r]._static.moved(moes[r].pools, moes[r].expert_layer, plan)

    return bench_timing.wall_ms(lambda: virtual.run_threads(R, move))[0] * 1e3


def timed_move(moes, streams, gate):
    """The placed replicas' weights moved into the slots: one collective prefetch, every rank's on its stream from
    one gated start (microseconds to the last rank's end). The layers' next eager forward would move them again
    otherwise: they are marked moved."""
    R = len(moes)
    idx = [torch.zeros(1, moes[r].topk, dtype=torch.long, device=moes[r].device) for r in range(R)]
    plans = []
    for r in range(R):  # a plan of the new placement on every rank (its slot_expert is the placement)
        with torch.cuda.stream(streams[r]):
            plans.append(moes[r].buffer.plan(idx[r]))
    torch.cuda.synchronize()
    t = bench_timing.ranks_together(streams, lambda r: moes[r].pools.prefetch(plans[r], moes[r].expert_layer),
                                    gate.cycles, gate_stream=gate.stream)
    for r in range(R):
        moes[r]._static.moved(moes[r].pools, moes[r].expert_layer, plans[r])
    return t.max_ms * 1e3


class Gate:
    def __init__(self, a):
        self.stream = torch.cuda.Stream()
        self.cycles = bench_timing.gate_cycles(0, a.gate_ms * 1e-3)


def time_policies(results, routing, args):
    """Adds time_us to every step record of `results` (eplb_compare.simulate's) for every policy: CUDA graph replays on
    a GPU; on the CPU backend (--device cpu, the code path's own check: its times are no result) eager steps."""
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("eplb_compare --time: --device cuda needs a CUDA device (or --device cpu)")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    a = Shape(routing, args, device)
    if cuda:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        os.environ.setdefault("FLATEP_NUM_SMS", str(max(1, sms // a.ranks)))
        streams = [torch.cuda.Stream(device) for _ in range(a.ranks)]
        gate = Gate(a)
    else:
        streams, gate = [None] * a.ranks, None
    ranks = virtual.virtual_ranks(a.ranks, device)
    B = args.slots
    runs = [(f"flatep_b{B}", B, "balanced"), ("owner", B, "owner"), ("flatep_bepn", routing.epn, "balanced")]
    runs += [(f"static_{n}", B, "static") for n in args.intervals]
    for name, num_slots, planner in runs:
        t0 = time.perf_counter()
        moes = build(a, ranks, device, num_slots, planner)
        n = int(name.split("_")[1]) if planner == "static" else None
        placement = None
        if planner == "static":
            placement = eplb.place(routing._counts[0:1].sum((0, 1)).tolist(), a.ranks, B)
            virtual.run_threads(a.ranks, lambda r: moes[r].set_placement(placement))
        step = TraceStep(a, moes, routing, device, streams)
        graphs = capture(step, routing, 0) if cuda else None
        if not cuda:  # the eager warm-up: a static layer's first forward moves the placed weights
            step.write_inputs(0)
            step.eager_cpu()
        for t, rec in enumerate(results[name]):
            move_us = 0.0
            if planner == "static" and t and t % n == 0:
                window = routing._counts[t - n:t]
                new = eplb.place(window.sum((0, 1)).tolist(), a.ranks, B)
                if new != placement:
                    placement = new
                    virtual.run_threads(a.ranks, lambda r: moes[r].set_placement(placement))
                    move_us = timed_move(moes, streams, gate) if cuda else timed_move_cpu(moes)
            step.write_inputs(t)
            if cuda:
                us, _ = graphs.timed()
            else:
                outs, us = step.eager_cpu()
                if planner == "static" and any(m.last_placement_bytes for m in moes):
                    raise SystemExit(f"eplb_compare --time: {name} step {t} moved weights inside the step")
            rec["time_us"] = round(us + move_us, 2)
            rec["move_us"] = round(move_us, 2)
        times = [r["time_us"] for r in results[name]]
        print(f"  {name}: median {statistics.median(times):.1f} us, mean {statistics.mean(times):.1f} us over "
              f"{len(times)} steps ({time.perf_counter() - t0:.1f} s)", flush=True)
        del graphs, step, moes
        testing.release_all()
        if cuda:
            torch.cuda.empty_cache()
