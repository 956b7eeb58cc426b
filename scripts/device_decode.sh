#!/usr/bin/env bash
# Runs on the GPU machine (repo root): the GPU tests (unless SKIP_TESTS=1), then the decode-compute and prefill rows.
# Usage: [SKIP_TESTS=1] bash scripts/device_decode.sh OUT_DIR [WORKLOAD] [extra bench_gpu.py args...]
# The GPU tests compile every kernel variant they meet (Triton 3.6 on the H200: ~5-15 s each) and took over 250 s
# with the fused kernels in the session that added them: give them a call of their own.
set -u
out=$1; workload=${2:-v2lite}; shift; shift || true
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 500 python3 -m pytest tests/test_gpu.py tests/test_layer_ops.py tests/test_kernels.py -q -x \
    -p no:cacheprovider > "$out/gpu_tests.txt" 2>&1
  tail -3 "$out/gpu_tests.txt"
fi
timeout 540 python3 scripts/bench_gpu.py --out "$out/bench_decode.json" --workloads "$workload" --decode-compute \
  --profile "$@" 2>&1 | grep -v -i warning | grep -E '^\{|bench_gpu|Error|error' | cut -c1-300
