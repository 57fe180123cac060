#!/usr/bin/env bash
# Every GPU check of FlatEP in one run, for the device machine (one or more H200s, nvcc 13, CMake, Ninja, python3 with
# a CUDA torch, pybind11, pytest, numpy; no GoogleTest, no network):
#
#   build        configure + build the CUDA build in build-cuda (Ninja; only the GPU test binaries, the Python
#                extension flatep._C for this python3, and what they need)
#   gpu_ops      build-cuda/tests/gpu/test_gpu_ops: every kernel bitwise against the CPU backend on virtual ranks
#   gpu_fp8      build-cuda/tests/gpu/test_gpu_fp8: FP8 dispatch (both input forms, both scale modes) and the FP8 rule
#                bitwise against the CPU backend on virtual ranks
#   serving      tests/gpu/test_gpu_serving: serving steps (B 0/1/4/epn, 4 planners, empty ranks, graphs) vs the CPU
#                backend, then tests/gpu/test_gpu_static: the static planner's GPU plans vs the host planner (R 1..64)
#   ipc_gpu      ipc_gpu_main 2 4: R processes sharing GPU 0 through CUDA VMM fds
#   ipc_buffer   ipc_buffer_gpu_main 2 4 8: flatep::Buffer on device memory, R processes, bitwise vs the CPU backend
#   ipc_pools    ipc_pools_gpu_main: ExpertPools compute views, prefetch and reduce_grad on device memory
#   step_graph   step_graph_gpu_main 2 4: a whole training step through Buffer / ExpertPools captured as one CUDA
#                graph per rank process, 20 replays with new routing bitwise equal to the eager step
#   virtual_gpu  python3 -m pytest tests/python/test_gpu_virtual.py -m cuda (issue 46, in a user's environment): a
#                two-layer RMSNorm + nn.MoE model on 4 virtual ranks in a fresh python3 with CUDA_MODULE_LOADING unset
#                (first eager step, whole-step graph replays bitwise, no "[flatep warning]" up to its exit), the lazy-
#                loading warning, ExpertPools built on fresh threads vs the CPU backend, 30 create/destroy cycles flat
#   pytest_cuda  python3 -m pytest tests/python -m cuda: the multi-process Python tests on cuda:0 (MoE output and
#                gradients vs the dense reference, every op bitwise vs the CPU backend), train_moe on cuda, grouped_mm
#                (all but test_gpu_virtual.py, which is the step above)
#   pytest_cuda1, pytest_cuda2  (only when named) pytest_cuda in two halves, each within one device call: the test
#                files up to test_gpu_zero_copy.py, then the rest (by 2026-12-04 the whole step needed more than the
#                380 s a call leaves it after the build)
#   train_cuda   examples/train_moe.py --device cuda, 4 processes on the GPU, slack mode
#   soak         benchmarks/gpu_soak.py in the environment a user has (FLATEP_TIMEOUT_S and CUDA_MODULE_LOADING
#                unset): 3000 steps on 4 virtual ranks driven by one thread, 1000 steps of 2 processes sharing the
#                GPU; fresh skew per step, replays bitwise, S*K rows every step, status, flat memory ($OUT/soak.csv)
#   pytest_cpu   python3 -m pytest tests/python -m "not cuda": the CPU tests under this torch (last: the least news)
#   step_graph_repeat  (only when named) the in-processes whole-step test, once flaky (docs/performance.md: a race of
#                the test's own, fixed 2026-12-03) STEP_GRAPH_REPEAT times (default 3) under
#                CUDA_DEVICE_MAX_CONNECTIONS=32 (what tests/python/conftest.py sets) and as many under 8, each time from
#                pytest and then from a plain python3 parent (tests/python/step_graph_cases.py run as a script), one
#                line per run; the first pytest run of each writes both ranks' captured graphs (Graphviz, gzip) to
#                $OUT/graphs_<connections> and prints their forks (scripts/graph_forks.py) (about 4 minutes)
#
#   scripts/device_suite.sh                                   # every step, logs in ${OUT:-/tmp/out}
#   SUITE_STEPS="build pytest_cuda" scripts/device_suite.sh   # a subset, run in the order above
#
# Never stops at a failure: each step has its own log ($OUT/<step>.log), a timeout, and one PASS / FAIL / SKIP line
# (SKIP: the step ran but found no usable GPU, which on the device machine is a failure too); $OUT/summary.txt grows
# step by step and ends with the table of step, result and seconds. Exit status: 0 when every selected step passed.
# The whole run stays within SUITE_DEADLINE_S (default 540 s): a step gets at most the time that is left. With the
# FP8, whole-step-graph, MoonEP planner-sweep and torch.compile checks the full list takes longer than one 10-minute
# device call; run it as three calls (each a fresh machine builds again, about 60-80 s):
#   SUITE_STEPS="build gpu_ops gpu_fp8 serving ipc_gpu ipc_buffer ipc_pools step_graph virtual_gpu" scripts/device_suite.sh
#   SUITE_STEPS="build pytest_cuda1" scripts/device_suite.sh, then the same with pytest_cuda2
#   SUITE_STEPS="build train_cuda soak pytest_cpu" scripts/device_suite.sh
# (On 2026-12-01, with the compile tests added, pytest_cuda ran past its old 360 s limit after 68 of its 72 tests:
# the limit is now 500 s.)
#
# Environment: OUT, SUITE_STEPS, SUITE_CLEAN=1 (delete build-cuda first), SUITE_JOBS (build jobs, default 16),
# SUITE_DEADLINE_S, PYTHON (default python3), FLATEP_TIMEOUT_S (default here 60). CUDA_MODULE_LOADING is left as
# the caller has it (FlatEP loads its kernels itself: no step needs EAGER). An existing build-cuda is reused only
# when this script configured it with the same source path and toolchain (a stamp file); any other build-cuda (e.g.
# copied from another machine) is deleted and rebuilt.
# shellcheck disable=SC2317  # the step functions are called indirectly ("$SELF" __run FUNCTION)
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.." || exit 2
ROOT=$PWD
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
fi

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BUILD=build-cuda
JOBS=${SUITE_JOBS:-16}
DEADLINE_S=${SUITE_DEADLINE_S:-540}
PY=$(command -v "${PYTHON:-python3}" || true)
DEFAULT_STEPS="build gpu_ops gpu_fp8 serving ipc_gpu ipc_buffer ipc_pools step_graph virtual_gpu pytest_cuda train_cuda soak pytest_cpu"
# The order steps run in; the last three only when SUITE_STEPS names them.
ALL_STEPS="$DEFAULT_STEPS step_graph_repeat pytest_cuda1 pytest_cuda2"
STEPS=${SUITE_STEPS:-$DEFAULT_STEPS}

