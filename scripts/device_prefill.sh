#!/usr/bin/env bash
# Runs on the GPU machine (repo root): the prefill GPU tests, issue 15's prefill rows on the V2-Lite shape (with a
# kernel profile of the longest prompt), then the grouped-GEMM tile sweep.
# Usage: [SKIP_TESTS=1] [GROUPED_TOKENS=2048,8192] bash scripts/device_prefill.sh OUT_DIR [extra bench_gpu.py args...]
set -u
out=$1; shift
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider --durations=5 \
    -k "prefill or matches_cpu_in_fp32" 2>&1 | tail -4
fi
timeout ${BENCH_TIMEOUT:-250} python3 scripts/bench_gpu.py --out "$out/bench_prefill.json" --workloads v2lite --prefill \
  --prefill-lengths 512,2048,8192 --profile "$@" 2>&1 | grep -v -i warning \
  | grep -E '^\{|bench_gpu|Error|error' | cut -c1-260
timeout ${SWEEP_TIMEOUT:-80} python3 scripts/bench_kernels.py --out "$out/grouped.json" --grouped-sweep \
  --grouped-tokens ${GROUPED_TOKENS:-4096} 2>&1 \
  | grep -v -i warn | cut -c1-200
