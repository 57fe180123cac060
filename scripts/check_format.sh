#!/usr/bin/env bash
# Fails when a C++/CUDA file differs from what clang-format (repo .clang-format) makes of it.
# Checks the files changed since $FLATEP_FORMAT_BASE when set, else every tracked C++/CUDA file.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${FLATEP_FORMAT_BASE:-}" ]]; then
    mapfile -t files < <(git diff --name-only --diff-filter=d "$FLATEP_FORMAT_BASE" -- '*.cpp' '*.hpp' '*.cu' '*.cuh')
else
    mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh')
fi
bad=0
for f in "${files[@]}"; do
    if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
        echo "format: $f is not clang-formatted (run: clang-format -i $f)"
        bad=1
    fi
done
echo "format: checked ${#files[@]} files"
exit $bad