export NCCL_NVLS_ENABLE=0
export FLATEP_TIMEOUT_S=${FLATEP_TIMEOUT_S:-60}
export FLATEP_BUILD_DIR=$BUILD
export PYTHONPATH="$ROOT/python:$ROOT/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

START=$(date +%s.%N)
SUMMARY=$OUT/summary.txt
declare -a ROWS=()
FAILED=0

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
left_s() { awk -v s="$START" -v n="$(now)" -v d="$DEADLINE_S" 'BEGIN { printf "%d", d - (n - s) }'; }
say() { echo "$*" | tee -a "$SUMMARY"; }

# run_step NAME TIMEOUT_S COMMAND...: runs the command (a program, or one of this script's functions through
# "$SELF __run FUNCTION") with a timeout (its whole process group is killed at the limit), logs to $OUT/NAME.log and
# records PASS / FAIL / SKIP. A GPU step that exits 0 but skipped (a line starting with SKIP, or pytest's "N skipped")
# is recorded as SKIP.
run_step() {
    local name=$1 limit=$2
    shift 2
    local log=$OUT/$name.log left
    left=$(left_s)
    if ((left < 15)); then
        ROWS+=("$name|NOT RUN (suite deadline)|0.0")
        say "NOT RUN $name: less than 15 s left of SUITE_DEADLINE_S=$DEADLINE_S"
        FAILED=1
        return
    fi
    ((limit > left)) && limit=$left
    echo "==> $name (timeout ${limit} s): $*"
    {
        echo "# step $name: $*"
        echo "# cwd $ROOT; timeout ${limit} s; $(date -u +%FT%TZ)"
    } >"$log"
    local t0 rc result
    t0=$(now)
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local secs
    secs=$(elapsed "$t0")
    if ((rc == 0)); then
        result=PASS
        if [[ $name != build && $name != pytest_cpu ]] &&
            { grep -Eq '^SKIP' "$log" || tail -n 3 "$log" | grep -Eq '[0-9]+ skipped'; }; then
            result=SKIP  # rc 0 but nothing (or not everything) ran on the GPU
        fi
    elif ((rc == 124 || rc == 137)); then
        result="FAIL (timeout ${limit} s)"
    else
        result="FAIL (exit $rc)"
    fi
    [[ $result == PASS ]] || FAILED=1
    ROWS+=("$name|$result|$secs")
    say "$result $name (${secs} s) log: $log"
    if [[ $result != PASS ]]; then
        tail -n 25 "$log" | sed 's/^/    /'
        echo
    fi
}

