#!/usr/bin/env bash
# One device call's worth of GPU checks, in the order a kernel change needs them. Each step has a time limit so the
# call ends inside the device tool's 10 minutes; logs go to ${OUT:-gpu-check}/<step>.log and the last lines of each
# are printed.
#
#   bash tools/gpu_check.sh [STEPS]     STEPS: comma list of tests,reliability,sanitize,bench,decode,varlen,dropout,cold,
#                                       host,decode-sweep,bwd-atomic,fwd-short,l2-groups,fuzz,fwd-triton,
#                                       hopper-sweep,hopper-bwd,ablate-bwd,ablate-fwd,ablate-ordered,fa4,
#                                       fp16-clocks
#                                       (default tests,reliability,decode)
# Environment: FLASHTRITON_COMMIT (give it: the device copy's git may name another commit), OUT, FUZZ_EXAMPLES
# (fuzz step, default 120), FWD_VARIANTS / FWD_SHAPES (ablate-fwd: the variants of benchmarks/ablations/fwd_hopper.py
# to time, and the bench shape indices, default 0,1,2,3,4), BWD_VARIANTS (ablate-bwd: the variants of
# benchmarks/ablations/bwd_hopper.py to time),
# TESTS_LIMIT (tests step seconds, default 300; a fresh machine compiles every kernel and needs ~400).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
out="${OUT:-gpu-check}"
mkdir -p "$out"
steps=",${1:-tests,reliability,decode},"
# the twenty-fourth session's one change (the row max in one chain at d128 non-causal, after its first reading)
# priced a second time from the other side
default_fwd_variants="row max as a tree at d128"
fwd_variants="${FWD_VARIANTS:-$default_fwd_variants}"

step() {  # step NAME SECONDS COMMAND...
  local name="$1" seconds="$2"
  shift 2
  case "$steps" in *",$name,"*) ;; *) return 0 ;; esac
  echo "== $name (limit ${seconds}s): $*"
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1
  echo "   exit $?"
  grep -v '^|---' "$out/$name.log" | tail -n 25
}

step tests "${TESTS_LIMIT:-300}" python -m pytest tests -q -n 12 -p no:cacheprovider -rfEs --ignore=tests/test_cli.py \
  --ignore=tests/test_gpu_reliability.py
# CUDA-graph tests last: a failed capture leaves the process's RNG in capture state and fails what follows
step reliability 250 bash -c "python -m pytest tests/test_gpu_reliability.py -q -p no:cacheprovider -rfEs -k 'not cuda_graph' \
  && python -m pytest tests/test_gpu_reliability.py -q -p no:cacheprovider -rfEs -k cuda_graph"
step sanitize 300 env TOOLS="memcheck racecheck initcheck" bash tools/sanitize.sh "$out/sanitize"
step bench 240 python -m flashtriton bench --modes fwd,bwd --providers flashtriton,sdpa-flash,sdpa-cudnn --out "$out/bench"
# the forward bench with the Gluon Hopper kernel off (every forward on the Triton kernel), to compare with `bench`
step fwd-triton 150 env FLASHTRITON_GLUON=0 python -m flashtriton bench --modes fwd --providers flashtriton,sdpa-flash,sdpa-cudnn \
  --out "$out/bench-triton"
# the Gluon Hopper forward's configs (schedule, registers, stages) on the BASELINES.md shapes
step hopper-sweep 240 python benchmarks/sweep_hopper_fwd.py --out "$out/hopper-sweep"
# the Gluon backward's tests (they force it on), then Gluon vs Triton vs SDPA backward timing
step hopper-bwd 300 bash -c "python -m pytest tests/test_hopper_bwd.py -q -n 8 -p no:cacheprovider -rfE --maxfail=6 \
  && python benchmarks/bench_hopper_bwd.py --out '$out/hopper-bwd'"
# the d64 / d128 Gluon backward's variants (BWD_VARIANTS, default the causal mask by column residues) and the
# forward's (FWD_VARIANTS; benchmarks/ablations/), each in one process
step ablate-bwd 240 python benchmarks/ablate_kernel.py --variants benchmarks/ablations/bwd_hopper.py --shapes 0,1,3 \
  --timing kernels --rounds 2 --only "${BWD_VARIANTS:-causal mask by column residues}" --out "$out/ablate-bwd"
