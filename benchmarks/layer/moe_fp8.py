#!/usr/bin/env python3
"""flatep.nn.MoE forward + backward with fp8=False against fp8=True on one GPU, at MoonEP's per-rank sizes: the layer
time of both in the same run, their ratio, and the FP8 layer's relative errors against the bf16 layer (same weights,
same input, same routing).

    python3 benchmarks/layer/moe_fp8.py --csv $OUT/moe_fp8.csv          # S=8192 H=7168 F=2048 epn=48 K=8, SwiGLU

One rank (a one-rank world: every expert local, so dispatch and combine are the rank's own copies and the step is the
layer's own work: router, plan, dispatch, prefetch, grouped GEMMs, combine and their backward). One layer, switched
between the two modes (``moe.fp8``), so both runs use the very same weights and Buffer. Errors: relative L2
||fp8 - bf16|| / ||bf16|| of the output, the input gradient, the router gradient and both projections' main_grad
(each from a fresh zero). Time: median over --iters steps of forward + backward (CUDA events), the modes interleaved.
Also timed, to show where the time goes: the dispatch alone in each mode, the dequantisation of the receive rows, and
the pieces torch._scaled_grouped_mm's row-wise FP8 path would add (requantising the rows with one scale per row;
quantising W1's compute view) beside its GEMM and the bf16 GEMM.
"""

import argparse
import csv
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))

import bench_timing  # noqa: E402
import flatep  # noqa: E402
from flatep import testing  # noqa: E402
from flatep.nn import dequantize_rows  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=48, help="experts of the rank (epn; MoonEP: 384 / 8)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--activation", default="swiglu", choices=flatep.nn.ACTIVATIONS)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--csv", default=None)
    return p.parse_args()


def rel_l2(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm()).item()


def timed(fn, iters, warmup=1):
    return statistics.median(bench_timing.time_calls(fn, iters, warmup))


