#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv (or $FLASHTRITON_VENV) on first use, installs
# flashtriton with its test extras, then runs
#   bash tools/dev.sh validate [flashtriton validate options]   -- the main job
#   bash tools/dev.sh test [pytest options]                     -- the test suite (kernels through Triton's interpreter)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FLASHTRITON_VENV:-$root/.venv}"
cd "$root"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
if ! python -c "import sys, flashtriton, pytest, xdist, hypothesis, importlib.util as u; assert u.find_spec('ring_flash_attn') and (sys.version_info < (3, 11) or u.find_spec('transformers'))" \
    >/dev/null 2>&1; then
  python -m pip install --quiet "torch==2.13.0" "triton==3.6.0" numpy
  python -m pip install --quiet -e ".[test]"
fi
command="${1:-}"
shift || true
case "$command" in
  validate) exec flashtriton validate "$@" ;;
  test) TRITON_INTERPRET=1 exec python -m pytest -n 2 -q "$@" ;;
  *) echo "usage: bash tools/dev.sh validate|test [options]" >&2; exit 2 ;;
esac