# ---- build ----

toolchain_stamp() {
    echo "root $ROOT"
    echo "python $PY"
    "$PY" -c 'import sys, torch as t; print("python", sys.version.split()[0], "torch", t.__version__, t.version.cuda)'
    echo "nvcc $(command -v nvcc) $(nvcc --version 2>&1 | tail -n 1)"
    echo "c++ $(command -v "${CXX:-c++}") $("${CXX:-c++}" --version 2>&1 | head -n 1)"
    echo "cmake $(cmake --version | head -n 1); ninja $(ninja --version)"
}

build_all() {
    local stamp=$BUILD/.device_suite_stamp want
    want=$(toolchain_stamp)
    if [[ ${SUITE_CLEAN:-0} == 1 && -d $BUILD ]]; then
        echo "SUITE_CLEAN=1: removing $BUILD"
        rm -rf "$BUILD"
    elif [[ -d $BUILD ]] && ! diff -q <(echo "$want") "$stamp" >/dev/null 2>&1; then
        # Not configured by this script with this source path and toolchain (e.g. copied from another machine):
        # its CMake cache and objects cannot be trusted.
        echo "$BUILD was not configured by device_suite.sh with this source path and toolchain: removing it"
        [[ -f $stamp ]] && diff <(echo "$want") "$stamp"
        rm -rf "$BUILD"
    fi
    echo "$want"
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
        -DFLATEP_BUILD_TESTS=ON -DFLATEP_BUILD_TOOLS=OFF -DFLATEP_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PY" || return 1
    echo "$want" >"$stamp"
    cmake --build "$BUILD" -j"$JOBS" --target test_gpu_ops test_gpu_fp8 test_gpu_serving test_gpu_static ipc_gpu_main \
        ipc_buffer_gpu_main ipc_pools_gpu_main step_graph_gpu_main flatep_python || return 1
    ls -l "$BUILD"/tests/gpu/test_gpu_ops "$BUILD"/tests/gpu/test_gpu_fp8 "$BUILD"/tests/gpu/test_gpu_serving "$BUILD"/tests/gpu/ipc_*_main \
        "$BUILD"/python/flatep/_C*.so
    # Benchmark drivers the coordinator runs by hand (not a suite step); a failure here does not fail the build step.
    cmake --build "$BUILD" -j"$JOBS" --target fp8_bench ops_bench serving_bench ||
        echo "device_suite: fp8_bench, ops_bench or serving_bench did not build"
}

# ---- steps ----

cuda_preflight() {
    # What pytest's cuda parameters need; fails loudly instead of letting them skip.
    "$PY" - <<'EOF'
import torch, flatep
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
print("flatep._C", flatep._C.__file__, "has_cuda", flatep._C.has_cuda)
print("torch._grouped_mm", hasattr(torch, "_grouped_mm"))
assert flatep._C.has_cuda, "flatep._C was built without CUDA"
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("device 0:", torch.cuda.get_device_name(0))
EOF
}

