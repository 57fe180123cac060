#!/usr/bin/env bash
# Serving and decode (issues 43 and 47) on one H200 in one device call of under 10 minutes. Steps, in priority order,
# each with its own time limit; every log is packed after each step into the one file $OUT/serving.tgz (the device
# tool fetches a bounded number of files):
#
#   build          scripts/device_suite.sh's build step (test_gpu_serving, ipc mains, flatep._C, the benchmarks)
#   serving        build-cuda/tests/gpu/test_gpu_serving: serving steps bitwise against the CPU backend
#   pytest         the cuda cases of tests/python/test_gpu_serving.py (nn.MoE serving and owner on CUDA virtual ranks,
#                  graph replay), test_serving_processes.py (serving on 4 processes sharing the GPU: views of more
#                  than 1023 groups) and test_example.py's serve_moe.py --device cuda
#   bench_deepep   build-cuda/benchmarks/serving_bench --preset deepep     serving_bench_deepep.csv
#   serving_step   benchmarks/serving_step.py --preset deepep --ffn 1536   serving_step_deepep.csv (nn.MoE serving step
#                  with the expert GEMM, per-rank CUDA graphs; F=1536: B=epn is the training layout, whose fp32
#                  gradients and reduce pools make F=2048 too large for 8 ranks on one GPU)
#   ipc_buffer     a CUDA Buffer on R processes, rank 3 with s = 0 (null pointers), bitwise against the CPU backend
#   quickstart     examples/quickstart.py --device cuda (the README's quick start)
#   bench_k3       build-cuda/benchmarks/serving_bench --preset k3         serving_bench_k3.csv
#   serving_step_k3  benchmarks/serving_step.py --preset k3 (F=512)        serving_step_k3.csv
#   ops_k3         build-cuda/benchmarks/ops_bench --preset k3 --ffn 512 --maxvio 1,20 --iters 15   ops_k3.csv
#   ffn_rows       the cuda cases of tests/python/test_gpu_ffn_rows.py and test_grouped.py: the FFN's bounded
#                  activation and zeroing kernels bitwise against the torch ops, grouped_ffn with them, graph replay
#   ops_quick      build-cuda/tests/gpu/test_gpu_ops --quick: every small op case bitwise against the CPU backend
#   ops_prefill    test_gpu_ops --case r8_moonep_s8192_e384_h7168_k8: the plan's general path at scale
#   fp8            build-cuda/tests/gpu/test_gpu_fp8
#   bench_deepep_b4, bench_k3_b4   serving_bench --batch 4 (four calls of each op a graph replay)
#   probe          benchmarks/host_block_probe.py (which host calls wait for another stream's running kernel), then
#                  test_streams.py's side-stream test alone, the first CUDA test of its process (it timed out so)
#
#   OUT=/tmp/out scripts/device_serving.sh
#   SERVING_STEPS="build serving" scripts/device_serving.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/out}
LOGS=${SERVING_LOGS:-/tmp/serving_logs}
mkdir -p "$OUT" "$LOGS"
export NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
STEPS=${SERVING_STEPS:-build serving pytest bench_deepep serving_step ipc_buffer quickstart bench_k3 serving_step_k3 ops_k3}
SUMMARY=$LOGS/summary.txt
START=$SECONDS
FAILED=0
: >"$SUMMARY"

pack() { tar czf "$OUT/serving.tgz.part" -C "$LOGS" . && mv "$OUT/serving.tgz.part" "$OUT/serving.tgz"; }

# run NAME LIMIT_S COMMAND...: one PASS / FAIL line with the seconds, the log in $LOGS/NAME.log, then pack.
run() {
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    if ((rc == 0)); then
        echo "PASS $name ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
    else
        echo "FAIL $name rc=$rc ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
        FAILED=1
    fi
    pack
}

run build 300 env SUITE_STEPS=build OUT="$LOGS/build" scripts/device_suite.sh
export PYTHONPATH="$PWD/python:$PWD/build-cuda/python${PYTHONPATH:+:$PYTHONPATH}"
run serving 150 build-cuda/tests/gpu/test_gpu_serving
run pytest 200 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/python/test_gpu_serving.py \
    tests/python/test_serving_processes.py tests/python/test_example.py -k "serving or serve or equals or replays"
run ffn_rows 120 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/python/test_gpu_ffn_rows.py \
    tests/python/test_grouped.py
run bench_deepep 180 build-cuda/benchmarks/serving_bench --preset deepep --csv "$LOGS/serving_bench_deepep.csv"
run serving_step 150 "$PY" benchmarks/serving_step.py --preset deepep --ffn 1536 --iters 10 \
    --csv "$LOGS/serving_step_deepep.csv"
run ipc_buffer 90 build-cuda/tests/gpu/ipc_buffer_gpu_main 4
run quickstart 60 "$PY" examples/quickstart.py --device cuda
run bench_k3 180 build-cuda/benchmarks/serving_bench --preset k3 --csv "$LOGS/serving_bench_k3.csv"
run serving_step_k3 150 "$PY" benchmarks/serving_step.py --preset k3 --iters 10 --csv "$LOGS/serving_step_k3.csv"
run ops_k3 60 build-cuda/benchmarks/ops_bench --preset k3 --ffn 512 --maxvio 1,20 --iters 15 \
    --csv "$LOGS/ops_k3_h200_8virtual.csv"
run ops_quick 240 build-cuda/tests/gpu/test_gpu_ops --quick
run ops_prefill 90 build-cuda/tests/gpu/test_gpu_ops --case r8_moonep_s8192_e384_h7168_k8
run fp8 120 build-cuda/tests/gpu/test_gpu_fp8
run bench_deepep_b4 200 build-cuda/benchmarks/serving_bench --preset deepep --batch 4 \
    --csv "$LOGS/serving_bench_deepep_batch4.csv"
run bench_k3_b4 200 build-cuda/benchmarks/serving_bench --preset k3 --batch 4 --csv "$LOGS/serving_bench_k3_batch4.csv"
run probe 150 bash -c "\"$PY\" benchmarks/host_block_probe.py && \"$PY\" -m pytest -q -p no:cacheprovider -m cuda \
    tests/python/test_streams.py -k side_stream_with_events"
echo "device_serving: $( ((FAILED)) && echo FAILED || echo 'all passed') in $((SECONDS - START)) s" | tee -a "$SUMMARY"
pack
exit "$FAILED"
