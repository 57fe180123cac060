#!/usr/bin/env bash
# Multi-GPU run on the device machine (2 H200s or more; nvcc, cmake, ninja, NCCL; no GoogleTest, no network):
# builds the GPU targets in build-cuda (reused when configured; else configured like scripts/setup.sh's build, CUDA
# on, sm_90a), then
#   (a) test_gpu_ops --case r2_gpu_per_rank       local transport, one rank per GPU, against the CPU backend
#   (b) ipc_gpu_main / ipc_buffer_gpu_main / ipc_pools_gpu_main --gpu-per-rank 2   one process per GPU over ipc
#   (c) ep_bench_multi                             FlatEP vs NCCL all-to-all, DeepEP and MoonEP configs, CSV
#   (d) a PASS/FAIL table; the exit status is 1 when any step failed or skipped (on this machine a step that finds
#       fewer than 2 GPUs is a failure too).
# Every step runs under `timeout`, and the steps share one time budget (BUDGET_S, default 450 s including the build)
# so the whole script ends within 8 minutes. Logs and the CSV go to ${OUT:-/tmp/out}.
#
#   scripts/device_multi_gpu.sh            (env: OUT, BUDGET_S, JOBS, BUILD_DIR, BENCH_ARGS)
# shellcheck disable=SC2317  # the steps' functions are invoked indirectly (bash -c NAME)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
fi
out="${OUT:-/tmp/out}"
logs="$out/logs"
mkdir -p "$logs"
build_dir="${BUILD_DIR:-build-cuda}"
jobs="${JOBS:-32}"
budget_s="${BUDGET_S:-450}"
start_s=$SECONDS

# Never NVLink multicast (design §7: it can take a shared host's GPUs down); load every kernel at context creation.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_MODULE_LOADING=EAGER

names=()
results=()
seconds=()

# step NAME MAX_SECONDS COMMAND...: runs COMMAND under timeout (the smaller of MAX_SECONDS and what is left of the
# budget; the whole process group is killed), logs to $logs/NAME.log, records PASS / FAIL / TIMEOUT, SKIP (exit 0
# but a line starting with SKIP: no usable GPU) or NO-TIME (the budget is spent).
step() {
    local name="$1" max_s="$2"
    shift 2
    local left=$((budget_s - (SECONDS - start_s) - 5))
    local limit=$((max_s < left ? max_s : left))
    local log="$logs/$name.log"
    names+=("$name")
    if ((limit < 10)); then
        echo "== $name: NO-TIME (budget of ${budget_s}s spent)"
        results+=("NO-TIME")
        seconds+=(0)
        return 1
    fi
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc=0
    timeout -k 10 "$limit" "$@" >"$log" 2>&1 || rc=$?
    local dt=$((SECONDS - t0))
    seconds+=("$dt")
    if ((rc == 0)) && grep -q '^SKIP' "$log"; then
        results+=("SKIP")
        rc=1
    elif ((rc == 0)); then
        results+=("PASS")
    elif ((rc == 124 || rc == 137)); then
        results+=("TIMEOUT")
    else
        results+=("FAIL($rc)")
    fi
    echo "   ${results[-1]} in ${dt}s (log $log)"
    if ((rc != 0)); then
        tail -n 25 "$log" | sed 's/^/   | /'
    fi
    return "$rc"
}

skip() {
    names+=("$1")
    results+=("SKIP")
    seconds+=(0)
    echo "== $1: SKIP ($2)"
}

num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
{
    nvidia-smi -L
    nvidia-smi topo -m
    nvcc --version | tail -n 2
    cmake --version | head -n 1
} >"$logs/machine.log" 2>&1
echo "device_multi_gpu: $num_gpus GPU(s); logs in $logs"
cat "$logs/machine.log"

bin="$build_dir/tests/gpu"
bench="$build_dir/benchmarks/ep_bench_multi"

