#!/usr/bin/env bash
# GPU checks and benchmarks, each step under a time limit; logs go to ${OUT:-gpu-check}/<step>.log and the last
# lines of each are printed.
#
#   bash tools/gpu_check.sh [STEPS]     STEPS: comma list of tests,reliability,sanitize,bench,triton,deterministic,
#                                       sweep,hopper-sweep,l2-groups,decode,decode-sweep,varlen,dropout,cold,fa4,
#                                       features,model,context-parallel,fp8,host,host-bench,plans,fuzz,ncu-bwd,
#                                       compare
#                                       (default tests,reliability,decode)
# Environment: FLASHTRITON_COMMIT (the commit recorded in bench metadata), OUT, FUZZ_EXAMPLES (fuzz step, default
# 120), TESTS_LIMIT (tests step seconds, default 540: a machine with an empty Triton cache needs over 420), COMPARE_ARGS
# (compare step: the `flashtriton bench` arguments timed in both trees).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
out="${OUT:-gpu-check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
steps=",${1:-tests,reliability,decode},"

step() {  # step NAME SECONDS COMMAND...
  local name="$1" seconds="$2"
  shift 2
  case "$steps" in *",$name,"*) ;; *) return 0 ;; esac
  echo "== $name (limit ${seconds}s): $*"
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1
  echo "   exit $?"
  grep -v '^|---' "$out/$name.log" | tail -n 25
}

step tests "${TESTS_LIMIT:-540}" python -m pytest tests -q -n 12 -p no:cacheprovider -rfEs --ignore=tests/test_cli.py \
  --ignore=tests/test_gpu_reliability.py
# CUDA-graph tests last: a failed capture leaves the process's RNG in capture state and fails what follows
step reliability 250 bash -c "python -m pytest tests/test_gpu_reliability.py -q -p no:cacheprovider -rfEs -k 'not cuda_graph' \
  && python -m pytest tests/test_gpu_reliability.py -q -p no:cacheprovider -rfEs -k cuda_graph"
step sanitize 300 env TOOLS="memcheck racecheck initcheck" bash tools/sanitize.sh "$out/sanitize"
step bench 240 python -m flashtriton bench --modes fwd,bwd --providers flashtriton,sdpa-flash,sdpa-cudnn --out "$out/bench"
# the same with every Gluon kernel off (every call on the Triton kernels)
step triton 240 env FLASHTRITON_GLUON=0 python -m flashtriton bench --modes fwd,bwd \
  --providers flashtriton,sdpa-flash,sdpa-cudnn --out "$out/bench-triton"
step deterministic 150 python benchmarks/bench_deterministic.py --shapes 0,1,2 --timing kernels --out "$out/deterministic"
# the config sweeps behind configs.py's tables: Triton tiles, the Gluon Hopper forward, launch-order budgets
step sweep 300 python benchmarks/sweep_configs.py --modes fwd,bwd --out "$out/sweep"
step hopper-sweep 240 python benchmarks/sweep_hopper_fwd.py --out "$out/hopper-sweep"
step l2-groups 120 python benchmarks/sweep_l2_groups.py --graph --budgets-mib 0,4,8,16 --out "$out/l2-groups"
step decode 90 python benchmarks/bench_decode.py --paged 0,64,256 --graph --repeat 2
step decode-sweep 200 python benchmarks/bench_decode.py --paged 0,64,256 --graph --sweep
step varlen 60 python benchmarks/bench_varlen.py --causal
step dropout 110 python benchmarks/bench_dropout.py --out "$out/dropout"
step cold 130 python benchmarks/bench_cold_start.py --quick --out "$out/cold"
# the forward against FlashAttention-4 by kernel time, bf16 and fp16 (installs the wheels of tools/fa4_wheels.sh)
step fa4 300 bash -c "bash tools/fa4_wheels.sh install && export PYTHONPATH=\$(bash tools/fa4_wheels.sh path):\$PYTHONPATH \
  && for dtype in bf16 fp16; do python -m flashtriton bench --modes fwd --timing kernels --dtype \$dtype \
       --providers flashtriton,sdpa-flash,sdpa-cudnn,fa4 --out '$out/bench-fa4-'\$dtype || exit 1; done"
# the feature matrix (bench_features.py) in bf16 against FlashAttention-4 and SDPA, plus the Triton-path column;
# FEATURE_ROWS / FEATURE_DTYPE narrow it (FA4 compiles each configuration on first use: the whole matrix is long)
step features 540 bash -c "bash tools/fa4_wheels.sh install && export PYTHONPATH=\$(bash tools/fa4_wheels.sh path):\$PYTHONPATH \
  && python -m flashtriton bench --features --dtype ${FEATURE_DTYPE:-bf16} ${FEATURE_ROWS:+--rows $FEATURE_ROWS} \
       --out '$out/features'"
