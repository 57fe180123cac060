#!/usr/bin/env bash
# Issue 22 on one H200: FlatEP where MoonEP measures itself (E=896, K 8 and 16, R up to 64), in about 5 minutes,
# CSVs and logs in $OUT:
#
#   planner_sweep   test_gpu_ops --case planner_sweep: GPU plans bitwise the host planner's, MoonEP's sweep shapes
#                   included (R 8..64, E=896, K 8/16)                                           planner_sweep.log
#   planner_sweep_bench
#                   ops_bench --planner-only --planner-profile --preset moonep-sweep --seeds 1: the GPU planner
#                   (graph-timed) at every shape of the sweep (S=8192, E=896, H 3584/7168, K 8/16, R 8/16/32/64)
#                   and maxvio 1/5/20, P and replicas beside the greedy's, bitwise vs the host planner, valid,
#                   never worse than the greedy; where the time goes per case in the log     planner_moonep_sweep.csv
#   planner_sweep_bench_shared
#                   the same with FLATEP_PLANNER_PLACEMENT=shared: the candidate path before issue 22's fix (E=896,
#                   R >= 32 then falls back to plan_alloc on one thread), for the A/B against the default placement
#                   (auto: counts in global memory at R=32, counts and allocation at R=64; column planner_path)
#                                                                                     planner_moonep_sweep_shared.csv
#   planner_reference
#                   the same at the two configs of today's figures (moonep maxvio 0.2/1/10/20, deepep)
#                                                                                            planner_reference.csv
#   data_plane_k3   ops_bench --preset k3 --ffn 512: plan op, planner, dispatch, combine, prefetch, reduce_grad at
#                   R=8 virtual ranks, S=8192, E=896, H=7168, K 8/16, maxvio 1/5/20, each against the copy bandwidth
#                   of the same run (ratio_to_copy)                                                  ops_k3.csv
#   data_plane_k3_sm33
#                   the same with --num-sms 66: each rank's launches up to 66 blocks (a quarter of the GPU) where
#                   the default gives 32; the pool ops' owners then run their share faster      ops_k3_sm33.csv
#   s1024_k3        the same at K=8, maxvio 1 for s=1024 and s=8192 tokens per call (of S=8192)   ops_k3_s1024.csv
#   host_check      flatep-plan-quality --preset moonep-sweep: every host plan of the sweep valid and the balanced
#                   one never worse than the greedy (exit 1 otherwise)               plan_quality_moonep_sweep.csv
#
#   OUT=/tmp/out scripts/device_bench_moonep.sh             # after scripts/device_suite.sh built build-cuda
#   BENCH_STEPS="planner_sweep_bench data_plane_k3" scripts/device_bench_moonep.sh    # a subset, in the order above
#
# Builds ops_bench, test_gpu_ops and flatep-plan-quality into build-cuda (configured as device_suite.sh does when
# absent). The routing sigmas of the maxvio targets come from benchmarks/results/sigma_cache.csv (copied to
# $OUT/sigma_cache.csv; a missing one is bisected on the host and appended there). Every step has a timeout, a log
# ($OUT/<step>.log) and a PASS / FAIL line in $OUT/summary_moonep.txt; exit status 0 when every step passed.
# Environment: OUT, BENCH_STEPS, BENCH_DEADLINE_S (default 400), BUILD_DIR (default build-cuda), JOBS (16).
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.." || exit 2
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BUILD=${BUILD_DIR:-build-cuda}
JOBS=${JOBS:-16}
DEADLINE_S=${BENCH_DEADLINE_S:-400}
ALL_STEPS="build planner_sweep planner_sweep_bench planner_sweep_bench_shared planner_reference data_plane_k3 data_plane_k3_sm33 s1024_k3 host_check"
STEPS=${BENCH_STEPS:-$ALL_STEPS}
[[ " $STEPS " == *" build "* ]] || STEPS="build $STEPS"  # the binaries are always brought up to date
SUMMARY=$OUT/summary_moonep.txt
SIGMAS=$OUT/sigma_cache.csv
OPS=$BUILD/benchmarks/ops_bench
QUALITY=$BUILD/benchmarks/flatep-plan-quality
START=$SECONDS
FAILED=0
: >"$SUMMARY"

# say, step (shared with the other device benchmark drivers)
# shellcheck source=scripts/bench_steps.sh
source "$(dirname "$SELF")/bench_steps.sh"

build() {
    if [[ ! -f $BUILD/build.ninja ]]; then
        cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATEP_CUDA=ON \
            -DCMAKE_CUDA_ARCHITECTURES=90a -DFLATEP_BUILD_TESTS=ON -DFLATEP_BUILD_TOOLS=OFF \
            -DFLATEP_BUILD_PYTHON=OFF || return 1
    else
        cmake "$BUILD" >/dev/null || return 1  # picks up new files and targets of a reused build folder
    fi
    cmake --build "$BUILD" -j"$JOBS" --target ops_bench test_gpu_ops flatep-plan-quality
}

if [[ ${1:-} == __build ]]; then
    build
    exit $?
fi

env_log "$OUT/env_moonep.log" device_bench_moonep.sh
[[ -f $SIGMAS ]] || cp benchmarks/results/sigma_cache.csv "$SIGMAS"

step build 240 "$SELF" __build
step planner_sweep 120 "$BUILD"/tests/gpu/test_gpu_ops --case planner_sweep
step planner_sweep_bench 150 "$OPS" --planner-only --planner-profile --preset moonep-sweep --seeds 1 --iters 20 \
    --sigma-cache "$SIGMAS" --csv "$OUT/planner_moonep_sweep.csv"
step planner_sweep_bench_shared 200 env FLATEP_PLANNER_PLACEMENT=shared "$OPS" --planner-only --preset moonep-sweep \
    --seeds 1 --iters 20 --sigma-cache "$SIGMAS" --csv "$OUT/planner_moonep_sweep_shared.csv"
step planner_reference 60 "$OPS" --planner-only --preset moonep,deepep --seeds 1 --iters 20 \
    --sigma-cache "$SIGMAS" --csv "$OUT/planner_reference.csv"
step data_plane_k3 150 "$OPS" --preset k3 --ffn 512 --iters 20 --warmup 3 --sigma-cache "$SIGMAS" \
    --csv "$OUT/ops_k3.csv"
step data_plane_k3_sm33 150 "$OPS" --preset k3 --ffn 512 --iters 20 --warmup 3 --num-sms 66 \
    --sigma-cache "$SIGMAS" --csv "$OUT/ops_k3_sm33.csv"
step s1024_k3 60 "$OPS" --preset k3 --topk 8 --maxvio 1 --ffn 512 --tokens-per-call 1024,8192 --iters 20 \
    --warmup 3 --sigma-cache "$SIGMAS" --csv "$OUT/ops_k3_s1024.csv"
step host_check 90 "$QUALITY" --preset moonep-sweep --seeds 1 --factors 1 --iters 3 --bisection-ranks 8 \
    --sigma-seed 42 --sigma-cache "$SIGMAS" --csv "$OUT/plan_quality_moonep_sweep.csv"

say "device_bench_moonep: $( ((FAILED)) && echo FAILED || echo 'all passed') in $((SECONDS - START)) s; CSVs in $OUT"
exit "$FAILED"
