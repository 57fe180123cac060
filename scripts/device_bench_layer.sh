#!/usr/bin/env bash
# The MoE-layer figures (docs/performance.md) in one command, on the device machine (2 H200s; nvcc, CMake, Ninja,
# python3 with a CUDA torch and NCCL):
#
#   scripts/device_bench_layer.sh          # CSVs and PNGs into ${OUT:-benchmarks/results}, logs beside them
#
# builds the CUDA build's Python extension (scripts/device_suite.sh's build step), then runs
#   benchmarks/moe_layer_virtual.py --gpus 2   R=8 virtual ranks, MoonEP (maxvio 0.2 1 10 20) and DeepEP configs
#   benchmarks/moe_layer.py --ranks 2          one process per GPU, the per-rank sizes of both configs
# Exit status: 1 when any run failed (each run checks FlatEP against the baseline before timing).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 CUDA_MODULE_LOADING=EAGER
PY=${PYTHON:-python3}
if ! SUITE_STEPS=build OUT="$OUT/build-logs" scripts/device_suite.sh >"$OUT/build.log" 2>&1; then
    tail -20 "$OUT/build.log"
    exit 1
fi
export PYTHONPATH="$PWD/python:$PWD/build-cuda/python${PYTHONPATH:+:$PYTHONPATH}"
failed=0
run() {
    local name=$1
    shift
    echo "== $name: $*"
    if ! "$PY" "$@" --out "$OUT" >"$OUT/$name.log" 2>&1; then
        echo "FAILED $name (log: $OUT/$name.log)"
        tail -5 "$OUT/$name.log"
        failed=1
    fi
    grep -A8 "layer forward+backward" "$OUT/$name.log" | head -8
}
run virtual_moonep benchmarks/moe_layer_virtual.py --gpus 2 --config moonep --maxvio 0.2 1 10 20 --iters 5 --warmup 2
run virtual_deepep benchmarks/moe_layer_virtual.py --gpus 2 --config deepep --iters 5 --warmup 2
run r2_moonep benchmarks/moe_layer.py --ranks 2 --config moonep --experts 96 --maxvio 0.2 1 5 9 --iters 10 --warmup 3
run r2_deepep benchmarks/moe_layer.py --ranks 2 --config deepep --experts 64 --iters 10 --warmup 3
exit $failed
