#!/usr/bin/env bash
# Run tools/sanitize_cases.py (every kernel once, small shapes) under compute-sanitizer's memcheck, racecheck,
# initcheck and synccheck, one log per tool, and print one summary line per tool.
#
#   bash tools/sanitize.sh [LOG_DIR] [sanitize_cases.py options, e.g. --only kv]
#   TOOLS=memcheck bash tools/sanitize.sh logs --only bad-index   # malformed index values only (docs/api.md §6)
#
# The bad-index-* cases hand malformed cu_seqlens, block tables, cache_batch_idx and cache_seqlens to the kernels
# with the host checks off (flashtriton.testing.unchecked_indices): memcheck, one allocation per tensor, must find
# no access outside a tensor, and the kv-cache cases check a sentinel region around each cache after the append.
#
# LOG_DIR defaults to sanitize-logs. It gets <tool>.log (the sanitizer's report), <tool>.out (the cases' own
# output) and warmup.log. The exit status is 1 if any tool reports an error or a case fails under it, 2 if the
# tools could not run at all.
# Environment:
#   SANITIZER        compute-sanitizer binary (default: on PATH, else the newest /usr/local/cuda*/bin one)
#   TOOLS            tools to run, default "memcheck racecheck initcheck synccheck"
#   PYTHON           interpreter (default: python)
#   SANITIZER_FLAGS  extra flags for every tool, e.g. "--kernel-name kns=attn_" to check only flashtriton's kernels
#   PRINT_LIMIT      reports printed per tool (default 200; raise it to classify every report)
#   LAUNCH_TIMEOUT   seconds one kernel may run under a tool before it is reported as hung (default 600)
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log_dir="sanitize-logs"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  log_dir="$1"
  shift
fi
case_args=("$@")
python="${PYTHON:-python}"
tools="${TOOLS:-memcheck racecheck initcheck synccheck}"

sanitizer="${SANITIZER:-}"
if [ -z "$sanitizer" ]; then
  sanitizer="$(command -v compute-sanitizer || true)"
fi
if [ -z "$sanitizer" ]; then
  sanitizer="$(ls -d /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null \
               | sort -V | tail -n 1)"
fi
if [ -z "$sanitizer" ] || [ ! -x "$sanitizer" ]; then
  echo "sanitize.sh: compute-sanitizer not found (set SANITIZER=/path/to/compute-sanitizer)" >&2
  exit 2
fi

mkdir -p "$log_dir"
log_dir="$(cd "$log_dir" && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

echo "compute-sanitizer: $sanitizer ($("$sanitizer" --version 2>/dev/null | grep -Eo 'Version [^ ]+' | head -n 1))"
echo "logs: $log_dir"

# Triton compiles each kernel at its first launch. Doing that once without the sanitizer fills Triton's on-disk
# cache, so the tool runs below load binaries instead of compiling under instrumentation.
start=$(date +%s)
if ! "$python" tools/sanitize_cases.py ${case_args[@]+"${case_args[@]}"} > "$log_dir/warmup.log" 2>&1; then
  echo "sanitize.sh: the cases fail without the sanitizer; fix that first (see $log_dir/warmup.log):" >&2
  grep -E '^FAIL|Error|error' "$log_dir/warmup.log" | head -n 20 >&2
  exit 2
fi
echo "warm-up (no sanitizer): $(grep -c '^ok' "$log_dir/warmup.log") cases ok in $(( $(date +%s) - start ))s"

help_text="$("$sanitizer" --help 2>&1)"
supports() { grep -q -- "$1" <<< "$help_text"; }

status=0
for tool in $tools; do
  flags=(--tool "$tool" --error-exitcode 1 --log-file "$log_dir/$tool.log" --print-limit "${PRINT_LIMIT:-200}")
  supports "--launch-timeout" && flags+=(--launch-timeout "${LAUNCH_TIMEOUT:-600}")
  # API errors that PyTorch and Triton raise and handle themselves (probing, peer access) are not kernel bugs.
  supports "--report-api-errors" && flags+=(--report-api-errors no)
  env_vars=()
  case "$tool" in
    memcheck)
      # One cudaMalloc per tensor (no caching allocator), so an out-of-bounds access cannot land inside another
      # tensor of the same cached block; padding after each allocation catches small overruns past its end.
      env_vars+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
      supports "--leak-check" && flags+=(--leak-check no)
      supports "--padding" && flags+=(--padding 256)
      ;;
    initcheck)
      # A block reused by the caching allocator counts as initialized; fresh allocations make unwritten outputs
      # show up when the case reads them back. Pointer loads/stores only (FLASHTRITON_TMA=0): initcheck 2025.3
      # reports every read of an output written by TMA bulk stores as uninitialized (it does not see TMA writes).
      # The Gluon Hopper kernels need descriptors, so they are off here: memcheck and racecheck cover them.
      env_vars+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1 FLASHTRITON_TMA=0)
      # (--track-unused-memory is a switch, off by default, in compute-sanitizer 2025: no value may follow it,
      # or the value is taken for the application to run)
      ;;
    racecheck)
      supports "--racecheck-report" && flags+=(--racecheck-report analysis)
      ;;
    synccheck) ;;
    *) echo "sanitize.sh: unknown tool $tool" >&2; status=2; continue ;;
  esac
  # shellcheck disable=SC2206
  extra=(${SANITIZER_FLAGS:-})
  start=$(date +%s)
  env ${env_vars[@]+"${env_vars[@]}"} "$sanitizer" "${flags[@]}" ${extra[@]+"${extra[@]}"} \
    "$python" tools/sanitize_cases.py ${case_args[@]+"${case_args[@]}"} > "$log_dir/$tool.out" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  # racecheck ends with "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)", the others with
  # "ERROR SUMMARY: N errors"
  errors="$(grep -Eo 'ERROR SUMMARY: [0-9]+ error|\([0-9]+ errors' "$log_dir/$tool.log" 2>/dev/null | grep -Eo '[0-9]+' \
            | tail -n 1)"
  cases_ok=$(grep -c '^ok' "$log_dir/$tool.out")
  cases_failed=$(grep -c '^FAIL' "$log_dir/$tool.out")
  if [ -z "$errors" ]; then
    verdict="NO SUMMARY (the sanitizer did not finish; see $tool.log / $tool.out)"
    status=1
  elif [ "$errors" -gt 0 ] || [ "$cases_failed" -gt 0 ] || [ "$rc" -ne 0 ]; then
    verdict="FAILED"
    status=1
  else
    verdict="clean"
  fi
  printf '%-10s errors=%-5s cases ok=%-3s failed=%-3s exit=%-3s %5ss  %s  (%s)\n' \
    "$tool" "${errors:-?}" "$cases_ok" "$cases_failed" "$rc" "$seconds" "$verdict" "$log_dir/$tool.log"
  if [ -n "$errors" ] && [ "$errors" -gt 0 ]; then
    # The first report names the kernel and the access; later ones are often consequences of it.
    grep -m 3 -E '^========= (Invalid|Uninitialized|Race|Barrier|Error|Program hit|Warning|.*hazard)' \
      "$log_dir/$tool.log" | sed 's/^/    /'
  fi
done
exit "$status"
