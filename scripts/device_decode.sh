#!/usr/bin/env bash
# Runs on the GPU machine (repo root): the GPU tests, then the decode-compute rows (v2lite).
# Usage: bash scripts/device_decode.sh OUT_DIR [extra bench_gpu.py args...]
set -u
out=$1; shift
export PYTHONUNBUFFERED=1
mkdir -p "$out"
timeout 250 python3 -m pytest tests/test_gpu.py tests/test_layer_ops.py tests/test_kernels.py -q -x \
  -p no:cacheprovider > "$out/gpu_tests.txt" 2>&1
tail -3 "$out/gpu_tests.txt"
timeout 280 python3 scripts/bench_gpu.py --out "$out/bench_decode.json" --workloads v2lite --decode-compute \
  --profile "$@" 2>&1 | grep -v -i warning | grep -E '^\{|bench_gpu|Error|error' | cut -c1-300
