#!/usr/bin/env python3
"""flatep.nn.MoE forward + backward at MoonEP's per-rank sizes: time and device memory per layer and per process, and
how many expert-weight-sized copies and clones a step makes (torch profiler). Run it once with this tree's
python/flatep and once with an older one (--label) to get the before/after table of docs/performance.md.

    python3 benchmarks/layer/moe_params.py --layers 2 --csv $OUT/moe_params.csv --label after
    FLATEP_PYTHON=<old tree>/python python3 benchmarks/layer/moe_params.py --label before --csv ...

One rank (a one-rank world, no peers: every expert is local, so the step is the layer's own work: router, plan,
dispatch, prefetch, grouped GEMMs, combine and their backward), epn = E experts of W1 [H, 2F] (SwiGLU, the default;
--activation silu: [H, F]) and W2 [F, H], S tokens, top-K.
Memory: device memory in use (cudaMemGetInfo: torch's allocator and FlatEP's own CUDA VMM memory alike) after the
first layer is built, after the last, and the peak of the process over a step (torch's peak allocated plus FlatEP's
memory, which does not change during a step). Time: median over --iters steps of all layers' forward + backward
(CUDA events), divided by the layers.
"""

import argparse
import csv
import os
import statistics
import sys

import torch

if "FLATEP_PYTHON" in os.environ:  # another tree's package (the "before" run), ahead of this tree's
    sys.path.insert(0, os.environ["FLATEP_PYTHON"])
else:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))

import bench_timing  # noqa: E402
import flatep  # noqa: E402
from flatep import testing  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=48, help="experts of the rank (epn; MoonEP: 384 / 8)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--activation", default=None,
                   help="swiglu (nn.MoE's default) or silu; omitted: the layer's default (older trees: their only FFN)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--label", default="this tree")
    p.add_argument("--csv", default=None)
    return p.parse_args()


def used_bytes():
    free, total = torch.cuda.mem_get_info()
    return total - free


def weight_sized_copies(prof, shapes):
    """Calls of aten::copy_ / aten::clone / aten::_to_copy whose first input has one of `shapes` (expert weights)."""
    n = 0
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in ("aten::copy_", "aten::clone", "aten::_to_copy") and e.input_shapes:
            if list(e.input_shapes[0]) in shapes:
                n += e.count
    return n


def main():
    a = parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    gib = 1024**3
    base = used_bytes()
    layers, after_layer = [], []
    for i in range(a.layers):  # num_tokens given: the (shared) Buffer is built with the first layer
        extra = {} if a.activation is None else {"activation": a.activation}  # an older tree has no activation
        layers.append(flatep.nn.MoE(a.hidden, a.ffn, a.experts, a.topk, num_tokens=a.tokens, seed=i, device=device,
                                    **extra))
        torch.cuda.synchronize()
        after_layer.append(used_bytes() - base)
    params = [p for m in layers for p in m.parameters()]
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(a.tokens, a.hidden, device=device, generator=g).requires_grad_()
    gout = torch.randn(a.tokens, a.hidden, device=device, generator=g)

    def step():
        h = x
        for m in layers:
            h = h + m(h)
        (h.float() * gout).sum().backward()

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    torch_before = torch.cuda.memory_allocated(device)

    def clear_grads():
        for p in params:
            p.grad = None

    times = bench_timing.time_calls(step, a.iters, before=clear_grads)
    peak = after_layer[-1] + (torch.cuda.max_memory_allocated(device) - torch_before)
    shapes = [list(p.shape) for p in layers[0].expert_parameters()]  # [epn, H, 2F or F], [epn, F, H]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    copies = weight_sized_copies(prof, shapes)
    per_layer = (after_layer[-1] - after_layer[0]) / max(1, a.layers - 1) if a.layers > 1 else after_layer[0]
    row = {
        "label": a.label, "activation": getattr(layers[0], "activation", "silu"), "layers": a.layers,
        "S": a.tokens, "H": a.hidden, "F": a.ffn, "epn": a.experts, "K": a.topk,
        "ms_per_layer_fwd_bwd": round(statistics.median(times) / a.layers, 3),
        "gib_first_layer": round(after_layer[0] / gib, 2),
        "gib_per_extra_layer": round(per_layer / gib, 2),
        "gib_after_all_layers": round(after_layer[-1] / gib, 2),
        "gib_peak_in_step": round(peak / gib, 2),
        "weight_sized_copies_per_step": copies,
    }
    print(f"flatep from {os.path.dirname(flatep.__file__)}")
    print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if a.csv:
        new = not os.path.exists(a.csv)
        with open(a.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            if new:
                w.writeheader()
            w.writerow(row)
    testing.release_all()


if __name__ == "__main__":
    main()