def rowwise_quant(t):
    """e4m3 with one fp32 scale per row of the last dimension (the scales torch._scaled_grouped_mm takes)."""
    s = t.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (t.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s


def scaled_gemm_probe(recv_q, recv_s, w1_view, offs, iters):
    """What torch._scaled_grouped_mm does with FlatEP's rows here: the block-scale call (expected to be refused on
    this torch) and the times of the row-wise path's pieces."""
    out = {}
    if not hasattr(torch, "_scaled_grouped_mm"):
        out["scaled_grouped_mm"] = "absent"
        return out
    wt = w1_view.transpose(1, 2)  # B must be column-major: [G, N, K] contiguous, viewed as [G, K, N]
    try:
        wq_t = (wt.float() / 1.0).to(torch.float8_e4m3fn).contiguous()
        bs = torch.ones(wt.shape[0], wt.shape[1], wt.shape[2] // 128, device=wt.device)
        torch._scaled_grouped_mm(recv_q, wq_t.transpose(1, 2), recv_s, bs, offs=offs, out_dtype=torch.bfloat16)
        out["block_1x128_call"] = "accepted"
    except Exception as e:  # noqa: BLE001 - the refusal is the finding
        out["block_1x128_call"] = "refused: " + str(e).splitlines()[0][:160]
    del wq_t, bs
    rows = dequantize_rows(recv_q, recv_s)
    out["ms_requant_rows_rowwise"] = timed(lambda: rowwise_quant(rows), iters)
    out["ms_quant_w1_rowwise"] = timed(lambda: rowwise_quant(wt), max(2, iters // 2))
    xa, sa = rowwise_quant(rows)
    wb, sb = rowwise_quant(wt)
    wb = wb.contiguous()
    try:
        out["ms_scaled_grouped_mm_rowwise"] = timed(
            lambda: torch._scaled_grouped_mm(xa, wb.transpose(1, 2), sa, sb, offs=offs, out_dtype=torch.bfloat16),
            iters,
        )
    except Exception as e:  # noqa: BLE001
        out["ms_scaled_grouped_mm_rowwise"] = "failed: " + str(e).splitlines()[0][:160]
    out["ms_grouped_mm_bf16"] = timed(lambda: torch._grouped_mm(rows, w1_view, offs=offs), iters)
    return out


def main():
    a = parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    moe = flatep.nn.MoE(a.hidden, a.ffn, a.experts, a.topk, num_tokens=a.tokens, seed=0, device=device,
                        activation=a.activation)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(a.tokens, a.hidden, device=device, generator=g)
    gout = torch.randn(a.tokens, a.hidden, device=device, generator=g)
    idx = testing.sample_topk(a.experts, a.tokens, a.topk, 0, seed=1).to(device)

    def step(fp8, keep=False):
        moe.fp8 = fp8
        xi = x.clone().requires_grad_()
        out = moe(xi, idx)
        (out.float() * gout).sum().backward()
        if keep:
            return out.detach(), xi.grad, moe.router.weight.grad.clone(), [p.main_grad.clone() for p in
                                                                              moe.expert_parameters()]
        return None

    results = {}
    for fp8 in (False, True):  # one reference step of each, from zero gradients
        moe.zero_main_grad()
        moe.router.weight.grad = None
        results[fp8] = step(fp8, keep=True)
    (o0, x0, r0, (w10, w20)), (o1, x1, r1, (w11, w21)) = results[False], results[True]
    errors = {"err_out": rel_l2(o1, o0), "err_grad_x": rel_l2(x1, x0), "err_grad_router": rel_l2(r1, r0),
              "err_grad_w1": rel_l2(w11, w10), "err_grad_w2": rel_l2(w21, w20)}
    del results, o0, x0, r0, w10, w20, o1, x1, r1, w11, w21

    for _ in range(a.warmup):
        step(False)
        step(True)
    torch.cuda.synchronize()
    times = {False: [], True: []}
    for _ in range(a.iters):
        for fp8 in (False, True):
            moe.router.weight.grad = None
            times[fp8].append(timed(lambda: step(fp8), 1, warmup=0))
    ms_bf16, ms_fp8 = statistics.median(times[False]), statistics.median(times[True])

    # The dispatch alone, both forms, same plan (no autograd).
    buf = moe.buffer
    plan = buf.plan(idx)
    xb = x.to(torch.bfloat16)
    w = torch.full((a.tokens, a.topk), 1.0 / a.topk, device=device)
    with torch.no_grad():
        ms_dispatch_bf16 = timed(lambda: buf.dispatch(plan, xb, w), a.iters)
        ms_dispatch_fp8 = timed(lambda: buf.dispatch(plan, xb, w, fp8=True), a.iters)
        (recv_q, recv_s), _, cu = buf.dispatch(plan, xb, w, fp8=True)
        ms_dequant = timed(lambda: dequantize_rows(recv_q, recv_s), a.iters)
        saved, flatep.nn._triton_dequantize = flatep.nn._triton_dequantize, lambda: None
        ms_dequant_torch = timed(lambda: dequantize_rows(recv_q, recv_s), a.iters)  # the torch-ops path
        flatep.nn._triton_dequantize = saved
        probe = scaled_gemm_probe(recv_q, recv_s, moe.expert_layer.weights(0), cu.to(torch.int32), a.iters)

    row = {
        "S": a.tokens, "H": a.hidden, "F": a.ffn, "epn": a.experts, "K": a.topk, "activation": a.activation,
        "rows": int(plan.stats["loads"][0]),
        "ms_layer_bf16": round(ms_bf16, 3), "ms_layer_fp8": round(ms_fp8, 3),
        "fp8_over_bf16": round(ms_fp8 / ms_bf16, 3),
        "ms_dispatch_bf16": round(ms_dispatch_bf16, 3), "ms_dispatch_fp8": round(ms_dispatch_fp8, 3),
        "dequant_path": "triton" if flatep.nn._triton_dequantize() else "torch ops",
        "ms_dequant_rows": round(ms_dequant, 3), "ms_dequant_torch_ops": round(ms_dequant_torch, 3),
        **{k: round(v, 5) for k, v in errors.items()},
        **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in probe.items()},
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device),
    }
    for k, v in row.items():
        print(f"{k}: {v}", flush=True)
    if a.csv:
        new = not os.path.exists(a.csv)
        with open(a.csv, "a", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(row))
            if new:
                wr.writeheader()
            wr.writerow(row)
    testing.release_all()


if __name__ == "__main__":
    main()
