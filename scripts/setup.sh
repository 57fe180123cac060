#!/usr/bin/env bash
# Installs the Debian 12 packages FlatEP needs to build, test, benchmark and pip-install it (only what is missing),
# then configures and builds the build directory. Idempotent; used by run_demo.sh, run_tests.sh and .ci/run.
# `scripts/setup.sh --packages-only` stops after the packages (the README's pip install route).
# scripts/check_deps.py reads the package list below: every third-party module the Python code imports must map to a
# package in it.
set -euo pipefail
cd "$(dirname "$0")/.."

packages_only=0
case "${1:-}" in
    "") ;;
    --packages-only) packages_only=1 ;;
    *)
        echo "usage: scripts/setup.sh [--packages-only]" >&2
        exit 2
        ;;
esac

# llvm: llvm-profdata and llvm-cov for scripts/coverage.sh (clang's source-based branch coverage of the planner).
# gcovr: scripts/coverage_ci.sh's line and branch coverage of src/ (g++ --coverage).
packages=(cmake ninja-build g++ git libgtest-dev nlohmann-json3-dev libcli11-dev clang-format clang libclang-rt-14-dev
    llvm gcovr python3 python3-numpy python3-scipy)
if [[ "${FLATEP_WITH_PYTHON:-1}" == "1" ]]; then
    # python3-venv, -pip, -setuptools and -wheel: the README's `pip install --no-build-isolation .` in a venv.
    # python3-hypothesis: the property tests (tests/python/test_prop_*.py); python3-coverage: scripts/coverage_ci.sh.
    packages+=(python3-pytest python3-torch pybind11-dev python3-pybind11 python3-dev python3-matplotlib
        python3-venv python3-pip python3-setuptools python3-wheel python3-hypothesis python3-coverage)
fi
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    sudo_cmd=()
    [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
    export DEBIAN_FRONTEND=noninteractive
    "${sudo_cmd[@]}" apt-get update -qq
    "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ((packages_only)); then
    exit 0
fi

build_dir="${FLATEP_BUILD_DIR:-build}"
if [[ ! -f "$build_dir/build.ninja" ]]; then
    # Debian's python3 (the one python3-torch and pybind11 belong to), not another python3 first on PATH.
    cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE=/usr/bin/python3 \
        ${FLATEP_CMAKE_ARGS:-}
fi
cmake --build "$build_dir" -j"$(nproc)"