# pytest_cuda_files [FILE...]: the cuda tests of these files (none: all of tests/python) but test_gpu_virtual.py.
pytest_cuda_files() {
    cuda_preflight || return 1
    # A spawned test that hangs fails on its own after 240 s (flatep.testing.spawn) instead of using up the step;
    # -v names every test as it ends, so a step killed at its limit still shows how far it got.
    FLATEP_SPAWN_TIMEOUT_S=${FLATEP_SPAWN_TIMEOUT_S:-240} "$PY" -m pytest "${@:-tests/python}" -v -rs -m cuda \
        -p no:cacheprovider --durations=15 --ignore=tests/python/test_gpu_virtual.py
}

pytest_cuda() { pytest_cuda_files; }

# The two halves of pytest_cuda: test files sorted by name, split after test_gpu_zero_copy.py.
pytest_cuda_half() {
    local LC_ALL=C f first=() second=()
    for f in tests/python/test_*.py; do
        if [[ $(basename "$f") < test_gpu_zz ]]; then first+=("$f"); else second+=("$f"); fi
    done
    if (($1 == 1)); then pytest_cuda_files "${first[@]}"; else pytest_cuda_files "${second[@]}"; fi
}

# The serving steps, then the static planner's GPU plans (both fail the step; each prints PASS / FAIL lines).
serving() {
    "$GPU_BIN"/test_gpu_serving || return 1
    "$GPU_BIN"/test_gpu_static || return 1
}

virtual_gpu() {
    cuda_preflight || return 1
    # The test starts its own fresh interpreters without CUDA_MODULE_LOADING / CUDA_DEVICE_MAX_CONNECTIONS.
    "$PY" -m pytest tests/python/test_gpu_virtual.py -v -rs -s -m cuda -p no:cacheprovider --durations=5
}

soak() {
    # A user's environment: no timeout override, no module-loading override (PYTHONPATH only finds the build).
    env -u FLATEP_TIMEOUT_S -u CUDA_MODULE_LOADING "$PY" benchmarks/gpu_soak.py --mode virtual --ranks 4 \
        --steps 3000 --csv "$OUT/soak.csv" || return 1
    env -u FLATEP_TIMEOUT_S -u CUDA_MODULE_LOADING "$PY" benchmarks/gpu_soak.py --mode processes --ranks 2 \
        --steps 1000 --csv "$OUT/soak.csv" || return 1
}

