#!/usr/bin/env bash
# Every test: C++ unit tests, tool tests and (GPU tests skip without a GPU) through CTest, then the Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir="${FLATEP_BUILD_DIR:-build}"
ctest --test-dir "$build_dir" --output-on-failure -j"$(nproc)" --timeout 1200
if [[ -d tests/python ]] && ls tests/python/test_*.py >/dev/null 2>&1; then
    rc=0
    PYTHONPATH="$PWD/python:$PWD/$build_dir/python${PYTHONPATH:+:$PYTHONPATH}" \
        /usr/bin/python3 -m pytest -q tests/python || rc=$?
    # 5: pytest collected no test, which fails nothing.
    if ((rc == 5)); then
        echo "run_tests: pytest collected no test in tests/python"
    elif ((rc)); then
        exit "$rc"
    fi
fi
