#!/usr/bin/env bash
# FlatEP's GPU runs, for a device machine (one or more Hopper GPUs, nvcc 13, CMake, Ninja, python3 with a CUDA torch,
# pybind11, pytest, numpy; no GoogleTest, no network): one runner, named steps, one deadline.
#
#   scripts/device.sh STEP|CAMPAIGN...   run the steps in the order given (a campaign expands to its steps; a step
#                                        named twice runs once, at its first place)
#   scripts/device.sh --list             every step (time limit, what it runs) and every campaign
#   scripts/device.sh --dry-run ARGS...  what ARGS would run (each step's limit and commands), running nothing
#
# Every step has its own log (logs/<step>.log), a time limit (cut to what is left of DEVICE_DEADLINE_S, default 570 s:
# a device call lasts at most 10 minutes), one PASS / FAIL / SKIP line in logs/summary.txt, and never stops the run.
# SKIP: the step exited 0 but a line starts with SKIP or pytest skipped tests and passed none (no usable GPU, fewer
# GPUs than the step needs); on the device machine that is a failure too. A step writes its results under
# results/<step>/ ($STEP_OUT). logs/env.log holds the machine (GPUs, topology, toolchain) and the tree (commit,
# uncommitted files). At the end (the device tool brings back at most 8 files) $OUT holds results.tgz (every log and
# result but the routing traces) and each trace as $OUT/<step>_<file>.npz. The exit status is 0 when every step
# passed, 2 for an unknown step or campaign.
#
# The campaigns are the step lists of one device call each (the full suite is longer than one call: run suite_kernels,
# suite_pytest1, suite_pytest2 and suite_rest as four calls; each fresh machine builds again, about 60-90 s).
#
# Environment: OUT (default /tmp/out), DEVICE_DEADLINE_S, DEVICE_STOP_ON_FAIL=1 (the steps after a failed one are not
# run), DEVICE_CLEAN=1 (build_suite deletes build-cuda first), PYTHON (python3), BUILD (build-cuda), JOBS (16),
# FLATEP_TIMEOUT_S (default here 60), STEP_GRAPH_REPEAT (3), BENCH_ARGS (more ep_bench_multi flags),
# DEVICE_COVERAGE=1 (coverage.py over python/flatep in every Python step: results/coverage/python_cuda.json).
# NCCL_NVLS_ENABLE=0 always (NVLink multicast stays off on shared machines). CUDA_MODULE_LOADING is left as the caller
# has it, but for the layer and multi_gpu steps, which load every kernel at context creation (EAGER), as they did.
# shellcheck disable=SC2317  # the steps are called indirectly (bash -c "step_NAME")
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-/tmp/out}
WORK=${DEVICE_WORK:-/tmp/device_run}
LOGS=$WORK/logs
RESULTS=$WORK/results
PY=${PYTHON:-python3}
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-16}
DEADLINE_S=${DEVICE_DEADLINE_S:-570}
GPU_BIN=$BUILD/tests/gpu

# ---- steps: define NAME LIMIT_S HELP, then step_NAME runs it (bash, in the repository root, output to its log) ----
declare -A STEP_LIMIT STEP_HELP
ORDER=()
define() {
    STEP_LIMIT[$1]=$2
    STEP_HELP[$1]=$3
    ORDER+=("$1")
}

# -- builds --

define build 300 "configure and build $BUILD: flatep._C for this python3 (the Python steps need only it)"
step_build() {
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
        -DFLATEP_BUILD_TESTS=ON -DFLATEP_BUILD_TOOLS=OFF -DFLATEP_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$PY")" &&
        cmake --build "$BUILD" -j"$JOBS" --target flatep_python
}

define build_tests 300 "the GPU test mains and C++ benchmarks in $BUILD (after build)"
step_build_tests() {
    cmake --build "$BUILD" -j"$JOBS" --target test_gpu_ops test_gpu_fp8 test_gpu_serving test_gpu_static ipc_gpu_main \
        ipc_buffer_gpu_main ipc_pools_gpu_main step_graph_gpu_main ops_bench serving_bench fp8_bench
}

toolchain_stamp() {
    echo "root $ROOT"
    echo "python $(command -v "$PY")"
    "$PY" -c 'import sys, torch as t; print("python", sys.version.split()[0], "torch", t.__version__, t.version.cuda)'
    echo "nvcc $(command -v nvcc) $(nvcc --version 2>&1 | tail -n 1)"
    echo "c++ $(command -v "${CXX:-c++}") $("${CXX:-c++}" --version 2>&1 | head -n 1)"
    echo "cmake $(cmake --version | head -n 1); ninja $(ninja --version)"
}

