#!/usr/bin/env bash
# Runs on the GPU machine (repo root): GPU tests, then the benchmark; JSON is written as rows finish.
# Usage: bash scripts/device_bench.sh OUT_DIR WORKLOADS [extra bench_gpu.py args...]
set -u
out=$1; workloads=$2; shift 2
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,driver_version --format=csv
timeout 170 python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider 2>&1 | tail -8
python3 scripts/bench_gpu.py --out "$out/bench_h200.json" --workloads "$workloads" "$@" 2>&1 \
  | grep -v -i warning | grep -E '^\{|bench_gpu|Error|error' | cut -c1-400
