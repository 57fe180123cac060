#!/usr/bin/env bash
# The CI fuzz run: builds the libFuzzer targets (fuzz/build_and_run.sh, clang++ with ASan+UBSan) and fuzzes each for
# FLATEP_FUZZ_SECONDS (default 20) starting from its seed corpus in fuzz/corpus/<target>; fails on any crash,
# assertion (design §4 violation, parser disagreement) or sanitizer report. About a minute in total.
# The failing input is left in $FLATEP_FUZZ_BUILD/crashes/<target>/ (default build-fuzz); reproduce with
#   build-fuzz/<target> build-fuzz/crashes/<target>/<file>
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${FLATEP_FUZZ_SECONDS:-20}"
if ! command -v "${CXX_FUZZ:-clang++}" >/dev/null; then
    echo "fuzz_ci: clang++ not found; install clang (with libclang_rt fuzzer) to run the fuzz targets" >&2
    exit 1
fi
# FLATEP_FUZZ_IGNORE=name[,name] skips a known violation (none is known now).
export FLATEP_FUZZ_IGNORE="${FLATEP_FUZZ_IGNORE-}"
# A fresh working corpus per run: CI results do not depend on what earlier runs found.
export FLATEP_FUZZ_BUILD="${FLATEP_FUZZ_BUILD:-$PWD/build-fuzz}"
rm -rf "$FLATEP_FUZZ_BUILD/corpus" "$FLATEP_FUZZ_BUILD/crashes"
fuzz/build_and_run.sh run "$seconds"
