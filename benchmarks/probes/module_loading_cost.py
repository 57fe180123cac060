"""What CUDA_MODULE_LOADING=EAGER (flatep.virtual's default when it is imported before CUDA starts) costs against
LAZY: start-up time and device memory of a fresh interpreter, each mode measured in its own fresh processes.

    python3 benchmarks/probes/module_loading_cost.py                 # 3 runs per mode, alternating, one CSV row per run
    python3 benchmarks/probes/module_loading_cost.py --repeats 5 --csv $OUT/module_loading.csv

Each run is a new python3 with CUDA_MODULE_LOADING set to the mode (and nothing else changed) that times, on one GPU:
  init_s        torch's CUDA start: the first tensor on the device, synchronised (context creation; EAGER also loads
                every module of every CUDA library loaded so far)
  first_step_s  R virtual ranks, a flatep.Buffer per rank, and one step enqueued by one thread: each rank's plan,
                dispatch and combine on its own stream, then a few torch kernels of a model's own (matmul, RMS norm,
                softmax, their backward), synchronised (LAZY loads each kernel at its first launch here)
  total_s       init_s + first_step_s: what a user waits for before the first step is done
and reads the device's used memory (torch.cuda.mem_get_info: total - free, every process on the GPU; run it on an
idle GPU) after the start (used_init_mib) and after the step (used_step_mib); torch's own allocations are the same in
both modes, so the difference between the modes is the loaded modules. The last lines give each mode's median and
EAGER - LAZY. The mode a child really ran under is read back from the driver (cuModuleGetLoadingMode).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FIELDS = ["init_s", "first_step_s", "total_s", "used_init_mib", "used_step_mib"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per mode")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--csv", default=None, help="also append the rows to this file")
    p.add_argument("--child", choices=["EAGER", "LAZY"], default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args):
    """One measurement in this (fresh) process; prints one JSON line."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "python"))
    import flatep
    from flatep import testing, virtual

    device = torch.device("cuda", args.device)
    mib = 1 << 20
    start = time.perf_counter()
    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
    init_s = time.perf_counter() - start
    free, total = torch.cuda.mem_get_info(device)
    used_init = (total - free) / mib

    start = time.perf_counter()
    R, S, H, E, K = args.ranks, args.tokens, args.hidden, args.experts, args.topk
    ranks = virtual.virtual_ranks(R, device, timeout_s=60)
    buffers = virtual.run_threads(R, lambda r: flatep.Buffer(ranks[r], S, H, E, K, align=1, device=device))
    streams = [torch.cuda.Stream(device) for _ in range(R)]
    x = [torch.randn(S, H, device=device).to(torch.bfloat16) for _ in range(R)]
    idx = [testing.sample_topk(E, S, K, r, sigma=1.0, seed=3).to(device) for r in range(R)]
    weights = [torch.full((S, K), 1.0 / K, device=device) for _ in range(R)]
    torch.cuda.synchronize(device)
    outs = []
    for r in range(R):  # one thread enqueues every rank's step, as virtual ranks' users do
        with torch.cuda.stream(streams[r]):
            plan = buffers[r].plan(idx[r])
            recv = buffers[r].dispatch(plan, x[r], weights[r])
            outs.append(buffers[r].combine(plan, recv[0], recv[1]))
    torch.cuda.synchronize(device)
    a = torch.randn(S, H, device=device, requires_grad=True)
    w = torch.randn(H, H, device=device, requires_grad=True)
    h = a @ w
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.softmax(h, -1).sum().backward()
    torch.cuda.synchronize(device)
    first_step_s = time.perf_counter() - start
    free, total = torch.cuda.mem_get_info(device)
    row = {
        "loading": args.child,
        "driver_mode": virtual.cuda_module_loading(),
        "init_s": init_s,
        "first_step_s": first_step_s,
        "total_s": init_s + first_step_s,
        "used_init_mib": used_init,
        "used_step_mib": (total - free) / mib,
    }
    print(json.dumps(row), flush=True)
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    runs = {"EAGER": [], "LAZY": []}
    header = "loading,driver_mode,R,S,H,E,K," + ",".join(FIELDS)
    lines = [header]
    print(header, flush=True)
    for i in range(args.repeats):
        for loading in ("EAGER", "LAZY"):  # alternating: drift on the machine hits both modes alike
            env = dict(os.environ, CUDA_MODULE_LOADING=loading)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", loading, "--ranks", str(args.ranks),
                   "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--experts", str(args.experts),
                   "--topk", str(args.topk), "--device", str(args.device)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                print(f"FAIL: the {loading} run {i} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
                return 1
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            if row["driver_mode"] not in (loading, None):
                print(f"FAIL: CUDA_MODULE_LOADING={loading} but the driver loads modules {row['driver_mode']}")
                return 1
            runs[loading].append(row)
            line = (f"{loading},{row['driver_mode']},{args.ranks},{args.tokens},{args.hidden},{args.experts},"
                    f"{args.topk}," + ",".join(f"{row[f]:.3f}" for f in FIELDS))
            lines.append(line)
            print(line, flush=True)
    medians = {mode: {f: statistics.median(r[f] for r in rows) for f in FIELDS} for mode, rows in runs.items()}
    for mode in ("EAGER", "LAZY"):
        print(f"median {mode}: " + ", ".join(f"{f} {medians[mode][f]:.3f}" for f in FIELDS))
    print("EAGER - LAZY: " + ", ".join(f"{f} {medians['EAGER'][f] - medians['LAZY'][f]:+.3f}" for f in FIELDS))
    if args.csv:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a") as f:
            f.write("\n".join(lines if new else lines[1:]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
