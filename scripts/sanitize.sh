#!/usr/bin/env bash
# Host tests under AddressSanitizer + UndefinedBehaviorSanitizer: configures its own build directory with
# -DFLATEP_SANITIZE=ON -DFLATEP_CUDA=OFF, builds everything the host tests need and runs them through CTest.
# Any sanitizer report fails the run (halt_on_error; UBSan is built with -fno-sanitize-recover).
#
#   scripts/sanitize.sh [extra ctest args...]        # e.g. -R 'hardening|transport'
# Environment: FLATEP_ASAN_BUILD_DIR (default build-asan), FLATEP_JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${FLATEP_ASAN_BUILD_DIR:-build-asan}"
jobs="${FLATEP_JOBS:-$(nproc)}"

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATEP_SANITIZE=ON -DFLATEP_CUDA=OFF \
    -DFLATEP_BUILD_PYTHON=OFF >/dev/null
cmake --build "$build_dir" -j"$jobs"

# detect_leaks: LeakSanitizer on every test process (forked children included); abort_on_error gives a core-like
# exit for the parent to see; the suppressions file, when present, lists reviewed third-party reports only.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# Timeouts under ASan: the fault-injection tests measure 1 s timeouts with 1 s slack, which holds under ASan too.
ctest --test-dir "$build_dir" --output-on-failure -j"$jobs" --timeout 1200 "$@"
echo "sanitize: ASan+UBSan host tests passed ($build_dir)"