step_graph_repeat() {
    cuda_preflight || return 1
    local n=${STEP_GRAPH_REPEAT:-3} failed=0 c i dump log
    for c in 32 8; do
        for ((i = 1; i <= n; i++)); do
            dump=""
            if ((i == 1)); then
                dump=$OUT/graphs_$c
                mkdir -p "$dump"
            fi
            log=$OUT/step_graph_repeat_${c}_$i.log
            if CUDA_DEVICE_MAX_CONNECTIONS=$c FLATEP_STEP_GRAPH_DUMP=$dump FLATEP_SPAWN_TIMEOUT_S=120 "$PY" -m pytest \
                tests/python/test_gpu_step_graph.py -q -vv -m cuda -p no:cacheprovider -k in_processes >"$log" 2>&1; then
                echo "CUDA_DEVICE_MAX_CONNECTIONS=$c run $i: pass"
            else
                echo "CUDA_DEVICE_MAX_CONNECTIONS=$c run $i: FAIL ($log)"
                grep -E "^E  " "$log" | cut -c1-2000 | head -n 4
                failed=1
            fi
            log=$OUT/step_graph_plain_${c}_$i.log
            if CUDA_DEVICE_MAX_CONNECTIONS=$c FLATEP_SPAWN_TIMEOUT_S=120 "$PY" tests/python/step_graph_cases.py >"$log" 2>&1
            then
                echo "CUDA_DEVICE_MAX_CONNECTIONS=$c run $i, plain python3 parent: pass"
            else
                echo "CUDA_DEVICE_MAX_CONNECTIONS=$c run $i, plain python3 parent: FAIL ($log)"
                tail -n 2 "$log" | cut -c1-2000
                failed=1
            fi
            if [[ -n $dump ]]; then
                for f in "$dump"/*.dot; do
                    [[ -f $f ]] || continue
                    echo "  $(basename "$f"):"
                    "$PY" scripts/graph_forks.py "$f" --limit 8 2>&1 | head -n 40 | sed 's/^/    /'
                done
                gzip -f "$dump"/*.dot 2>/dev/null
            fi
        done
    done
    return "$failed"
}

pytest_cpu() {
    "$PY" -m pytest tests/python -q -rs -m "not cuda" -p no:cacheprovider
}

GPU_BIN=$BUILD/tests/gpu

# Internal: "$SELF __run FUNCTION" runs one of the functions above (so that `timeout` can bound it).
if [[ ${1:-} == __run ]]; then
    shift
    "$@"
    exit $?
fi

for s in $STEPS; do
    case " $ALL_STEPS " in
        *" $s "*) ;;
        *) echo "device_suite: unknown step '$s' in SUITE_STEPS (steps: $ALL_STEPS)"; exit 2 ;;
    esac
done
: >"$SUMMARY"

{
    echo "# device_suite.sh $(date -u +%FT%TZ) at $ROOT; steps: $STEPS"
    echo "# CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-(unset)} NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" \
        "FLATEP_TIMEOUT_S=$FLATEP_TIMEOUT_S"
    echo "# PYTHONPATH=$PYTHONPATH"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv 2>&1
    else
        echo "# no nvidia-smi on PATH"
    fi
    echo "# python: ${PY:-none}"
    git log -1 --format='# commit %H %s' 2>/dev/null
    git status --short 2>/dev/null | head -n 40
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"
if [[ -z $PY ]]; then
    say "device_suite: no ${PYTHON:-python3} on PATH"
    exit 2
fi

for step in $ALL_STEPS; do  # in this order, whatever the order of SUITE_STEPS
    [[ " $STEPS " == *" $step "* ]] || continue
    case $step in
        build) run_step build 420 "$SELF" __run build_all ;;
        gpu_ops) run_step gpu_ops 300 "$GPU_BIN"/test_gpu_ops ;;
        gpu_fp8) run_step gpu_fp8 240 "$GPU_BIN"/test_gpu_fp8 ;;
        serving) run_step serving 240 "$SELF" __run serving ;;
        ipc_gpu) run_step ipc_gpu 150 "$GPU_BIN"/ipc_gpu_main 2 4 ;;
        ipc_buffer) run_step ipc_buffer 240 "$GPU_BIN"/ipc_buffer_gpu_main 2 4 8 ;;
        ipc_pools) run_step ipc_pools 180 "$GPU_BIN"/ipc_pools_gpu_main ;;
        step_graph) run_step step_graph 180 "$GPU_BIN"/step_graph_gpu_main 2 4 ;;
        virtual_gpu) run_step virtual_gpu 240 "$SELF" __run virtual_gpu ;;
        pytest_cuda) run_step pytest_cuda 500 "$SELF" __run pytest_cuda ;;
        pytest_cuda1) run_step pytest_cuda1 500 "$SELF" __run pytest_cuda_half 1 ;;
        pytest_cuda2) run_step pytest_cuda2 500 "$SELF" __run pytest_cuda_half 2 ;;
        soak) run_step soak 300 "$SELF" __run soak ;;
        pytest_cpu) run_step pytest_cpu 300 "$SELF" __run pytest_cpu ;;
        step_graph_repeat) run_step step_graph_repeat 600 "$SELF" __run step_graph_repeat ;;
        train_cuda)
            run_step train_cuda 180 "$PY" examples/train_moe.py --device cuda --ranks 4 --steps 8 --tokens 64 \
                --experts 16 --capacity-factor 1.25
            ;;
    esac
done

{
    echo
    printf '%-12s %-34s %8s\n' step result seconds
    for row in "${ROWS[@]+"${ROWS[@]}"}"; do
        IFS='|' read -r n r s <<<"$row"
        printf '%-12s %-34s %8s\n' "$n" "$r" "$s"
    done
    printf '%-12s %-34s %8s\n' total "$( ((FAILED)) && echo FAILED || echo 'all passed')" "$(elapsed "$START")"
} | tee -a "$SUMMARY"
exit "$FAILED"
