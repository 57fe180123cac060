#!/usr/bin/env bash
# Installs the system packages FlatEP needs to build and test on Debian 12 (only what is missing), then
# configures the build directory. Idempotent; used by run_demo.sh, run_tests.sh and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake ninja-build g++ libgtest-dev clang-format clang libclang-rt-14-dev python3 python3-numpy python3-scipy)
if [[ "${FLATEP_WITH_PYTHON:-1}" == "1" ]]; then
    packages+=(python3-pytest python3-torch pybind11-dev python3-pybind11 python3-dev)
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

build_dir="${FLATEP_BUILD_DIR:-build}"
if [[ ! -f "$build_dir/build.ninja" ]]; then
    # Debian's python3 (the one python3-torch and pybind11 belong to), not another python3 first on PATH.
    cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE=/usr/bin/python3 \
        ${FLATEP_CMAKE_ARGS:-}
fi
cmake --build "$build_dir" -j"$(nproc)"
