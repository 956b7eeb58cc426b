#!/usr/bin/env bash
# Runs on the GPU machine (repo root): the expert kernel's tile choices on misses read from host memory, then the
# GPU tests named in $TESTS (a pytest -k expression; default: the suite).
# Usage: [TESTS=expr] bash scripts/device_host_reads.sh OUT_DIR
set -u
out=$1
export PYTHONUNBUFFERED=1
mkdir -p "$out"
timeout 200 python3 scripts/bench_kernels.py --out "$out/host_reads.json" --host-sweep 2>&1 | grep -v -i warn | cut -c1-220
timeout ${TEST_TIMEOUT:-330} python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider --durations=0 \
  ${TESTS:+-k "$TESTS"} > "$out/gpu_tests.txt" 2>&1
tail -25 "$out/gpu_tests.txt"
