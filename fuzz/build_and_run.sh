#!/usr/bin/env bash
# Builds the libFuzzer targets with clang++ (-fsanitize=fuzzer,address,undefined) straight from the sources they
# need (the main CMake build is untouched), then optionally runs them.
#
#   fuzz/build_and_run.sh build                    # build into $FLATEP_FUZZ_BUILD (default build-fuzz)
#   fuzz/build_and_run.sh run SECONDS [TARGET...]  # build, then fuzz each target for SECONDS with its seed corpus
#
# Targets: planner_fuzz, plan_request_fuzz, config_fuzz. A run fuzzes into $BUILD/corpus/<target> (seeded from
# fuzz/corpus/<target>, which it never modifies), writes crashes to $BUILD/crashes/<target>/ and the libFuzzer log
# to $BUILD/logs/<target>.log; it exits non-zero when any target crashed. Add new interesting inputs to the seed
# corpus with: <target> -merge=1 fuzz/corpus/<target> $BUILD/corpus/<target>
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
build="${FLATEP_FUZZ_BUILD:-$root/build-fuzz}"
cxx="${CXX_FUZZ:-clang++}"
targets_all=(planner_fuzz plan_request_fuzz config_fuzz)

# plan_request_fuzz reads JSON through tools/json.hpp: Debian's nlohmann-json3-dev (headers in /usr/include).
flags=(-g -O2 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
       -I"$root/include" -I"$root/src" -I"$root/tools" -I"$root/fuzz")

# Coverage feedback for the code under test; none for the oracle (check_plan re-derives every row of a plan, and
# instrumenting its comparisons makes the planner target ~5x slower without guiding anything) or the error helpers.
coverage_of() { case "$1" in */check_plan.cpp | */common/*) ;; *) echo -fsanitize=fuzzer-no-link ;; esac; }

build_all() {
    mkdir -p "$build/obj"
    local srcs=("$root"/src/common/*.cpp "$root"/src/layout/*.cpp "$root"/src/planner/*.cpp)
    local objs=()
    for src in "${srcs[@]}"; do
        local obj="$build/obj/$(basename "$(dirname "$src")")_$(basename "${src%.cpp}").o"
        objs+=("$obj")
        # Rebuild when the source or any header it may include is newer (cheap and conservative).
        if [[ ! -f "$obj" || -n "$(find "$src" "$root/src" "$root/include" "$root/tools" -newer "$obj" \
              \( -name '*.hpp' -o -name '*.cpp' \) -print -quit)" ]]; then
            "$cxx" -std=c++20 "${flags[@]}" $(coverage_of "$src") -c "$src" -o "$obj"
        fi
    done
    for target in "${targets_all[@]}"; do
        "$cxx" -std=c++20 "${flags[@]}" -fsanitize=fuzzer "$root/fuzz/$target.cpp" "${objs[@]}" -lpthread -o "$build/$target"
    done
    echo "fuzz targets built in $build"
}

run_targets() {
    local seconds="$1"
    shift
    local targets=("$@")
    [[ ${#targets[@]} -gt 0 ]] || targets=("${targets_all[@]}")
    local failed=0
    mkdir -p "$build/logs"
    for target in "${targets[@]}"; do
        local work="$build/corpus/$target" crashes="$build/crashes/$target/"
        mkdir -p "$work" "$crashes"
        local seeds=()
        [[ -d "$root/fuzz/corpus/$target" ]] && seeds=("$root/fuzz/corpus/$target")
        local log="$build/logs/$target.log"
        local rc=0
        ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}" \
            "$build/$target" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
            -print_final_stats=1 -artifact_prefix="$crashes" "$work" "${seeds[@]}" >"$log" 2>&1 || rc=$?
        local execs corpus
        execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
        corpus=$(find "$work" -type f | wc -l)
        if [[ $rc -ne 0 ]]; then
            echo "FAIL $target (exit $rc, $execs executions): see $log and $crashes"
            grep -m3 -E 'fuzz assertion failed|ERROR: |runtime error' "$log" || tail -5 "$log"
            failed=1
        else
            echo "ok   $target: ${seconds}s, $execs executions, corpus $corpus inputs"
        fi
    done
    return $failed
}

case "${1:-build}" in
    build) build_all ;;
    run)
        [[ $# -ge 2 ]] || { echo "usage: $0 run SECONDS [TARGET...]" >&2; exit 2; }
        seconds="$2"
        shift 2
        build_all
        run_targets "$seconds" "$@"
        ;;
    *) echo "usage: $0 build | run SECONDS [TARGET...]" >&2; exit 2 ;;
esac