step ablate-fwd 300 python benchmarks/ablate_kernel.py --variants benchmarks/ablations/fwd_hopper.py --mode fwd \
  --shapes "${FWD_SHAPES:-0,1,2,3,4}" --timing kernels --rounds 3 --out "$out/ablate-fwd" \
  --only "$fwd_variants"
# deterministic=True at d128 (ordered dQ): where its cost goes (benchmarks/ablations/bwd_hopper_ordered.py)
step ablate-ordered 240 python benchmarks/ablate_kernel.py --variants benchmarks/ablations/bwd_hopper_ordered.py \
  --shapes 0,1,2 --timing kernels --out "$out/ablate-ordered"
step decode 90 python benchmarks/bench_decode.py --paged 0,64,256 --graph --repeat 2
step varlen 60 python benchmarks/bench_varlen.py --causal
step dropout 110 python benchmarks/bench_dropout.py --out "$out/dropout"
step cold 130 python benchmarks/bench_cold_start.py --quick --out "$out/cold"
# the forward against FlashAttention-4 by kernel time, bf16 and fp16: needs tools/fa4_wheels.sh stash in the call
# before on the same machine (carry .fa4/a there) and carry [".fa4/b"] in this one
step fa4 300 bash -c "bash tools/fa4_wheels.sh install && export PYTHONPATH=\$(bash tools/fa4_wheels.sh path):\$PYTHONPATH \
  && for dtype in bf16 fp16; do python -m flashtriton bench --modes fwd --timing kernels --dtype \$dtype \
       --providers flashtriton,sdpa-flash,sdpa-cudnn,fa4 --out '$out/bench-fa4-'\$dtype || exit 1; done"
# SM clock and board power while the forward bench runs in bf16, then fp16 (nvidia-smi every 100 ms; the mean over
# samples above 300 W, i.e. under load): is fp16's ~3% deficit on the compute-bound rows, which cuDNN and FA4 share,
# the clock the GPU holds with fp16 operands?
step fp16-clocks 240 bash -c "for dtype in bf16 fp16; do
    nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 > '$out/clocks-'\$dtype.csv &
    sampler=\$!
    python -m flashtriton bench --modes fwd --timing kernels --dtype \$dtype --providers flashtriton,sdpa-cudnn \
      --out '$out/clocks-bench-'\$dtype > /dev/null 2>&1
    kill \$sampler
    awk -F', ' -v d=\$dtype '\$2 > 300 {c += \$1; p += \$2; n++} END {if (n) printf \"%s: %d samples under load, SM clock %.0f MHz, power %.0f W\\n\", d, n, c / n, p / n; else printf \"%s: no samples under load\\n\", d}' \
      '$out/clocks-'\$dtype.csv
  done"
# host time per eager call (profile of 300 warm calls) and the decode tile sweep, paged caches included
step host 60 python tools/profile_first_call.py --top 25 --steady 300
step decode-sweep 200 python benchmarks/bench_decode.py --paged 0,64,256 --graph --sweep
# backward with dQ by atomics against the current entry: d128 (4, 4096, 16) and d256 (4, 4096, 8)
step bwd-atomic 300 python benchmarks/sweep_configs.py --modes bwd --shapes 1,4 --bwd-candidates atomic --out "$out/bwd-atomic"
# forward tiles at 16x1024 (d128; never swept before: the short rows' config is the 4096 one) and 4x4096 for reference
step fwd-short 200 python benchmarks/sweep_configs.py --modes fwd --shapes 0,1 --out "$out/fwd-short"
# launch-order budgets (configs.L2_GROUP_BYTES), forward from CUDA graphs
step l2-groups 120 python benchmarks/sweep_l2_groups.py --graph --budgets-mib 0,4,8,16 --out "$out/l2-groups"
# the long fuzz on the GPU: the four fuzz tests side by side (one process each, logs fuzz-<test>.log; hopper_forward_domain
# draws only cases the Gluon forward covers), new random cases each run; hypothesis' statistics at the end of each
# log count the cases that ran
step fuzz 330 bash -c 'for t in flash_attn_func flash_attn_varlen_func flash_attn_with_kvcache hopper_forward_domain; do
    FLASHTRITON_FUZZ_EXAMPLES="${FUZZ_EXAMPLES:-120}" timeout 320 python -m pytest "tests/test_fuzz.py::test_fuzz_${t}" -q \
      -p no:cacheprovider --hypothesis-profile=long --hypothesis-show-statistics > "'"$out"'/fuzz-${t}.log" 2>&1 &
  done; wait; tail -n 15 "'"$out"'"/fuzz-*.log'
