#!/usr/bin/env bash
# Runs on the GPU machine (repo root): the layer-streaming GPU tests (graph-captured copies, the device stall clock,
# the host embedding), then issue 20's rows on the V2-Lite shape: no_stream and stream8 at 12 GiB, min_budget, and
# 3 GiB with the engine's default context and batch.
# Usage: [SKIP_TESTS=1] [TESTS="-k ..."] bash scripts/device_streaming.sh OUT_DIR [extra bench_gpu.py args...]
set -u
out=$1; shift
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_streaming.py tests/test_transfer.py tests/test_kernels.py \
    -q -x -p no:cacheprovider --tb=short --durations=5 ${TESTS:--k "gpu or host_embedding"} 2>&1 | tail -${TEST_LINES:-30}
fi
timeout ${BENCH_TIMEOUT:-330} python3 scripts/bench_gpu.py --out "$out/bench_streaming.json" --workloads v2lite \
  --streaming "$@" 2>&1 | grep -v -i warning | grep -E '^\{|bench_gpu|Error|error' | cut -c1-300
