#!/usr/bin/env bash
# The main job: FlatEP's demo (one MoE layer, forward and backward, R simulated ranks) over a maxvio sweep.
# Runs on the CPU backend when no GPU is present. Extra arguments go to flatep-demo (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >&2
exec "${FLATEP_BUILD_DIR:-build}/tools/flatep-demo" "$@"