define build_suite 420 "$BUILD for every GPU test: flatep._C, the test mains; a $BUILD configured elsewhere (another \
source path or toolchain: a stamp file) is deleted first; then fp8_bench, ops_bench, serving_bench (may fail)"
step_build_suite() {
    local stamp=$BUILD/.device_stamp want
    want=$(toolchain_stamp)
    if [[ ${DEVICE_CLEAN:-0} == 1 && -d $BUILD ]]; then
        echo "DEVICE_CLEAN=1: removing $BUILD"
        rm -rf "$BUILD"
    elif [[ -d $BUILD ]] && ! diff -q <(echo "$want") "$stamp" >/dev/null 2>&1; then
        # Not configured by this step with this source path and toolchain (e.g. copied from another machine): its
        # CMake cache and objects cannot be trusted.
        echo "$BUILD was not configured by build_suite with this source path and toolchain: removing it"
        [[ -f $stamp ]] && diff <(echo "$want") "$stamp"
        rm -rf "$BUILD"
    fi
    echo "$want"
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
        -DFLATEP_BUILD_TESTS=ON -DFLATEP_BUILD_TOOLS=OFF -DFLATEP_BUILD_PYTHON=ON \
        -DPython_EXECUTABLE="$(command -v "$PY")" || return 1
    echo "$want" >"$stamp"
    cmake --build "$BUILD" -j"$JOBS" --target test_gpu_ops test_gpu_fp8 test_gpu_serving test_gpu_static ipc_gpu_main \
        ipc_buffer_gpu_main ipc_pools_gpu_main step_graph_gpu_main flatep_python || return 1
    ls -l "$GPU_BIN"/test_gpu_ops "$GPU_BIN"/test_gpu_fp8 "$GPU_BIN"/test_gpu_serving "$GPU_BIN"/ipc_*_main \
        "$BUILD"/python/flatep/_C*.so
    # The benchmark drivers of the serving campaign; a failure here does not fail the build.
    cmake --build "$BUILD" -j"$JOBS" --target fp8_bench ops_bench serving_bench ||
        echo "build_suite: fp8_bench, ops_bench or serving_bench did not build"
}

define build_serving 240 "test_gpu_serving alone in $BUILD (after build): the serving and static cases' binary"
step_build_serving() { cmake --build "$BUILD" -j"$JOBS" --target test_gpu_serving; }

define build_moonep 240 "ops_bench, test_gpu_ops, flatep-plan-quality in $BUILD (configured without Python when absent)"
step_build_moonep() {
    if [[ ! -f $BUILD/build.ninja ]]; then
        cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATEP_CUDA=ON \
            -DCMAKE_CUDA_ARCHITECTURES=90a -DFLATEP_BUILD_TESTS=ON -DFLATEP_BUILD_TOOLS=OFF \
            -DFLATEP_BUILD_PYTHON=OFF || return 1
    else
        cmake "$BUILD" >/dev/null || return 1  # picks up new files and targets of a reused build folder
    fi
    cmake --build "$BUILD" -j"$JOBS" --target ops_bench test_gpu_ops flatep-plan-quality
}

define build_multi_gpu 450 "the multi-GPU targets: configure $BUILD when absent (CUDA, sm_90a, no host tools), build \
test_gpu_ops, the ipc mains and ep_bench_multi (when NCCL was found)"
step_build_multi_gpu() {
    if [[ ! -f $BUILD/build.ninja ]]; then
        cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATEP_CUDA=ON \
            -DCMAKE_CUDA_ARCHITECTURES=90a -DFLATEP_BUILD_TOOLS=OFF || return 1
    else
        cmake "$BUILD" || return 1  # a reused build folder: picks up new targets (ep_bench_multi)
    fi
    local wanted=(test_gpu_ops ipc_gpu_main ipc_buffer_gpu_main ipc_pools_gpu_main)
    if ninja -C "$BUILD" -t targets all | grep -q '^ep_bench_multi:'; then
        wanted+=(ep_bench_multi)
    else
        echo "ep_bench_multi is not a target of $BUILD (NCCL not found at configure time?)"
    fi
    cmake --build "$BUILD" -j"$JOBS" --target "${wanted[@]}"
}

# -- the GPU test suite --

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

define gpu_ops 300 "test_gpu_ops: every kernel bitwise against the CPU backend on virtual ranks"
step_gpu_ops() { "$GPU_BIN"/test_gpu_ops; }

define gpu_fp8 240 "test_gpu_fp8: FP8 dispatch (both input forms, both scale modes) and the FP8 rule, bitwise"
step_gpu_fp8() { "$GPU_BIN"/test_gpu_fp8; }

define gpu_serving 240 "test_gpu_serving: serving steps (B 0/1/4/epn, 4 planners, empty ranks, graphs) vs the CPU backend"
step_gpu_serving() { "$GPU_BIN"/test_gpu_serving; }

define gpu_static 120 "test_gpu_static: the static planner's GPU plans against the host planner (R 1..64)"
step_gpu_static() { "$GPU_BIN"/test_gpu_static; }

define static 420 "the static planner on the GPU: test_gpu_static, test_gpu_serving's static_* cases, its Python tests"
step_static() {
    "$GPU_BIN"/test_gpu_static || return 1
    local c
    for c in static_b4_graph static_b1_graph static_bepn_push static_b2_pad_rows_unweighted; do
        "$GPU_BIN"/test_gpu_serving --case "$c" || return 1
    done
    "$PY" -m pytest -q -rA -m cuda tests/python/test_gpu_static.py tests/python/test_gpu_graphs.py \
        tests/python/test_static_placement.py
}

define serving_quick 240 "test_gpu_serving --quick: serving steps (B slots, every planner, graphs) bitwise vs the CPU"
step_serving_quick() { "$GPU_BIN"/test_gpu_serving --quick; }

define ops_quick 240 "test_gpu_ops --quick: every small op case bitwise against the CPU backend"
step_ops_quick() { "$GPU_BIN"/test_gpu_ops --quick; }

define ops_prefill 90 "test_gpu_ops --case r8_moonep_s8192_e384_h7168_k8: the plan's general path at scale"
step_ops_prefill() { "$GPU_BIN"/test_gpu_ops --case r8_moonep_s8192_e384_h7168_k8; }

define ipc_gpu 150 "ipc_gpu_main 2 4: R processes sharing GPU 0 through CUDA VMM fds"
step_ipc_gpu() { "$GPU_BIN"/ipc_gpu_main 2 4; }

