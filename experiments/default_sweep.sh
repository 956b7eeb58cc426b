#!/usr/bin/env bash
# The committed default sweep: the reference model on the CPU, 3 cache sizes x 7 predictors (lookahead 1), plus the
# look-ahead predictors at lookahead 2 and 4, the MTP ones chained to lookahead 2 and 3, and three predictors with a
# confidence cut of 0.1; 8 held-out prompts x 32 new tokens per point; then its report. About six and a half minutes
# on 2 cores (the committed run: 54 points in 6 min 17 s).
set -euo pipefail
cd "$(dirname "$0")/.."
out=experiments/results/sweep_reference
rm -rf "$out"
common=(hydra.sweep.dir="$out" hydra.output_subdir=null)
python experiments/sweep.py -m cache.fraction=0.125,0.25,0.5 \
  predictor=none,previous,next_layer_gate,mtp,mtp_router,mtp_gate,oracle "${common[@]}"
python experiments/sweep.py -m cache.fraction=0.125,0.25,0.5 predictor=next_layer_gate,oracle lookahead=2,4 \
  "${common[@]}"
python experiments/sweep.py -m cache.fraction=0.125,0.25,0.5 predictor=mtp,mtp_gate lookahead=2,3 "${common[@]}"
python experiments/sweep.py -m cache.fraction=0.125,0.25,0.5 predictor=mtp,mtp_gate,next_layer_gate \
  predictor.min_confidence=0.1 "${common[@]}"
find "$out" -mindepth 1 -type d -empty -delete
python experiments/report.py "$out/results.jsonl"
