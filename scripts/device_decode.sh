#!/usr/bin/env bash
# Runs on the GPU machine (repo root): the kernel tests, the decode-compute rows, then the expert-tile sweep.
# Usage: bash scripts/device_decode.sh OUT_DIR [extra bench_gpu.py args...]
set -u
out=$1; shift
export PYTHONUNBUFFERED=1
mkdir -p "$out"
timeout 150 python3 -m pytest tests/test_kernels.py tests/test_layer_ops.py -q -x -p no:cacheprovider 2>&1 | tail -4
timeout 330 python3 scripts/bench_gpu.py --out "$out/bench_decode.json" --workloads v2lite --decode-compute \
  --profile "$@" 2>&1 | grep -v -i warning | grep -E '^\{|bench_gpu|Error|error' | cut -c1-300
timeout 100 python3 scripts/bench_kernels.py --out "$out/tiles_h200.json" --tiles-sweep 2>&1 \
  | grep -v -i warn | cut -c1-160 | tail -40