define ipc_buffer 240 "ipc_buffer_gpu_main 2 4 8: flatep::Buffer on device memory, R processes, bitwise vs the CPU"
step_ipc_buffer() { "$GPU_BIN"/ipc_buffer_gpu_main 2 4 8; }

define ipc_buffer4 90 "ipc_buffer_gpu_main 4: a CUDA Buffer on 4 processes, rank 3 with s = 0 (null pointers)"
step_ipc_buffer4() { "$GPU_BIN"/ipc_buffer_gpu_main 4; }

define ipc_pools 180 "ipc_pools_gpu_main: ExpertPools compute views, prefetch and reduce_grad on device memory"
step_ipc_pools() { "$GPU_BIN"/ipc_pools_gpu_main; }

define step_graph 180 "step_graph_gpu_main 2 4: a whole training step per rank process as one CUDA graph, 20 replays \
with new routing bitwise equal to the eager step"
step_step_graph() { "$GPU_BIN"/step_graph_gpu_main 2 4; }

define virtual_gpu 240 "tests/python/test_gpu_virtual.py -m cuda: a user's two-layer model on 4 virtual ranks in fresh \
interpreters (CUDA_MODULE_LOADING unset), graph replays bitwise, 30 create/destroy cycles flat"
step_virtual_gpu() {
    cuda_preflight || return 1
    # The test starts its own fresh interpreters without CUDA_MODULE_LOADING / CUDA_DEVICE_MAX_CONNECTIONS.
    "$PY" -m pytest tests/python/test_gpu_virtual.py -v -rs -s -m cuda -p no:cacheprovider --durations=5
}

# pytest_cuda_files [FILE...]: the cuda tests of these files (none: all of tests/python) but test_gpu_virtual.py.
pytest_cuda_files() {
    cuda_preflight || return 1
    # A spawned test that hangs fails on its own after 240 s (flatep.testing.spawn) instead of using up the step;
    # -v names every test as it ends, so a step killed at its limit still shows how far it got.
    FLATEP_SPAWN_TIMEOUT_S=${FLATEP_SPAWN_TIMEOUT_S:-240} "$PY" -m pytest "${@:-tests/python}" -v -rs -m cuda \
        -p no:cacheprovider --durations=15 --ignore=tests/python/test_gpu_virtual.py
}

# test_files_half 1|2 NAME: the test files of tests/python sorted by name (C locale), one a line: those whose name
# sorts before NAME (1), or the others (2).
test_files_half() {
    local LC_ALL=C f
    for f in tests/python/test_*.py; do
        if [[ $(basename "$f") < $2 ]]; then
            (($1 == 1)) && echo "$f"
        else
            (($1 == 2)) && echo "$f"
        fi
    done
    return 0
}

# pytest_cuda_half 1|2: pytest_cuda_files of test_files_half, split after test_gpu_zero_copy.py.
pytest_cuda_half() {
    local files
    mapfile -t files < <(test_files_half "$1" test_gpu_zz)
    pytest_cuda_files "${files[@]}"
}

define pytest_cuda 500 "python3 -m pytest tests/python -m cuda (but test_gpu_virtual.py): the Python tests on cuda:0"
step_pytest_cuda() { pytest_cuda_files; }

define pytest_cuda1 500 "pytest_cuda's first half: the test files up to test_gpu_zero_copy.py"
step_pytest_cuda1() { pytest_cuda_half 1; }

define pytest_cuda2 500 "pytest_cuda's second half: the test files after test_gpu_zero_copy.py"
step_pytest_cuda2() { pytest_cuda_half 2; }

define first_call 420 "tests/python/test_first_call.py -m cuda: README programs, each FlatEP's first call of its process"
step_first_call() { FLATEP_SPAWN_TIMEOUT_S=200 "$PY" -m pytest -q -rA -m cuda tests/python/test_first_call.py; }

define capture 180 "tests/python/test_first_call.py's capture cases on CUDA (virtual ranks: flatep.virtual.graph)"
step_capture() { FLATEP_SPAWN_TIMEOUT_S=150 "$PY" -m pytest -q -rA -m cuda tests/python/test_first_call.py -k capture; }

define train_cuda 180 "examples/train_moe.py --device cuda: 4 processes on the GPU, slack mode"
step_train_cuda() {
    "$PY" examples/train_moe.py --device cuda --ranks 4 --steps 8 --tokens 64 --experts 16 --capacity-factor 1.25
}

define soak 300 "benchmarks/soak/gpu_soak.py as a user runs it (FLATEP_TIMEOUT_S, CUDA_MODULE_LOADING unset): 3000 steps \
on 4 virtual ranks, 1000 on 2 processes; replays bitwise, S*K rows a step, flat memory (soak.csv)"
step_soak() {
    env -u FLATEP_TIMEOUT_S -u CUDA_MODULE_LOADING "$PY" benchmarks/soak/gpu_soak.py --mode virtual --ranks 4 \
        --steps 3000 --csv "$STEP_OUT/soak.csv" || return 1
    env -u FLATEP_TIMEOUT_S -u CUDA_MODULE_LOADING "$PY" benchmarks/soak/gpu_soak.py --mode processes --ranks 2 \
        --steps 1000 --csv "$STEP_OUT/soak.csv"
}

define pytest_cpu 300 "python3 -m pytest tests/python -m 'not cuda': the CPU tests under this torch"
step_pytest_cpu() { "$PY" -m pytest tests/python -q -rs -m "not cuda" -p no:cacheprovider; }

# pytest_cpu_half 1|2: the CPU tests of test_files_half, split before test_moe_*.py (about half of them each side).
pytest_cpu_half() {
    local files
    mapfile -t files < <(test_files_half "$1" test_moe)
    "$PY" -m pytest "${files[@]}" -q -rs -m "not cuda" -p no:cacheprovider
}

