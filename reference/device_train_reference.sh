#!/usr/bin/env bash
# Runs on the GPU machine: train + evaluate the reference model, pack it for the trip back, then GPU checks.
# Usage (repo root): bash reference/device_train_reference.sh CORPUS_DIR OUT_DIR
set -u
corpus=$1; out=$2
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 reference/train_reference.py --corpus "$corpus" --out /tmp/reference --device cuda \
  --batch-size 128 --seq-len 512 --train-tokens 80e6 --time-budget-s 200 --log-every 50 2>&1 | tee "$out/train.log" | tail -25
python3 reference/evaluate_reference.py --checkpoint /tmp/reference --corpus "$corpus" --device cuda 2>&1 | tail -15
cp /tmp/reference/eval.json /tmp/reference/training_log.json "$out/" 2>/dev/null
tar -C /tmp -cf - reference | split -b 15M - "$out/reference.tar.part-"
timeout 150 python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider 2>&1 | tail -15
timeout 120 python3 scripts/gpu_smoke.py /tmp/reference > "$out/smoke.json" 2> "$out/smoke.err"; tail -5 "$out/smoke.err"
python3 -c "import json; d=json.load(open('$out/smoke.json')); [print(r) for r in d['rows']]"
