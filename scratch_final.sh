#!/usr/bin/env bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHTRITON_COMMIT=${COMMIT}
unset TRITON_INTERPRET
t0=$(date +%s)
TESTS_LIMIT=420 OUT=$OUT bash tools/gpu_check.sh tests 2>&1 | tail -12; echo "tests done $(( $(date +%s)-t0 ))s"
timeout 130 python -m flashtriton bench --modes fwd,bwd,fwd+bwd --providers flashtriton,sdpa-flash,sdpa-cudnn --out $OUT/bench > $OUT/bench.log 2>&1; echo "bench rc $? $(( $(date +%s)-t0 ))s"
grep -v "^|---" $OUT/bench/bench.md | head -60