define pytest_cpu1 420 "pytest_cpu's first half: the test files before test_moe_*.py"
step_pytest_cpu1() { pytest_cpu_half 1; }

define pytest_cpu2 420 "pytest_cpu's second half: test_moe_*.py and the files after it"
step_pytest_cpu2() { pytest_cpu_half 2; }

define step_graph_repeat 600 "the in-processes whole-step graph test STEP_GRAPH_REPEAT times (3) under \
CUDA_DEVICE_MAX_CONNECTIONS 32 and 8, from pytest and from a plain python3 parent; the first run's graphs and forks"
step_step_graph_repeat() {
    cuda_preflight || return 1
    local n=${STEP_GRAPH_REPEAT:-3} failed=0 c i dump log f
    for c in 32 8; do
        for ((i = 1; i <= n; i++)); do
            dump=""
            if ((i == 1)); then
                dump=$STEP_OUT/graphs_$c
                mkdir -p "$dump"
            fi
            log=$STEP_OUT/step_graph_repeat_${c}_$i.log
            if CUDA_DEVICE_MAX_CONNECTIONS=$c FLATEP_STEP_GRAPH_DUMP=$dump FLATEP_SPAWN_TIMEOUT_S=120 "$PY" -m pytest \
                tests/python/test_gpu_step_graph.py -q -vv -m cuda -p no:cacheprovider -k in_processes >"$log" 2>&1; then
                echo "CUDA_DEVICE_MAX_CONNECTIONS=$c run $i: pass"
            else
                echo "CUDA_DEVICE_MAX_CONNECTIONS=$c run $i: FAIL ($log)"
                grep -E "^E  " "$log" | cut -c1-2000 | head -n 4
                failed=1
            fi
            log=$STEP_OUT/step_graph_plain_${c}_$i.log
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

# -- serving and decode --

define serving_pytest 200 "the cuda cases of test_gpu_serving.py, test_serving_processes.py and test_example.py's \
serve_moe.py (nn.MoE serving and owner on CUDA virtual ranks and on processes, graph replay)"
step_serving_pytest() {
    "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/python/test_gpu_serving.py \
        tests/python/test_serving_processes.py tests/python/test_example.py -k "serving or serve or equals or replays"
}

define ffn_rows 120 "the cuda cases of test_gpu_ffn_rows.py and test_grouped.py: the FFN's bounded kernels vs torch ops"
step_ffn_rows() {
    "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/python/test_gpu_ffn_rows.py tests/python/test_grouped.py
}

define quickstart 60 "examples/quickstart.py --device cuda (the README's quick start)"
step_quickstart() { "$PY" examples/quickstart.py --device cuda; }

define serving_bench_deepep 180 "serving_bench --preset deepep: serving and decode steps, graph-replayed (CSV)"
step_serving_bench_deepep() {
    "$BUILD"/benchmarks/serving_bench --preset deepep --csv "$STEP_OUT/serving_bench_deepep.csv"
}

define serving_bench_k3 180 "serving_bench --preset k3 (CSV)"
step_serving_bench_k3() { "$BUILD"/benchmarks/serving_bench --preset k3 --csv "$STEP_OUT/serving_bench_k3.csv"; }

define serving_bench_deepep_b4 200 "serving_bench --preset deepep --batch 4: four calls of each op a graph replay"
step_serving_bench_deepep_b4() {
    "$BUILD"/benchmarks/serving_bench --preset deepep --batch 4 --csv "$STEP_OUT/serving_bench_deepep_batch4.csv"
}

define serving_bench_k3_b4 200 "serving_bench --preset k3 --batch 4"
step_serving_bench_k3_b4() {
    "$BUILD"/benchmarks/serving_bench --preset k3 --batch 4 --csv "$STEP_OUT/serving_bench_k3_batch4.csv"
}

define serving_step_deepep 150 "benchmarks/serving/serving_step.py --preset deepep --ffn 1536: nn.MoE serving step with the \
expert GEMM, per-rank CUDA graphs (F=1536: B=epn, the training layout, does not fit 8 ranks at F=2048)"
step_serving_step_deepep() {
    "$PY" benchmarks/serving/serving_step.py --preset deepep --ffn 1536 --iters 10 --csv "$STEP_OUT/serving_step_deepep.csv"
}

define serving_step_k3 150 "benchmarks/serving/serving_step.py --preset k3 (F=512)"
step_serving_step_k3() { "$PY" benchmarks/serving/serving_step.py --preset k3 --iters 10 --csv "$STEP_OUT/serving_step_k3.csv"; }

define ops_k3 60 "ops_bench --preset k3 --ffn 512 --maxvio 1,20 --iters 15: every op at Kimi K3's shape (CSV)"
step_ops_k3() {
    "$BUILD"/benchmarks/ops_bench --preset k3 --ffn 512 --maxvio 1,20 --iters 15 \
        --csv "$STEP_OUT/ops_k3_h200_8virtual.csv"
}

decode() {
    "$PY" benchmarks/serving/serving_step.py --preset "$1" --decode-sweep 1,16,128,512 --iters 10 --csv "$RESULTS/decode_$1.csv"
}
define decode_deepep 150 "benchmarks/serving/serving_step.py --preset deepep --decode-sweep: owner against balanced B=4"
step_decode_deepep() { decode deepep; }
define decode_k3model 150 "the same at Kimi K3's model shape (H=3584, K=16, E=896)"
step_decode_k3model() { decode k3model; }
define decode_k3 150 "the same at the k3 preset (H=7168, K=8, E=896, F=512)"
step_decode_k3() { decode k3; }

define probe 90 "benchmarks/probes/host_block_probe.py: which host calls wait for another stream's running kernel"
step_probe() { "$PY" benchmarks/probes/host_block_probe.py; }

define side_stream 90 "test_streams.py's side-stream test alone, the first CUDA test of its process"
step_side_stream() {
    "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/python/test_streams.py -k side_stream_with_events
}

define eplb_real 300 "benchmarks/serving/eplb_compare.py --time on the training run's routing (layer 3, 150 steps)"
step_eplb_real() {
    "$PY" benchmarks/serving/eplb_compare.py --trace benchmarks/results/train_e2e_h100/trace_flatep.npz --layer 3 --steps 150 \
        --time --out "$RESULTS/eplb_real"
}

# -- end-to-end training --

define e2e_smoke 100 "benchmarks/training/train_e2e.py --preset tiny on the GPU, 4 virtual ranks, 10 steps"
step_e2e_smoke() {
    "$PY" benchmarks/training/train_e2e.py --preset tiny --device cuda --ranks 4 --experts 16 --steps 10 --no-plot \
        --out "$RESULTS/e2e_smoke"
}

define e2e 480 "benchmarks/training/train_e2e.py --preset h200: FlatEP against the all-to-all baseline, 8 virtual ranks, 300 steps"
step_e2e() { "$PY" benchmarks/training/train_e2e.py --preset h200 --out "$RESULTS/e2e"; }

define e2e_processes 420 "benchmarks/training/train_e2e.py --preset h200 --processes: one process per rank on the GPU, 40 steps"
step_e2e_processes() {
    "$PY" benchmarks/training/train_e2e.py --preset h200 --processes --ranks 4 --steps 40 --memory-every 5 \
        --out "$RESULTS/e2e_processes"
}

# -- the MoE layer against the all-to-all baseline --

layer_run() { CUDA_MODULE_LOADING=EAGER "$PY" "$@" --out "$STEP_OUT"; }
define layer_virtual_moonep 300 "benchmarks/layer/moe_layer_virtual.py --gpus 2 --config moonep: R=8 virtual ranks on two \
GPUs, maxvio 0.2 1 10 20 (CSV, PNG)"
step_layer_virtual_moonep() {
    layer_run benchmarks/layer/moe_layer_virtual.py --gpus 2 --config moonep --maxvio 0.2 1 10 20 --iters 5 --warmup 2
}
define layer_virtual_deepep 200 "benchmarks/layer/moe_layer_virtual.py --gpus 2 --config deepep"
step_layer_virtual_deepep() { layer_run benchmarks/layer/moe_layer_virtual.py --gpus 2 --config deepep --iters 5 --warmup 2; }
define layer_r2_moonep 200 "benchmarks/layer/moe_layer.py --ranks 2 --config moonep --experts 96: one process per GPU"
step_layer_r2_moonep() {
    layer_run benchmarks/layer/moe_layer.py --ranks 2 --config moonep --experts 96 --maxvio 0.2 1 5 9 --iters 10 --warmup 3
}
define layer_r2_deepep 150 "benchmarks/layer/moe_layer.py --ranks 2 --config deepep --experts 64"
step_layer_r2_deepep() { layer_run benchmarks/layer/moe_layer.py --ranks 2 --config deepep --experts 64 --iters 10 --warmup 3; }

# -- the MoE layer phase by phase on one GPU --

define layer_ops_bwd 90 "test_gpu_ops' cases with a backward (combine_grad, write_grads walks) bitwise vs the CPU"
step_layer_ops_bwd() {
    local c rc=0
    for c in r4_graph_fwd_bwd r8_graph_fwd_bwd_slack r4_bwd_h264_odd_grads r4_decode_h7168_row_slices \
        r4_bwd_write_grads_walk_vec r4_bwd_write_grads_walk_scalar; do
        "$GPU_BIN"/test_gpu_ops --case "$c" || rc=1
    done
    return "$rc"
}

define layer_pytest 120 "the cuda cases of test_gpu_combine_backward.py and test_grouped.py"
step_layer_pytest() {
    "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/python/test_gpu_combine_backward.py tests/python/test_grouped.py
}

define gemm_align 150 "benchmarks/probes/grouped_mm_align.py: torch._grouped_mm over FlatEP's groups at align 16..128, the \
[E+B] serving view against the compact one; prints the align to choose (CSV)"
step_gemm_align() { "$PY" benchmarks/probes/grouped_mm_align.py --out "$STEP_OUT" --tag h200; }

# The align gemm_align chose in this run (its log), 128 without one.
chosen_align() {
    local a
    a=$(grep -oP '^chosen align \K[0-9]+' "$LOGS/gemm_align.log" 2>/dev/null || true)
    echo "${a:-128}"
}
layer_virtual() { "$PY" benchmarks/layer/moe_layer_virtual.py --gpus 1 --config moonep --out "$STEP_OUT" --no-plot "$@"; }

define layer_f512 170 "benchmarks/layer/moe_layer_virtual.py --gpus 1 --ffn 512: R=8 virtual ranks on one GPU, maxvio 0.2 1 \
10 20, every phase and memory per rank, a profiled baseline step at maxvio 20; FlatEP at gemm_align's align (CSV)"
step_layer_f512() {
    local align
    align=$(chosen_align)
    echo "FlatEP at align $align"
    layer_virtual --ffn 512 --maxvio 0.2 1 10 20 --iters 6 --warmup 2 --align "$align" \
        --profile-baseline "$STEP_OUT/profile" --profile-maxvio 20 --tag h200-virtual
}

define layer_f512_before 100 "the same at maxvio 0.2 and 20 with the earlier choices as flags (autograd unpermute, \
capped local ops, combine backward copied, gradients overwritten, align 128): the A/B against layer_f512 (CSV)"
step_layer_f512_before() {
    layer_virtual --ffn 512 --maxvio 0.2 20 --iters 2 --warmup 2 --baseline-unpermute autograd \
        --flatep-local-ops capped --flatep-combine-bwd copy --wgrad-mode overwrite --align 128 \
        --profile-baseline "$STEP_OUT/profile" --tag h200-virtual-before48
}

define layer_f2048 150 "benchmarks/layer/moe_layer_virtual.py --ffn 2048 --ranks 4 --experts 192: MoonEP's per-rank shape \
with 4 virtual ranks (8 do not fit one GPU), maxvio 0.2 1 10 20 (CSV)"
step_layer_f2048() {
    layer_virtual --ffn 2048 --ranks 4 --experts 192 --maxvio 0.2 1 10 20 --iters 4 --warmup 2 \
        --align "$(chosen_align)" --tag h200-virtual-r4
}

# summary_STEP LOG: headline lines of a step, appended to the summary after it.
summary_layer_f512() { sed -n '/layer forward+backward/,/^equality/p' "$1"; }
summary_layer_f512_before() { summary_layer_f512 "$1"; }
summary_layer_f2048() { summary_layer_f512 "$1"; }
summary_layer_virtual_moonep() { grep -A8 "layer forward+backward" "$1" | head -8; }
summary_layer_virtual_deepep() { summary_layer_virtual_moonep "$1"; }
summary_layer_r2_moonep() { summary_layer_virtual_moonep "$1"; }
summary_layer_r2_deepep() { summary_layer_virtual_moonep "$1"; }
summary_gemm_align() {
    grep -E -A2 "correctness probe" "$1"
    grep -E "serving|^flatep_2epn|^chosen align" "$1"
}

# -- the planner and the data plane at MoonEP's and Kimi K3's shapes --

# The routing sigmas of the maxvio targets: benchmarks/results/sigma_cache.csv, copied once a run (a missing one is
# bisected on the host and appended to the copy).
sigmas() {
    local s=$RESULTS/sigma_cache.csv
    [[ -f $s ]] || cp benchmarks/results/sigma_cache.csv "$s"
    echo "$s"
}
ops_bench() { "$BUILD"/benchmarks/ops_bench "$@" --sigma-cache "$(sigmas)"; }

define planner_sweep 120 "test_gpu_ops --case planner_sweep: GPU plans bitwise the host planner's (R 8..64, E=896, K 8/16)"
step_planner_sweep() { "$GPU_BIN"/test_gpu_ops --case planner_sweep; }

define planner_sweep_bench 150 "ops_bench --planner-only --planner-profile --preset moonep-sweep: the GPU planner \
(graph-timed) at every shape of MoonEP's sweep, maxvio 1/5/20, against the greedy (CSV)"
step_planner_sweep_bench() {
    ops_bench --planner-only --planner-profile --preset moonep-sweep --seeds 1 --iters 20 \
        --csv "$STEP_OUT/planner_moonep_sweep.csv"
}

define planner_sweep_bench_shared 200 "the same with FLATEP_PLANNER_PLACEMENT=shared: the A/B against the default \
placement (CSV)"
step_planner_sweep_bench_shared() {
    FLATEP_PLANNER_PLACEMENT=shared ops_bench --planner-only --preset moonep-sweep --seeds 1 --iters 20 \
        --csv "$STEP_OUT/planner_moonep_sweep_shared.csv"
}

define planner_reference 60 "ops_bench --planner-only --preset moonep,deepep: the planner at the reference configs (CSV)"
step_planner_reference() {
    ops_bench --planner-only --preset moonep,deepep --seeds 1 --iters 20 --csv "$STEP_OUT/planner_reference.csv"
}

define data_plane_k3 150 "ops_bench --preset k3 --ffn 512: every op at R=8 virtual ranks, K 8/16, maxvio 1/5/20, \
against the copy bandwidth (CSV)"
step_data_plane_k3() { ops_bench --preset k3 --ffn 512 --iters 20 --warmup 3 --csv "$STEP_OUT/ops_k3.csv"; }

define data_plane_k3_sm33 150 "the same with --num-sms 66 (66 blocks a rank, a quarter of the GPU) (CSV)"
step_data_plane_k3_sm33() {
    ops_bench --preset k3 --ffn 512 --iters 20 --warmup 3 --num-sms 66 --csv "$STEP_OUT/ops_k3_sm33.csv"
}

define s1024_k3 60 "the same at K=8, maxvio 1, s=1024 and s=8192 tokens a call (CSV)"
step_s1024_k3() {
    ops_bench --preset k3 --topk 8 --maxvio 1 --ffn 512 --tokens-per-call 1024,8192 --iters 20 --warmup 3 \
        --csv "$STEP_OUT/ops_k3_s1024.csv"
}

define host_check 90 "flatep-plan-quality --preset moonep-sweep: every host plan valid, the balanced never worse than \
the greedy (CSV)"
step_host_check() {
    "$BUILD"/benchmarks/flatep-plan-quality --preset moonep-sweep --seeds 1 --factors 1 --iters 3 --bisection-ranks 8 \
        --sigma-seed 42 --sigma-cache "$(sigmas)" --csv "$STEP_OUT/plan_quality_moonep_sweep.csv"
}

# -- several GPUs of one host (NVLink multicast off; every kernel loaded at context creation) --

multi_env() { export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_MODULE_LOADING=EAGER; }
# need_gpus N: prints SKIP (the step's result) and fails when fewer GPUs are visible.
need_gpus() {
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    ((n >= $1)) && return 0
    echo "SKIP: $n GPU(s), the step needs $1"
    return 1
}

define r2_gpu_per_rank 90 "test_gpu_ops --case r2_gpu_per_rank: local transport, one rank per GPU (2 GPUs)"
step_r2_gpu_per_rank() {
    need_gpus 2 || return 0
    multi_env
    local text rc=0
    text=$("$GPU_BIN"/test_gpu_ops --case r2_gpu_per_rank 2>&1) || rc=$?
    echo "$text"
    # The case exists only where >= 2 GPUs are visible: its PASS line proves it ran.
    ((rc == 0)) && grep -q '^PASS r2_gpu_per_rank' <<<"$text"
}

define ipc_gpu_per_rank 60 "ipc_gpu_main --gpu-per-rank 2: one process per GPU over the ipc transport"
step_ipc_gpu_per_rank() { need_gpus 2 || return 0; multi_env; "$GPU_BIN"/ipc_gpu_main --gpu-per-rank 2; }
define ipc_buffer_gpu_per_rank 60 "ipc_buffer_gpu_main --gpu-per-rank 2"
step_ipc_buffer_gpu_per_rank() { need_gpus 2 || return 0; multi_env; "$GPU_BIN"/ipc_buffer_gpu_main --gpu-per-rank 2; }
define ipc_pools_gpu_per_rank 60 "ipc_pools_gpu_main --gpu-per-rank 2"
step_ipc_pools_gpu_per_rank() { need_gpus 2 || return 0; multi_env; "$GPU_BIN"/ipc_pools_gpu_main --gpu-per-rank 2; }

define ep_bench_multi 240 "ep_bench_multi: FlatEP against NCCL's all-to-all, DeepEP and MoonEP configs, one process \
per GPU (CSV; BENCH_ARGS: more flags)"
step_ep_bench_multi() {
    need_gpus 2 || return 0
    multi_env
    if [[ ! -x $BUILD/benchmarks/ep_bench_multi ]]; then
        echo "ep_bench_multi not built (NCCL not found)"
        return 1
    fi
    # Its fork deadline ends before the step's time limit.
    local deadline=$((STEP_S - 15))
    # shellcheck disable=SC2086  # BENCH_ARGS: several words on purpose
    "$BUILD"/benchmarks/ep_bench_multi --csv "$STEP_OUT/ep_bench_multi.csv" \
        --deadline "$((deadline > 10 ? deadline : 10))" ${BENCH_ARGS:-}
}
summary_ep_bench_multi() { grep -v '^    rank' "$1" | tail -n 60; }

# ---- campaigns: named lists of steps, each one device call ----
declare -A CAMPAIGN=(
    [suite]="build_suite gpu_ops gpu_fp8 gpu_serving gpu_static ipc_gpu ipc_buffer ipc_pools step_graph virtual_gpu first_call pytest_cuda train_cuda soak pytest_cpu"
    [suite_kernels]="build_suite gpu_ops gpu_fp8 gpu_serving gpu_static ipc_gpu ipc_buffer ipc_pools step_graph virtual_gpu"
    [suite_pytest1]="build_suite pytest_cuda1"
    [suite_pytest2]="build_suite pytest_cuda2"
    [suite_rest]="build_suite first_call train_cuda soak pytest_cpu"
    [step_graph_flaky]="build_suite step_graph_repeat"
    [serving]="build_suite gpu_serving serving_pytest serving_bench_deepep serving_step_deepep ipc_buffer4 quickstart serving_bench_k3 serving_step_k3 ops_k3"
    [serving_more]="build_suite ffn_rows ops_quick ops_prefill gpu_fp8 serving_bench_deepep_b4 serving_bench_k3_b4 probe side_stream"
    [decode]="build decode_deepep decode_k3 decode_k3model"
    [first_calls]="build probe first_call capture"
    [static_planner]="build build_serving static serving_quick"
    [train]="build e2e_smoke e2e"
    [layer]="build_suite layer_virtual_moonep layer_virtual_deepep layer_r2_moonep layer_r2_deepep"
    [layer48]="build_suite layer_ops_bwd layer_pytest gemm_align layer_f512 layer_f512_before layer_f2048"
    [moonep]="build_moonep planner_sweep planner_sweep_bench planner_sweep_bench_shared planner_reference data_plane_k3 data_plane_k3_sm33 s1024_k3 host_check"
    [multi_gpu]="build_multi_gpu r2_gpu_per_rank ipc_gpu_per_rank ipc_buffer_gpu_per_rank ipc_pools_gpu_per_rank ep_bench_multi"
)
CAMPAIGN_ORDER=(suite suite_kernels suite_pytest1 suite_pytest2 suite_rest step_graph_flaky serving serving_more decode
    first_calls static_planner train layer layer48 moonep multi_gpu)

usage() {
    local s c
    echo "usage: scripts/device.sh [--dry-run] STEP|CAMPAIGN ... | --list"
    echo "steps (time limit in s):"
    for s in "${ORDER[@]}"; do printf '  %-27s %4s  %s\n' "$s" "${STEP_LIMIT[$s]}" "${STEP_HELP[$s]}"; done
    echo "campaigns:"
    for c in "${CAMPAIGN_ORDER[@]}"; do printf '  %-17s %s\n' "$c" "${CAMPAIGN[$c]}"; done
}

steps=()
dry=0
add_step() {
    local s
    for s in "${steps[@]+"${steps[@]}"}"; do [[ $s == "$1" ]] && return; done
    steps+=("$1")
}
for arg in "$@"; do
    if [[ $arg == --list ]]; then
        usage
        exit 0
    elif [[ $arg == --dry-run ]]; then
        dry=1
    elif [[ -n ${CAMPAIGN[$arg]:-} ]]; then
        read -ra more <<<"${CAMPAIGN[$arg]}"
        for s in "${more[@]}"; do add_step "$s"; done
    elif [[ -n ${STEP_HELP[$arg]:-} ]]; then
        add_step "$arg"
    else
        echo "device.sh: unknown step or campaign '$arg' (--list shows them)" >&2
        exit 2
    fi
done
((${#steps[@]})) || {
    usage >&2
    exit 2
}

if ((dry)); then
    total=0
    for step in "${steps[@]}"; do
        echo "== $step (limit ${STEP_LIMIT[$step]} s): ${STEP_HELP[$step]}"
        declare -f "step_$step" | tail -n +3 | sed '$d'
        total=$((total + STEP_LIMIT[$step]))
    done
    echo "device.sh --dry-run: ${#steps[@]} steps, their limits sum to $total s (the deadline: $DEADLINE_S s)"
    exit 0
fi

# ---- the run ----
rm -rf "$WORK"
mkdir -p "$LOGS" "$RESULTS" "$OUT"
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
fi
export NCCL_NVLS_ENABLE=0
export FLATEP_TIMEOUT_S=${FLATEP_TIMEOUT_S:-60}
export FLATEP_BUILD_DIR=$BUILD
export PYTHONPATH="$ROOT/python:$ROOT/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export ROOT PY BUILD JOBS RESULTS LOGS GPU_BIN
if [[ ${DEVICE_COVERAGE:-0} == 1 ]]; then
    # coverage.py in every Python process of the steps (as scripts/coverage_ci.sh does on the CPU); at the end its
    # branch report, each file stamped with its sha256, is results/coverage/python_cuda.json: coverage_report.py
    # --python-device merges it into the CPU report for the files whose text is still the same.
    COV=$WORK/coverage
    mkdir -p "$COV/data" "$COV/site"
    printf '[run]\nbranch = True\nparallel = True\nsigterm = True\nsource = %s/python/flatep\ndata_file = %s\n%s\n' \
        "$ROOT" "$COV/data/.coverage" "concurrency = thread,multiprocessing" >"$COV/coveragerc"
    printf 'import coverage\ncoverage.process_startup()\n' >"$COV/site/sitecustomize.py"
    export COVERAGE_PROCESS_START=$COV/coveragerc PYTHONPATH="$COV/site:$PYTHONPATH"
fi
SUMMARY=$LOGS/summary.txt
FAILED=0
{
    echo "# device.sh $(date -u +%FT%TZ) at $ROOT; steps: ${steps[*]}"
    echo "# CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-(unset)} NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" \
        "FLATEP_TIMEOUT_S=$FLATEP_TIMEOUT_S PYTHONPATH=$PYTHONPATH python: $(command -v "$PY")"
    git log -1 --format='# commit %H %s' 2>/dev/null
    git status --short 2>/dev/null | head -n 40
    nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv
    nvidia-smi topo -m
    nvcc --version | tail -n 2
    cmake --version | head -n 1
} >"$LOGS/env.log" 2>&1

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
    mkdir -p "$RESULTS/$step"
    t0=$SECONDS
    echo "==> $step (limit $limit s)"
    STEP_OUT=$RESULTS/$step STEP_S=$limit timeout --kill-after=10 "$limit" bash -c "$(declare -f); step_$step" >"$log" 2>&1
    rc=$?
    if ((rc == 0)) && grep -qE "^SKIP|[0-9]+ skipped" "$log" && ! grep -qE "[0-9]+ passed" "$log"; then
        result=SKIP
        FAILED=1
    elif ((rc == 0)); then
        result=PASS
    elif ((rc == 124 || rc == 137)); then
        result="FAIL (time limit $limit s)"
        FAILED=1
    else
        result="FAIL rc=$rc"
        FAILED=1
    fi
    echo "$result $step ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
    if [[ $result != PASS ]] || ! declare -F "summary_$step" >/dev/null; then
        tail -n 25 "$log"
    fi
    if declare -F "summary_$step" >/dev/null; then
        "summary_$step" "$log" | tee -a "$SUMMARY"
    fi
done
echo "device.sh: $((SECONDS - START)) s" | tee -a "$SUMMARY"
if [[ -n ${COV:-} ]]; then
    unset COVERAGE_PROCESS_START
    mkdir -p "$RESULTS/coverage"
    { "$PY" -m coverage combine --rcfile="$COV/coveragerc" "$COV/data" &&
        "$PY" -m coverage json --rcfile="$COV/coveragerc" -o "$COV/python.json" &&
        "$PY" scripts/coverage_report.py --stamp "$COV/python.json" --out "$RESULTS/coverage/python_cuda.json"; } \
        >"$LOGS/coverage.log" 2>&1
    echo "coverage: $(tail -n 1 "$LOGS/coverage.log")" | tee -a "$SUMMARY"
fi
while IFS= read -r trace; do
    rel=${trace#"$RESULTS"/}
    cp "$trace" "$OUT/${rel//\//_}"
done < <(find "$RESULTS" -name '*.npz')
tar czf "$OUT/results.tgz" -C "$WORK" --exclude='*.npz' logs results 2>/dev/null
exit "$FAILED"
