#!/usr/bin/env bash
# FlatEP's GPU runs, for a device machine (one or more Hopper GPUs, nvcc 13, CMake, Ninja, python3 with a CUDA torch,
# pybind11, pytest, numpy; no network): one runner, named steps, one deadline.
#
#   scripts/device.sh STEP...            run the steps in the order given (a campaign name expands to its steps)
#   scripts/device.sh --list             the steps and campaigns
#
# Every step has its own log (logs/<step>.log), a time limit (cut to what is left of DEVICE_DEADLINE_S, default 570 s:
# a device call lasts at most 10 minutes), one PASS / FAIL / SKIP line in logs/summary.txt, and never stops the run.
# A step writes its results under results/<step>/. At the end (the device tool brings back at most 8 files) $OUT holds
# results.tgz (every log and result but the routing traces) and each trace as $OUT/<step>_<file>.npz. The exit status
# is 0 when every step passed.
#
# Environment: OUT (default /tmp/out), DEVICE_DEADLINE_S, DEVICE_STOP_ON_FAIL=1 (the steps after a failed one are not
# run), PYTHON (python3), BUILD (build-cuda), JOBS (16),
# FLATEP_TIMEOUT_S (default here 60). NCCL_NVLS_ENABLE=0 always (NVLink multicast stays off on shared machines).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-/tmp/out}
WORK=${DEVICE_WORK:-/tmp/device_run}
LOGS=$WORK/logs
RESULTS=$WORK/results
rm -rf "$WORK"
mkdir -p "$LOGS" "$RESULTS" "$OUT"
PY=${PYTHON:-python3}
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-16}
DEADLINE_S=${DEVICE_DEADLINE_S:-570}
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
fi
export NCCL_NVLS_ENABLE=0
export FLATEP_TIMEOUT_S=${FLATEP_TIMEOUT_S:-60}
export PYTHONPATH="$ROOT/python:$ROOT/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PY BUILD JOBS RESULTS
SUMMARY=$LOGS/summary.txt
FAILED=0

# ---- steps: step_<name> runs one; STEP_LIMIT[<name>] is its time limit in seconds ----
declare -A STEP_LIMIT STEP_HELP

STEP_HELP[build]="configure and build $BUILD: flatep._C for this python3 (the Python steps need only it)"
STEP_LIMIT[build]=300
step_build() {
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
        -DFLATEP_BUILD_TESTS=ON -DFLATEP_BUILD_TOOLS=OFF -DFLATEP_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$PY")" &&
        cmake --build "$BUILD" -j"$JOBS" --target flatep_python
}

STEP_HELP[build_tests]="the GPU test mains and C++ benchmarks in $BUILD (after build)"
STEP_LIMIT[build_tests]=300
step_build_tests() {
    cmake --build "$BUILD" -j"$JOBS" --target test_gpu_ops test_gpu_fp8 test_gpu_serving test_gpu_static ipc_gpu_main \
        ipc_buffer_gpu_main ipc_pools_gpu_main step_graph_gpu_main ops_bench serving_bench fp8_bench
}

STEP_HELP[static]="the static planner on the GPU: test_gpu_static, test_gpu_serving's static_* cases, its Python tests"
STEP_LIMIT[static]=420
step_static() {
    "$BUILD"/tests/gpu/test_gpu_static || return 1
    local c
    for c in static_b4_graph static_b1_graph static_bepn_push static_b2_pad_rows_unweighted; do
        "$BUILD"/tests/gpu/test_gpu_serving --case "$c" || return 1
    done
    "$PY" -m pytest -q -rA -m cuda tests/python/test_gpu_static.py tests/python/test_gpu_graphs.py \
        tests/python/test_static_placement.py
}

STEP_HELP[build_serving]="test_gpu_serving alone in $BUILD (after build): the serving and static cases' binary"
STEP_LIMIT[build_serving]=240
step_build_serving() { cmake --build "$BUILD" -j"$JOBS" --target test_gpu_serving; }

STEP_HELP[serving_quick]="test_gpu_serving --quick: serving steps (B slots, every planner, graphs) bitwise vs the CPU backend"
STEP_LIMIT[serving_quick]=240
step_serving_quick() { "$BUILD"/tests/gpu/test_gpu_serving --quick; }

STEP_HELP[capture]="tests/python/test_first_call.py's capture cases on CUDA (virtual ranks: flatep.virtual.graph)"
STEP_LIMIT[capture]=180
step_capture() { FLATEP_SPAWN_TIMEOUT_S=150 "$PY" -m pytest -q -rA -m cuda tests/python/test_first_call.py -k capture; }

STEP_HELP[eplb_real]="benchmarks/eplb_compare.py --time on the training run's routing (layer 3, 150 steps)"
STEP_LIMIT[eplb_real]=300
step_eplb_real() {
    "$PY" benchmarks/eplb_compare.py --trace benchmarks/results/train_e2e_h100/trace_flatep.npz --layer 3 --steps 150 \
        --time --out "$RESULTS/eplb_real"
}

STEP_HELP[probe]="benchmarks/host_block_probe.py: which host calls wait for another stream's running kernel"
STEP_LIMIT[probe]=90
step_probe() { "$PY" benchmarks/host_block_probe.py; }

