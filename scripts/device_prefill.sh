#!/usr/bin/env bash
# Runs on the GPU machine (repo root): the prefill GPU test, then issue 15's prefill rows on the V2-Lite shape.
# Usage: bash scripts/device_prefill.sh OUT_DIR [extra bench_gpu.py args...]
set -u
out=$1; shift
export PYTHONUNBUFFERED=1
mkdir -p "$out"
timeout 120 python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider -k prefill_staging 2>&1 | tail -3
timeout 480 python3 scripts/bench_gpu.py --out "$out/bench_prefill.json" --workloads v2lite --prefill \
  --prefill-lengths 512,2048,8192 --prefill-chunks 512,2048,8192 "$@" 2>&1 | grep -v -i warning \
  | grep -E '^\{|bench_gpu|Error|error' | cut -c1-300
