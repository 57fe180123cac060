"""The public Python API's plan + dispatch + combine on R virtual ranks of one GPU: eager (plans kept, or dropped as
soon as the step is done) and replayed as CUDA graphs, at s = S tokens and at a decode-sized s, against the step of
the same ops' kernels alone (ops_bench, same config, run beside it; pass its medians with --kernel-us).

    python3 benchmarks/layer/api_step.py --ranks 8 --tokens 4096 --hidden 7168 --experts 256 --topk 8 --small 128 \\
        --kernel-us 1234.5 --csv api_step.csv

One host thread enqueues every rank's ops, each rank on its own stream (FLATEP_NUM_SMS = SMs / R unless set). A
step's time is the wall time of one iteration over all ranks, enqueue included, from a synchronised start to the
last rank's end; the median of --iters after --warmup. Uniform routing (DeepEP's config) unless --sigma.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

import flatep  # noqa: E402
from flatep import testing, virtual  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--small", type=int, default=128, help="the decode-sized token count s")
    p.add_argument("--sigma", type=float, default=0.0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kernel-us", type=float, default=0.0, help="ops_bench's plan+dispatch+combine at s=S (us)")
    p.add_argument("--zero-copy", action="store_true", help="dispatch(zero_copy=True): receive rows stay in the "
                   "symmetric region, the same work as ops_bench's kernels (forward-only use)")
    p.add_argument("--csv", default=None)
    p.add_argument("--profile", default=None, help="directory: torch-profiler tables of one step per mode and s, and "
                   "a cProfile of the host side of an eager step at s = --small")
    return p.parse_args()


class RankThreads:
    """R persistent host threads; run(fn) calls fn(r) on thread r, all released at once, and waits for all."""

    def __init__(self, num_ranks):
        import threading

        self.n = num_ranks
        self.start = threading.Barrier(num_ranks + 1)
        self.done = threading.Barrier(num_ranks + 1)
        self.fn = None
        self.threads = [threading.Thread(target=self._body, args=(r,), daemon=True) for r in range(num_ranks)]
        for t in self.threads:
            t.start()

    def _body(self, r):
        while True:
            self.start.wait()
            if self.fn is None:
                return
            self.fn(r)
            self.done.wait()

    def run(self, fn):
        self.fn = fn
        self.start.wait()
        self.done.wait()

    def close(self):
        self.fn = None
        self.start.wait()


def profile_step(a, s, eager, replay, replay_all):
    """Where a step's time goes: per mode, a torch-profiler table (CUDA kernels and host-side ops, sorted by total
    CUDA time) of three steps, and for eager a cProfile of the host side (the Python and binding calls)."""
    import cProfile
    import pstats

    os.makedirs(a.profile, exist_ok=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name, run in (("eager", eager), ("graph", replay), ("graph_all", replay_all)):
        run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        with open(os.path.join(a.profile, f"s{s}_{name}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        eager()
    torch.cuda.synchronize()
    pr.disable()
    with open(os.path.join(a.profile, f"s{s}_eager_host.txt"), "w") as f:
        pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(40)


def main():
    a = parse_args()
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    os.environ.setdefault("FLATEP_NUM_SMS", str(max(1, sms // a.ranks)))
    group = virtual.virtual_ranks(a.ranks, device, timeout_s=60)
    R = a.ranks
    bufs = virtual.run_threads(R, lambda r: flatep.Buffer(group[r], a.tokens, a.hidden, a.experts, a.topk,
                                                          device=device))
    streams = [torch.cuda.Stream(device) for _ in range(R)]
    idx = [testing.sample_topk(a.experts, a.tokens, a.topk, r, sigma=a.sigma, seed=1).long().to(device)
           for r in range(R)]
    x = [torch.randn(a.tokens, a.hidden, device=device).to(torch.bfloat16) for _ in range(R)]
    w = [torch.rand(a.tokens, a.topk, device=device) for _ in range(R)]
    keep = []

    def step(r, s, hold):
        with torch.cuda.stream(streams[r]), torch.no_grad():
            plan = bufs[r].plan(idx[r][:s])
            recv_x, recv_w, _ = bufs[r].dispatch(plan, x[r][:s], w[r][:s], zero_copy=a.zero_copy)
            out = bufs[r].combine(plan, recv_x, recv_w)
        if hold:
            keep.append(plan)
        return out

    def timed(run):
        times = []
        for i in range(a.warmup + a.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(1e6 * (time.perf_counter() - t0))
            keep.clear()
        return statistics.median(times)

    # One host thread per rank, each enqueuing its own rank's step, as R processes do (one thread enqueuing all R
    # ranks' steps serialises R processes' host work).
    pool = RankThreads(R)

    rows = []
    for s in (a.tokens, a.small):
        eager_kept = timed(lambda: [step(r, s, True) for r in range(R)])
        eager_dropped = timed(lambda: [step(r, s, False) for r in range(R)])
        eager_threads = timed(lambda: pool.run(lambda r: step(r, s, False)))
        graphs = []
        for r in range(R):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=streams[r]):
                step(r, s, False)
            graphs.append(g)
        torch.cuda.synchronize()

        def replay():
            for r in range(R):
                with torch.cuda.stream(streams[r]):
                    graphs[r].replay()

        graph_us = timed(replay)
        # Every rank's step in ONE graph (each rank on its own stream inside the capture, forked from and joined to
        # the capture stream by events): one launch, as R processes launching their graphs at the same time; R
        # launches from one thread (above) start the last rank R launch latencies after the first.
        whole = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream(device)
        with torch.cuda.graph(whole, stream=capture_stream):
            fork = torch.cuda.Event()
            fork.record(capture_stream)
            joins = []
            for r in range(R):
                streams[r].wait_event(fork)
                step(r, s, False)
                joins.append(torch.cuda.Event())
                joins[-1].record(streams[r])
            for e in joins:
                capture_stream.wait_event(e)
        torch.cuda.synchronize()
        graph_all_us = timed(whole.replay)
        rows.append((s, eager_kept, eager_dropped, graph_us, graph_all_us, eager_threads))
        if a.profile:
            profile_step(a, s, lambda: [step(r, s, False) for r in range(R)], replay, whole.replay)
        del graphs, whole
    for b in bufs:
        b.check_status()
    pool.close()
    modes = ("eager_kept", "eager_dropped", "graph", "graph_all", "eager_threads")
    full = {mode: rows[0][i + 1] for i, mode in enumerate(modes)}
    header = ("R,S,H,E,K,s,eager_kept_us,eager_dropped_us,graph_us,graph_all_us,eager_threads_us,kernel_us,"
              "eager_kept/kernel,eager_dropped/kernel,graph/kernel,graph_all/kernel,eager_threads/kernel,"
              "eager_kept/full,graph/full,graph_all/full,eager_threads/full")
    print(header)
    out = []
    for s, ek, ed, gr, ga, et in rows:
        k = a.kernel_us
        ratio = (lambda v: f"{v / k:.3f}") if k > 0 and s == a.tokens else (lambda v: "")
        line = (f"{R},{a.tokens},{a.hidden},{a.experts},{a.topk},{s},{ek:.1f},{ed:.1f},{gr:.1f},{ga:.1f},{et:.1f},"
                f"{k if s == a.tokens else ''},{ratio(ek)},{ratio(ed)},{ratio(gr)},{ratio(ga)},{ratio(et)},"
                f"{ek / full['eager_kept']:.3f},{gr / full['graph']:.3f},{ga / full['graph_all']:.3f},"
                f"{et / full['eager_threads']:.3f}")
        print(line)
        out.append(line)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write(header + "\n" + "\n".join(out) + "\n")


if __name__ == "__main__":
    main()
