#!/usr/bin/env bash
# Line and branch coverage of the host-compiled C++ (src/) and of the Python package (python/flatep) under the whole
# CPU suite, as CI runs it (.ci/run). A build directory of its own (default build-cov: g++ --coverage, -O0, CPU only,
# FLATEP_CUDA=OFF, so it also proves that every test of the CPU build compiles and passes without nvcc), then every
# CTest test and pytest (the install tests left out: they test packaging, and build the extension once more) with
# coverage.py measuring python/flatep in every Python process they start (spawned ranks and examples included).
#
# The C++ numbers are gcovr's (Debian's gcovr) over src/ with --exclude-throw-branches (the branches g++ generates
# for exception handling: every call that may throw has one, and no test can or should take each) and
# --exclude-unreachable-branches (branches on lines without code, e.g. a closing brace's destructor calls). The
# Python numbers are coverage.py's (Debian's python3-coverage, --branch). scripts/coverage_report.py then checks
# the rule of docs/testing.md: every branch no test takes is listed in scripts/coverage_exclusions.txt with the
# reason it is not tested on the CPU (GPU-only code, say); an unlisted one fails the run, naming it.
#
#   scripts/coverage_ci.sh                build, run the suite, report (exit 1 on an unlisted uncovered branch)
#   scripts/coverage_ci.sh --report-only  report from the last run's data (no build, no tests)
#   scripts/coverage_ci.sh --missed       also print every uncovered branch in the exclusions file's format
#   FLATEP_COVERAGE_CI_DIR=dir            the build directory (default build-cov); FLATEP_JOBS: jobs (nproc)
set -euo pipefail
cd "$(dirname "$0")/.."

report_only=0
report_args=()
for arg in "$@"; do
    case "$arg" in
        --report-only) report_only=1 ;;
        --missed) report_args+=(--missed) ;;
        *)
            echo "usage: scripts/coverage_ci.sh [--report-only] [--missed]" >&2
            exit 2
            ;;
    esac
done

dir="${FLATEP_COVERAGE_CI_DIR:-build-cov}"
jobs="${FLATEP_JOBS:-$(nproc)}"
data="$PWD/$dir/coverage"
start=$SECONDS

if ((!report_only)); then
    scripts/setup.sh --packages-only  # gcovr and python3-coverage among them
    if [[ ! -f "$dir/build.ninja" ]]; then
        flags="--coverage -fprofile-update=atomic"  # atomic: the tests run ranks as threads
        cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFLATEP_CUDA=OFF \
            -DPython_EXECUTABLE=/usr/bin/python3 -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
            -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" \
            -DCMAKE_MODULE_LINKER_FLAGS="$flags" >/dev/null
    fi
    cmake --build "$dir" -j"$jobs"
    built=$SECONDS
    find "$dir" -name '*.gcda' -delete
    rm -rf "$data"
    mkdir -p "$data/python" "$data/site"
    # coverage.py in every Python process of the run: a sitecustomize (first on PYTHONPATH) starts it when
    # COVERAGE_PROCESS_START names the settings; each process writes a data file of its own, combined below.
    cat >"$data/coveragerc" <<EOF
[run]
branch = True
parallel = True
source = $PWD/python/flatep
data_file = $data/python/.coverage
concurrency = thread,multiprocessing
EOF
    printf 'import coverage\ncoverage.process_startup()\n' >"$data/site/sitecustomize.py"
    export COVERAGE_PROCESS_START="$data/coveragerc"
    export PYTHONPATH="$data/site:$PWD/python:$PWD/$dir/python${PYTHONPATH:+:$PYTHONPATH}"
    export FLATEP_BUILD_DIR="$dir"
    ctest --test-dir "$dir" --output-on-failure -j"$jobs" --timeout 1200
    ctested=$SECONDS
    /usr/bin/python3 -m pytest -q -p no:cacheprovider --ignore-glob='tests/python/test_install*.py' tests/python
    echo "coverage_ci: build $((built - start)) s, ctest $((ctested - built)) s, pytest $((SECONDS - ctested)) s"
    unset COVERAGE_PROCESS_START
fi

/usr/bin/python3 -m coverage combine --rcfile="$data/coveragerc" --keep "$data/python" >/dev/null
/usr/bin/python3 -m coverage json --rcfile="$data/coveragerc" -o "$data/python.json" >/dev/null
# Headers are compiled through the layers' include roots (<dir>/layers/<folder>/<folder> -> src/<folder>, see
# CMakeLists.txt): gcovr sees them there, and coverage_report.py counts them under src/.
gcovr --root . --object-directory "$dir" --filter 'src/' --filter "$dir/layers/" --exclude-throw-branches \
    --exclude-unreachable-branches -j "$jobs" --json "$data/cpp.json" >/dev/null
# The GPU steps' coverage of python/flatep, recorded on the device (scripts/device.sh with DEVICE_COVERAGE=1), is
# merged into a second Python figure for the files whose source is still the one measured.
device_args=()
for f in benchmarks/results/coverage_device/*.json; do
    [[ -f $f ]] && device_args+=(--python-device "$f")
done
/usr/bin/python3 scripts/coverage_report.py --cpp "$data/cpp.json" --build-dir "$dir" --python "$data/python.json" \
    --exclusions scripts/coverage_exclusions.txt "${device_args[@]}" "${report_args[@]}"
echo "coverage_ci: $((SECONDS - start)) s in all"
