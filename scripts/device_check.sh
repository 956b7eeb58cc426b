#!/usr/bin/env bash
# Runs on the GPU machine (repo root): the GPU and kernel tests, then the kernel microbenchmarks into $OUT.
# Usage: bash scripts/device_check.sh OUT_DIR
set -u
out=$1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,driver_version --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 300 python3 -m pytest tests/test_gpu.py tests/test_kernels.py -q -x -p no:cacheprovider 2>&1 | tee "$out/tests.log" | tail -25
timeout 200 python3 scripts/bench_kernels.py --out "$out/kernels.json" 2>&1 | tail -30