# The steps' functions run in `timeout bash -c NAME`: exported with the variables they read.
# A configured build-cuda is reused as it is (its cache keeps its options); a new one is configured like
# scripts/setup.sh's build with CUDA required, for Hopper (sm_90a), without the host tools.
configure() {
    if [[ ! -f "$build_dir/build.ninja" ]]; then
        cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATEP_CUDA=ON \
            -DCMAKE_CUDA_ARCHITECTURES=90a -DFLATEP_BUILD_TOOLS=OFF
    else
        cmake "$build_dir" # a reused build folder: picks up new targets (ep_bench_multi)
    fi
}
build() {
    local wanted=(test_gpu_ops ipc_gpu_main ipc_buffer_gpu_main ipc_pools_gpu_main)
    if ninja -C "$build_dir" -t targets all | grep -q '^ep_bench_multi:'; then
        wanted+=(ep_bench_multi)
    else
        echo "ep_bench_multi is not a target of $build_dir (NCCL not found at configure time?)"
    fi
    cmake --build "$build_dir" -j"$jobs" --target "${wanted[@]}"
}
# The case exists only where >= 2 GPUs are visible: its PASS line proves it ran.
test_gpu_ops_r2() {
    local text rc=0
    text=$("$bin/test_gpu_ops" --case r2_gpu_per_rank 2>&1) || rc=$?
    echo "$text"
    ((rc == 0)) && grep -q '^PASS r2_gpu_per_rank' <<<"$text"
}
export build_dir jobs bin
export -f configure build test_gpu_ops_r2

built=0
if step configure 120 bash -c configure && step build 330 bash -c build; then
    built=1
fi

if ((built == 0)); then
    skip a_test_gpu_ops_r2_gpu_per_rank "build failed"
    skip b_ipc_gpu_per_rank "build failed"
    skip c_ep_bench_multi "build failed"
elif ((num_gpus < 2)); then
    skip a_test_gpu_ops_r2_gpu_per_rank "$num_gpus GPU(s)"
    skip b_ipc_gpu_per_rank "$num_gpus GPU(s)"
    skip c_ep_bench_multi "$num_gpus GPU(s)"
else
    # (a) local transport, one rank per GPU.
    step a_test_gpu_ops_r2_gpu_per_rank 90 bash -c test_gpu_ops_r2
    # (b) one process per GPU over the ipc transport.
    step b1_ipc_gpu_main_gpu_per_rank 60 "$bin/ipc_gpu_main" --gpu-per-rank 2
    step b2_ipc_buffer_gpu_main_gpu_per_rank 60 "$bin/ipc_buffer_gpu_main" --gpu-per-rank 2
    step b3_ipc_pools_gpu_main_gpu_per_rank 60 "$bin/ipc_pools_gpu_main" --gpu-per-rank 2
    # (c) FlatEP vs NCCL, both configs, CSV in $OUT. Its fork deadline ends before the step's timeout.
    if [[ -x "$bench" ]]; then
        bench_max_s=240
        left=$((budget_s - (SECONDS - start_s) - 5))
        deadline=$(((left < bench_max_s ? left : bench_max_s) - 15))
        # shellcheck disable=SC2086  # BENCH_ARGS: several words on purpose
        step c_ep_bench_multi "$bench_max_s" "$bench" --csv "$out/ep_bench_multi.csv" \
            --deadline "$((deadline > 10 ? deadline : 10))" ${BENCH_ARGS:-}
        grep -v '^    rank' "$logs/c_ep_bench_multi.log" | tail -n 60
    else
        skip c_ep_bench_multi "not built (NCCL not found)"
        results[-1]="FAIL(not built)"
    fi
fi

# (d) the table.
echo
printf '%-40s %-14s %6s\n' step result seconds
failed=0
for i in "${!names[@]}"; do
    printf '%-40s %-14s %6s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}"
    [[ ${results[$i]} == PASS ]] || failed=1
done
printf '%-40s %-14s %6s\n' total "$([[ $failed == 0 ]] && echo PASS || echo FAIL)" "$((SECONDS - start_s))"
exit "$failed"