STEP_HELP[first_call]="tests/python/test_first_call.py -m cuda: README programs, each FlatEP's first call of its process"
STEP_LIMIT[first_call]=420
step_first_call() { FLATEP_SPAWN_TIMEOUT_S=200 "$PY" -m pytest -q -rA -m cuda tests/python/test_first_call.py; }

STEP_HELP[e2e_smoke]="benchmarks/train_e2e.py --preset tiny on the GPU, 4 virtual ranks, 10 steps"
STEP_LIMIT[e2e_smoke]=100
step_e2e_smoke() {
    "$PY" benchmarks/train_e2e.py --preset tiny --device cuda --ranks 4 --experts 16 --steps 10 --no-plot \
        --out "$RESULTS/e2e_smoke"
}

STEP_HELP[e2e]="benchmarks/train_e2e.py --preset h200: FlatEP against the all-to-all baseline, 8 virtual ranks, 300 steps"
STEP_LIMIT[e2e]=480
step_e2e() { "$PY" benchmarks/train_e2e.py --preset h200 --out "$RESULTS/e2e"; }

STEP_HELP[e2e_processes]="benchmarks/train_e2e.py --preset h200 --processes: one process per rank on the GPU, 40 steps"
STEP_LIMIT[e2e_processes]=420
step_e2e_processes() {
    "$PY" benchmarks/train_e2e.py --preset h200 --processes --ranks 4 --steps 40 --memory-every 5 \
        --out "$RESULTS/e2e_processes"
}

decode() {
    "$PY" benchmarks/serving_step.py --preset "$1" --decode-sweep 1,16,128,512 --iters 10 --csv "$RESULTS/decode_$1.csv"
}
STEP_HELP[decode_deepep]="benchmarks/serving_step.py --preset deepep --decode-sweep: owner against balanced B=4"
STEP_LIMIT[decode_deepep]=150
step_decode_deepep() { decode deepep; }
STEP_HELP[decode_k3model]="the same at Kimi K3's model shape (H=3584, K=16, E=896)"
STEP_LIMIT[decode_k3model]=150
step_decode_k3model() { decode k3model; }
STEP_HELP[decode_k3]="the same at the k3 preset (H=7168, K=8, E=896, F=512)"
STEP_LIMIT[decode_k3]=150
step_decode_k3() { decode k3; }

# ---- campaigns: named lists of steps ----
declare -A CAMPAIGN=(
    [issue59]="build probe decode_deepep decode_k3model first_call"
    [issue58]="build e2e_smoke e2e"
)

usage() {
    echo "usage: scripts/device.sh STEP|CAMPAIGN ... | --list"
    echo "steps:"
    for s in "${!STEP_HELP[@]}"; do printf '  %-16s %s\n' "$s" "${STEP_HELP[$s]}"; done | sort
    echo "campaigns:"
    for c in "${!CAMPAIGN[@]}"; do printf '  %-16s %s\n' "$c" "${CAMPAIGN[$c]}"; done | sort
}

steps=()
for arg in "$@"; do
    if [[ $arg == --list ]]; then
        usage
        exit 0
    elif [[ -n ${CAMPAIGN[$arg]:-} ]]; then
        read -ra more <<<"${CAMPAIGN[$arg]}"
        steps+=("${more[@]}")
    elif [[ -n ${STEP_HELP[$arg]:-} ]]; then
        steps+=("$arg")
    else
        echo "device.sh: unknown step or campaign '$arg' (--list shows them)" >&2
        exit 2
    fi
done
((${#steps[@]})) || {
    usage >&2
    exit 2
}

START=$SECONDS
: >"$SUMMARY"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
for step in "${steps[@]}"; do
    left=$((DEADLINE_S - (SECONDS - START)))
    if ((FAILED)) && [[ ${DEVICE_STOP_ON_FAIL:-0} == 1 ]]; then
        echo "NOT RUN $step (an earlier step failed)" | tee -a "$SUMMARY"
        continue
    fi
    if ((left < 15)); then
        echo "NOT RUN $step (deadline)" | tee -a "$SUMMARY"
        FAILED=1
        continue
    fi
    limit=${STEP_LIMIT[$step]}
    ((limit > left)) && limit=$left
    log=$LOGS/$step.log
    t0=$SECONDS
    echo "==> $step (limit $limit s)"
    timeout --kill-after=10 "$limit" bash -c "$(declare -f "step_$step" decode); step_$step" >"$log" 2>&1
    rc=$?
    if ((rc == 0)) && grep -qE "^SKIP|[0-9]+ skipped" "$log" && ! grep -qE "[0-9]+ passed" "$log"; then
        result=SKIP
        FAILED=1
    elif ((rc == 0)); then
        result=PASS
    else
        result="FAIL rc=$rc"
        FAILED=1
    fi
    echo "$result $step ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
    tail -n 25 "$log"
done
echo "device.sh: $((SECONDS - START)) s" | tee -a "$SUMMARY"
while IFS= read -r trace; do
    rel=${trace#"$RESULTS"/}
    cp "$trace" "$OUT/${rel//\//_}"
done < <(find "$RESULTS" -name '*.npz')
tar czf "$OUT/results.tgz" -C "$WORK" --exclude='*.npz' logs results 2>/dev/null
exit "$FAILED"
