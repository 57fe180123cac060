"""The public Python API's plan + dispatch + combine on R virtual ranks of one GPU: eager (plans kept, or dropped as
soon as the step is done) and replayed as CUDA graphs, at s = S tokens and at a decode-sized s, against the step of
the same ops' kernels alone (ops_bench, same config, run beside it; pass its medians with --kernel-us).

    python3 benchmarks/api_step.py --ranks 8 --tokens 4096 --hidden 7168 --experts 256 --topk 8 --small 128 \\
        --kernel-us 1234.5 --csv api_step.csv

One host thread enqueues every rank's ops, each rank on its own stream (FLATEP_SM_BUDGET = SMs / R unless set). A
step's time is the wall time of one iteration over all ranks, enqueue included, from a synchronised start to the
last rank's end; the median of --iters after --warmup. Uniform routing (DeepEP's config) unless --sigma.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

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
    p.add_argument("--csv", default=None)
    return p.parse_args()


def main():
    a = parse_args()
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    os.environ.setdefault("FLATEP_SM_BUDGET", str(max(1, sms // a.ranks)))
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
            recv_x, recv_w, _ = bufs[r].dispatch(plan, x[r][:s], w[r][:s])
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

    rows = []
    for s in (a.tokens, a.small):
        eager_kept = timed(lambda: [step(r, s, True) for r in range(R)])
        eager_dropped = timed(lambda: [step(r, s, False) for r in range(R)])
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
        rows.append((s, eager_kept, eager_dropped, graph_us))
        del graphs
    for b in bufs:
        b.check_status()
    full = {mode: rows[0][i + 1] for i, mode in enumerate(("eager_kept", "eager_dropped", "graph"))}
    print("R,S,H,E,K,s,eager_kept_us,eager_dropped_us,graph_us,kernel_us,eager_kept/kernel,eager_dropped/kernel,"
          "graph/kernel,eager_kept/full,graph/full")
    out = []
    for s, ek, ed, gr in rows:
        k = a.kernel_us
        ratio = (lambda v: f"{v / k:.3f}") if k > 0 and s == a.tokens else (lambda v: "")
        line = (f"{R},{a.tokens},{a.hidden},{a.experts},{a.topk},{s},{ek:.1f},{ed:.1f},{gr:.1f},"
                f"{k if s == a.tokens else ''},{ratio(ek)},{ratio(ed)},{ratio(gr)},"
                f"{ek / full['eager_kept']:.3f},{gr / full['graph']:.3f}")
        print(line)
        out.append(line)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("R,S,H,E,K,s,eager_kept_us,eager_dropped_us,graph_us,kernel_us,eager_kept/kernel,"
                    "eager_dropped/kernel,graph/kernel,eager_kept/full,graph/full\n" + "\n".join(out) + "\n")


if __name__ == "__main__":
    main()