# a ~1B-parameter Llama-style model through transformers: training step and generate() tokens/s per attention
# implementation (FA4's row where tools/fa4_wheels.sh installed it)
step model 540 python benchmarks/bench_model.py --out "$out/model"
# context parallelism over every GPU of the machine (2 or more): ring-flash-attn's zigzag / llama3 on flashtriton and
# PyTorch's context_parallel with flashtriton as SDPA's flash provider; ring-flash-attn must be installed (--no-deps)
step context-parallel 560 bash -c "python benchmarks/bench_context_parallel.py --world \$(python -c 'import torch; \
  print(torch.cuda.device_count())') --out '$out/context-parallel'"
# FP8 against bf16: the forward on the baseline shapes (d128, d256), FP8-cache decode, accuracy
step fp8 300 python benchmarks/bench_fp8.py --out "$out/fp8"
# host time per eager call (profile of 300 warm calls)
step host 60 python tools/profile_first_call.py --top 25 --steady 300
# host time per call against SDPA (FA4 too where tools/fa4_wheels.sh installed it), eager decode TB/s
step host-bench 120 python benchmarks/bench_host.py --out "$out/host"
# every launch plan (ops/launching.py) compared with Triton's binder, every call plan (ops/call_plans.py) with the
# whole call, on the kernels' own tests
step plans 300 env FLASHTRITON_VERIFY_PLANS=1 python -m pytest -q -n 12 -p no:cacheprovider -rfE \
  tests/test_launch_plans.py tests/test_call_plans.py tests/test_dense.py tests/test_hopper_fwd.py tests/test_hopper_schedule.py \
  tests/test_hopper_bwd.py tests/test_varlen.py tests/test_kvcache.py
# the four fuzz tests side by side (one process each, logs fuzz-<test>.log), new random cases each run;
# hypothesis' statistics at the end of each log count the cases that ran
step fuzz 330 bash -c 'for t in flash_attn_func flash_attn_varlen_func flash_attn_with_kvcache hopper_forward_domain; do
    FLASHTRITON_FUZZ_EXAMPLES="${FUZZ_EXAMPLES:-120}" timeout 320 python -m pytest "tests/test_fuzz.py::test_fuzz_${t}" -q \
      -p no:cacheprovider --hypothesis-profile=long --hypothesis-show-statistics > "'"$out"'/fuzz-${t}.log" 2>&1 &
  done; wait; tail -n 15 "'"$out"'"/fuzz-*.log'
# Nsight Compute on the backward: warp stalls and instruction mix per SASS instruction of flashtriton's main
# backward kernel beside cuDNN's kernels (4 x 4096 x 16, d128, bf16, not causal; compiled before ncu starts), by
# tools/ncu_sass_summary.py; the report (ncu-bwd.ncu-rep) and its SASS table (ncu-bwd-sass.csv) stay in OUT
step ncu-bwd 300 bash -c "python tools/ncu_forward_pair.py --shapes 1 --backward --calls 1 \
  && ncu --clock-control none -k regex:'attn_bwd_hopper_kernel|cudnn_generated' --section SourceCounters \
       --section WarpStateStats --section InstructionStats -f -o '$out/ncu-bwd' \
       python tools/ncu_forward_pair.py --shapes 1 --backward --calls 1 \
  && ncu -i '$out/ncu-bwd.ncu-rep' --page source --print-source sass --csv > '$out/ncu-bwd-sass.csv' \
  && python tools/ncu_sass_summary.py '$out/ncu-bwd-sass.csv' --by-count"
# this tree against another commit's (bash tools/base_tree.sh REV beforehand puts it in .base/; carry .base), on
# one machine back to back: COMPARE_ARGS (default: the backward and varlen rows of the feature matrix) in each
step compare 420 bash -c 'test -f .base/COMMIT || { echo "no .base/: run bash tools/base_tree.sh REV here and carry .base"; exit 1; }
  args="${COMPARE_ARGS:---features --modes fwd,bwd --rows plain,varlen-mixed,paged-64,window-1024 --providers flashtriton}"
  python -m flashtriton bench $args --out "'"$out"'/compare-tree" \
    && cd .base && FLASHTRITON_COMMIT="$(cat COMMIT)" PYTHONPATH="$PWD" python -m flashtriton bench $args \
       --out "'"$out"'/compare-base"'
