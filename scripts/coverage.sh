#!/usr/bin/env bash
# Branch coverage of the host planner (src/planner/*.hpp and *.cpp; the GPU files *.cu / *.cuh are not compiled here)
# under the planner tests. CPU only, CI-able: clang's source-based coverage (-fprofile-instr-generate
# -fcoverage-mapping; llvm-profdata and llvm-cov from Debian's `llvm`, installed by scripts/setup.sh) in a build
# directory of its own, so the normal build is untouched.
#
#   scripts/coverage.sh                  build flatep_planner_tests with coverage, run it, print the branch summary
#                                        of every planner file and the total ("TOTAL ... branches ... %")
#   scripts/coverage.sh --missed         also list every branch never taken or never skipped (file:line and the
#                                        source line), the list a new golden plan should shrink
#   scripts/coverage.sh --all            run every CTest test (not only the planner binary) into the same profile
#   FLATEP_COVERAGE_DIR=dir              the build directory (default build-coverage)
#
# A branch counts twice in llvm-cov's numbers (taken / not taken). --missed sums the template instantiations
# (SerialExec and the test executors) per source branch.
#
# Measured (issue 49), scripts/coverage.sh: 90.8% of 660 branches (61 missed) before its tests, 93.3% (44) after
# (test_check_plan.cpp: every check of check_plan fires; PlannerSteps.PrecomputedHomeAndTargetsAsComputed: the GPU's
# home_ready / targets_ready paths). What --missed still lists (37 sides): derive.hpp's lane-group branches, taken
# only with the GPU's 32-lane groups (17); guards no valid input reaches ("cannot happen", the loops' step bounds,
# check_plan's placement checks behind its split-array checks, row > NvS) and the transport's / tree's "receiver
# already hosts the expert" branch, which a search of 30,000 random matrices never saw change a candidate (after a
# piece, the receiver's room is 0, the donor is done or the expert exhausted). The golden plans
# (test_planner_branch_goldens.cpp) do not raise the number: they pin what the reached branches compute.
set -euo pipefail
cd "$(dirname "$0")/.."

missed=0
all=0
for arg in "$@"; do
    case "$arg" in
        --missed) missed=1 ;;
        --all) all=1 ;;
        *)
            echo "usage: scripts/coverage.sh [--missed] [--all]" >&2
            exit 2
            ;;
    esac
done

FLATEP_WITH_PYTHON=0 scripts/setup.sh --packages-only
for tool in clang++ llvm-profdata llvm-cov; do
    command -v "$tool" >/dev/null || {
        echo "coverage: $tool not found (scripts/setup.sh installs clang and llvm)" >&2
        exit 1
    }
done

dir="${FLATEP_COVERAGE_DIR:-build-coverage}"
flags="-fprofile-instr-generate -fcoverage-mapping"
if [[ ! -f "$dir/build.ninja" ]]; then
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFLATEP_CUDA=OFF -DFLATEP_BUILD_PYTHON=OFF \
        -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_FLAGS="$flags" \
        -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" >/dev/null
fi
jobs="${FLATEP_COVERAGE_JOBS:-$(nproc)}"
profiles="$dir/profiles"
rm -rf "$profiles"
mkdir -p "$profiles"
start=$SECONDS
if ((all)); then
    cmake --build "$dir" -j"$jobs"
    LLVM_PROFILE_FILE="$PWD/$profiles/%p-%m.profraw" ctest --test-dir "$dir" -j"$jobs" --output-on-failure
    binaries=()
    for b in "$dir"/tests/flatep_*_tests "$dir"/tools/flatep-plan "$dir"/tools/flatep-demo; do
        [[ -x "$b" ]] && binaries+=("$b")
    done
else
    cmake --build "$dir" -j"$jobs" --target flatep_planner_tests
    LLVM_PROFILE_FILE="$PWD/$profiles/%p-%m.profraw" "$dir/tests/flatep_planner_tests" --gtest_brief=1
    binaries=("$dir/tests/flatep_planner_tests")
fi
llvm-profdata merge -sparse "$profiles"/*.profraw -o "$dir/planner.profdata"
objects=("${binaries[0]}")
for b in "${binaries[@]:1}"; do objects+=(-object "$b"); done
sources=()
for f in src/planner/*.hpp src/planner/*.cpp; do sources+=("$f"); done
echo "coverage: src/planner host files under ${binaries[*]} ($((SECONDS - start)) s)"
llvm-cov report "${objects[@]}" -instr-profile="$dir/planner.profdata" -show-branch-summary \
    -show-region-summary=false -show-instantiation-summary=false "${sources[@]}"
if ((missed)); then
    # Branch sides ("Branch (L:C): [True: n, False: m]") that ran 0 times in every template instantiation.
    llvm-cov show "${objects[@]}" -instr-profile="$dir/planner.profdata" -show-branches=count \
        -show-instantiations=false -use-color=false "${sources[@]}" |
        /usr/bin/python3 -c '
import collections, os, re, sys
path, source, counts = None, {}, collections.OrderedDict()
def number(text):
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)
for line in sys.stdin:
    if line.startswith("/") and line.rstrip().endswith(":"):
        path = os.path.relpath(line.strip()[:-1])
        continue
    m = re.match(r"\s*(\d+)\|\s*[\d.kMG]*\|(.*)", line)
    if m:
        source[(path, int(m.group(1)))] = m.group(2).strip()
        continue
    m = re.search(r"Branch \((\d+):(\d+)\): \[True: ([\d.kMG]+), False: ([\d.kMG]+)\]", line)
    if m:
        key = (path, int(m.group(1)), int(m.group(2)))
        t, f = counts.get(key, (0, 0))
        counts[key] = (t + number(m.group(3)), f + number(m.group(4)))
missed = 0
for (path, n, col), (t, f) in sorted(counts.items()):
    for side, c in (("never true", t), ("never false", f)):
        if c == 0:
            missed += 1
            print(f"{path}:{n}:{col}: {side}: {source.get((path, n), str())[:100]}")
print(f"{missed} of {2 * len(counts)} branch sides never taken (summed over the template instantiations)")
'
fi
