#!/usr/bin/env bash
# The package as of another commit, in .base/ (ignored by git), for `bash tools/gpu_check.sh compare`: carry .base to
# the GPU machine with the tree, and the step times the same benchmark in both trees there, back to back.
#
#   bash tools/base_tree.sh REV
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rev="${1:?usage: bash tools/base_tree.sh REV}"
rm -rf "$root/.base"
mkdir -p "$root/.base"
git -C "$root" archive "$rev" flashtriton | tar -x -C "$root/.base"
git -C "$root" rev-parse --short "$rev" > "$root/.base/COMMIT"
echo "$root/.base: flashtriton at $(cat "$root/.base/COMMIT")"
