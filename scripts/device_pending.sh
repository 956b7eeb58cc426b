#!/usr/bin/env bash
# Runs on the GPU machine (repo root): the measurements this code still owes, one stage per device call (each fits a
# 10-minute call). STAGE=qwen3: issue 17's qwen3_30b rows (the whole 48-layer shape, FP8 experts as published, 12
# GiB); STAGE=serve: issue 19's serving rows (V2-Lite, 12 GiB, 1/4/16 streams); STAGE=lead: issue 21's ref17 rows with
# MTP drafts chained 1-3 tokens ahead; STAGE=tests: the GPU tests of the latest code (it outran 450 s with a cold
# Triton cache this session, when it still ran the sm_90 compile checks); STAGE=batches / offloaded_batches: issue
# 14's batch rows, every expert resident / at 12 GiB; STAGE=cuts: issue 13's ref17 rows at the confidence cuts that
# keep prefetch waste under 20 % on the CPU; STAGE=leads / leads_v2lite: issue 13's rows at prefetch leads of 1, 2, 4
# MoE layers and no limit (ref17; V2-Lite at 12 GiB; ran in the ninth session, which made no limit the default);
# STAGE=timelines / timelines_v2lite: issue 13's CUDA-trace timelines with LRFU (ref17; V2-Lite at 12 GiB, then
# zero-copy reads with cold translations); STAGE=policies: issue 13's LRU / LRFU / LFU rows (ref17, V2-Lite) and the
# GPU token test across policies; STAGE=distributed (on nvidia-h200-x2): issue 18's two-GPU test and rows (one GPU,
# then two, at 12 GiB per GPU and 12 GiB split). LIMIT overrides the time limit of the bench stages that read it.
# Usage: STAGE=qwen3|serve|serve_all|joint_prefill|joint_launch|gemv_rows|batched_reads|verify|spec_deep|deep_model|shared_rows|shared_rows_deep|batch_shapes|spec_ref17|spec_v2lite|lead|tests|batches|offloaded_batches|cuts|leads|leads_v2lite|policies|timelines| \
#   timelines_v2lite|distributed|deep_train|deep_bench|deep_fp8|fp8_reads|v2lite_trace|int4_tests|int4_bench| \
#   int4_gemv|learned_deep|divergence|table_stress|sparing|learned_rows|timelines_deep \
#   [LIMIT=seconds] \
#   bash scripts/device_pending.sh OUT_DIR [bench options]
# Triton's compile cache travels between calls of a session (a cold cache cost the tests stage its whole 450 s
# this session): a call restores .devcache/triton_cache.tgz.part* when present (copy the parts that the last call
# returned there and carry .devcache), and returns the cache in 15 MB parts (files back are 16 MiB at most).
set -u
out=$1; shift
export PYTHONUNBUFFERED=1
mkdir -p "$out" .devcache
export TRITON_CACHE_DIR=$PWD/.devcache/triton
if [ ! -d "$TRITON_CACHE_DIR" ] && ls .devcache/triton_cache.tgz.part* > /dev/null 2>&1; then
  cat .devcache/triton_cache.tgz.part* | tar xzf - -C .devcache
fi
# every pytest run also writes a JUnit XML report into the output folder (pytest_*.xml: each test's outcome and
# failure text), because a call returns only the last 12,000 characters of its output (the fourteenth session
# lost a GPU test run's result that way)
junit() { echo "--junitxml=$out/pytest_$RANDOM$RANDOM.xml"; }
# NO_CACHE=1: keep the cache on the (warm) machine only, when the call returns other large files
save_cache() { [ -z "${NO_CACHE:-}" ] && [ -d "$TRITON_CACHE_DIR" ] && tar czf - -C .devcache triton | split -b 15M - "$out/triton_cache.tgz.part"; }
trap save_cache EXIT
filter() { grep -v -E "Warning:|warnings.warn" | grep -E '^\{|bench_gpu|bench_serve|Error|error|passed|failed' | cut -c1-300; }
train_deep() {  # the deep benchmark model into .device-data/deep (TRAIN_S seconds of training)
  timeout 260 python3 reference/train_reference.py --preset deep --corpus .device-data/corpus_min \
    --out .device-data/deep --device cuda --batch-size 128 --seq-len 512 --train-tokens 200e6 \
    --time-budget-s "${TRAIN_S:-150}" --log-every 50 --no-progress 2>&1 | grep -E "parameters|step [0-9]*0 |saved|Error"
  cp .device-data/deep/training_log.json "$out/deep_training_log.json" 2>/dev/null
}
case "${STAGE:-tests}" in
  qwen3)
    timeout 560 python3 scripts/bench_gpu.py --out "$out/bench_qwen3.json" --workloads qwen3_30b \
      --systems all_resident,none,next_layer_gate,oracle --runs 2 "$@" 2>&1 | filter ;;
  serve)
    # issue 40's rows (carry .whl: the device lacks uvicorn and starlette). Owed after the twenty-first session:
    # `--expert-dtype int4` again (one HTTP client per client process now), bf16 (`--concurrency 1,4,16`), and the
    # real trace forced (`--routing-trace .device-data/traces/nvmoe-dsv2lite-a.tokens.jsonl`, carry that folder)
    timeout "${LIMIT:-560}" python3 scripts/bench_serve.py --out "$out/serve_h200.json" "$@" 2>&1 | filter ;;
  verify)
    # issue 39's verify_confidence on the GPU: its test and the engine's tokens across cache sizes and continuous
    # batching, then ref17's rows at 25 % cached: reactive, speculation checking every draft and from 0.3 / 0.5 / 0.7
    timeout "${TESTS_S:-200}" python3 -m pytest "$(junit)" tests/test_gpu.py -q -p no:cacheprovider --tb=short \
      -k "verify_confidence or cache_sizes or continuous" 2>&1 | tail -5
    timeout "${LIMIT:-200}" python3 scripts/bench_gpu.py --out "$out/bench_verify.json" --workloads ref17 --runs 3 \
      --systems all_resident,none,speculative_mtp,speculative_mtp~verify0.3,speculative_mtp~verify0.5,speculative_mtp~verify0.7 \
      "$@" 2>&1 | filter ;;
  serve_all)
    # issue 40's three serving workloads in one call over one random checkpoint (written once): int4 (every expert
    # resident at 12 GiB), bf16 at 12 GiB, and bf16 with the real V2-Lite trace forced (carry .whl and
    # .device-data/traces); each level beside the engine's own batches. INT4_S / BF16_S / TRACE_S bound each run.
    # The twenty-eighth session's bf16 run (BF16_S=290, 2 requests a client) ended before the engine's rows: bf16
    # runs one request a client (BF16_REQUESTS), which took 5 / 26 / 94 s at 1 / 4 / 16 streams on the H100 and the
    # engine's rows as long again; BF16_LEVELS picks the stream counts of both bf16 runs. The thirty-first session
    # measured every level (BENCHMARKS "Serving"); still owed: the int4 levels again with `757f07f` (each arrival
    # extends the idle server's gathering wait; the rows now carry admitted_together_share), whose 4-stream server
    # was 12.6 % behind the engine with one 2 ms wait, and the bf16 trace run at 1 stream with the new scheduler
    # PARTS picks the runs (int4,bf16,trace: all three by default; two calls fit them where one does not);
    # TRACE_LEVELS the trace run's stream counts (BF16_LEVELS by default)
    python3 -m pip install -q --no-index --find-links .whl uvicorn starlette httpx 2>&1 | grep -v "root. user" | tail -2
    python3 -c "import uvicorn, starlette, httpx" || echo "the serving packages did not install"
    parts=",${PARTS:-int4,bf16,trace},"
    [[ $parts == *,int4,* ]] && timeout "${INT4_S:-170}" python3 scripts/bench_serve.py --expert-dtype int4 \
      --out "$out/serve_int4.json" "$@" 2>&1 | filter
    [[ $parts == *,bf16,* ]] && timeout "${BF16_S:-200}" python3 scripts/bench_serve.py \
      --requests-per-client "${BF16_REQUESTS:-1}" --concurrency "${BF16_LEVELS:-1,4,16}" --out "$out/serve_bf16.json" \
      "$@" 2>&1 | filter
    [[ $parts == *,trace,* ]] && timeout "${TRACE_S:-180}" python3 scripts/bench_serve.py \
      --requests-per-client "${BF16_REQUESTS:-1}" --concurrency "${TRACE_LEVELS:-${BF16_LEVELS:-1,4,16}}" \
      --out "$out/serve_bf16_trace.json" --routing-trace .device-data/traces/nvmoe-dsv2lite-a.tokens.jsonl "$@" \
      2>&1 | filter
    true ;;
  joint_launch)
    # the thirty-second session's joint launches (every expert resident, Triton's grouped kernel: a window's chunks
    # that take the same tiles in one launch): their bits against each chunk alone on CUDA (int4, FP8), the engine's
    # tokens across cache sizes, then prompts prefilled together with and without them (int4, 12 GiB). Ran in the
    # thirty-third session (H100: 1.39 / 1.71 x at 4 / 16 prompts, bits kept; BENCHMARKS "Serving")
    timeout "${TESTS_S:-230}" python3 -m pytest "$(junit)" tests/test_prefill.py tests/test_gpu.py -q \
      -p no:cacheprovider --tb=short -k "joined_in_one or share_prefill or cache_sizes or synchronises" 2>&1 \
      | grep -v -E "Warning:|warnings.warn" | tail -15
    timeout "${LIMIT:-200}" python3 scripts/bench_joint_prefill.py --out "$out/joint_prefill.json" "$@" 2>&1 \
      | grep -E '^\{|Error|error' ;;
  joint_prefill)
    # the thirtieth session's joint prefill and admission on CUDA (prompts sharing prefill windows keep the bits and
    # tokens each gets alone), with the engine's tokens across cache sizes (its batch of 4 prefills together)
    timeout "${TESTS_S:-240}" python3 -m pytest "$(junit)" tests/test_prefill.py tests/test_gpu.py -q \
      -p no:cacheprovider --tb=short -k "share_prefill or admitted_together or cache_sizes" 2>&1 \
      | grep -v -E "Warning:|warnings.warn" | tail -15 ;;
  lead)
    timeout 560 python3 scripts/bench_gpu.py --out "$out/bench_lead.json" --workloads ref17 \
      --systems all_resident,none,mtp,mtp_la2,mtp_la3,mtp+next_layer_gate,mtp+next_layer_gate_la2,mtp+next_layer_gate_la3 \
      "$@" 2>&1 | filter ;;
  tests)
    # the engine's tokens across cache sizes and policies, syncs, continuous batching first (with a cold Triton
    # cache, the ninth session's call ran out of time in the kernel tests and never reached them); then the expert
    # kernel's tiles, the fused GQA decode attention and the plan kernel's blocked reservation. Not the sm_90 compile
    # checks: they need no GPU, run in CI, and take minutes of the device's CPU. pytest's own output, not a tail: a
    # killed pipeline prints nothing.
    timeout 300 python3 -m pytest "$(junit)" tests/test_gpu.py -k "continuous or synchronises or cache_sizes" -q \
      -p no:cacheprovider --tb=short --durations=4 "$@" 2>&1 | grep -v -E "Warning:|warnings.warn"
    timeout 240 python3 -m pytest "$(junit)" tests/test_kernels.py tests/test_layer_ops.py -q -p no:cacheprovider --tb=short \
      -k "not compile_for_hopper and not does_not_spill" "$@" 2>&1 | grep -v -E "Warning:|warnings.warn" ;;
  cuts)
    # issue 13: ref17 at 25 % cached with the confidence cuts that hold prefetch waste under 20 % in the CPU counts
    # (BENCHMARKS "Recall and waste together"), beside reactive, the uncut predictors and the oracle
    timeout 560 python3 scripts/bench_gpu.py --out "$out/bench_cuts.json" --workloads ref17 --min-confidence 0.05,0.2 \
      --systems all_resident,none,next_layer_gate,mtp,mtp@0.05,mtp+next_layer_gate,mtp+next_layer_gate@0.2,oracle \
      "$@" 2>&1 | filter ;;
  leads)
    # issue 13: when fills are reserved (prefetch_lead), on ref17's learned routing: reactive, the oracle and the
    # MTP predictors at the cuts that keep waste under 20 % (CPU), at a lead of 4 (the plain rows) and 1, 2, no limit
    timeout 560 python3 scripts/bench_gpu.py --out "$out/bench_leads.json" --workloads ref17 --min-confidence 0.05,0.2 \
      --systems all_resident,none,oracle,mtp@0.05,mtp+next_layer_gate@0.2,mtp+next_layer_gate --prefetch-lead 4 \
      --lead-rows 1,2,0 \
      "$@" 2>&1 | filter ;;
  leads_v2lite)
    timeout 560 python3 scripts/bench_gpu.py --out "$out/bench_leads_v2lite.json" --workloads v2lite \
      --systems all_resident,none,oracle,next_layer_gate --prefetch-lead 4 --lead-rows 1,0 --runs 2 "$@" 2>&1 | filter ;;
  policies)
    # issue 13: LRU against LRFU (and LFU) on ref17's learned routing and V2-Lite's random routing; every row checks
    # its tokens against all-resident; then the GPU token test across cache sizes and policies
    timeout 200 python3 scripts/bench_gpu.py --out "$out/bench_policies.json" --workloads ref17 --runs 1 \
      --min-confidence 0.05,0.2 --systems all_resident,none,oracle,next_layer_gate,mtp@0.05,mtp+next_layer_gate@0.2 \
      --policy-rows lrfu,lfu "$@" 2>&1 | filter
    timeout 230 python3 scripts/bench_gpu.py --out "$out/bench_policies_v2lite.json" --workloads v2lite --runs 1 \
      --systems all_resident,none,next_layer_gate --policy-rows lrfu "$@" 2>&1 | filter
    timeout 110 python3 -m pytest "$(junit)" tests/test_gpu.py -k "cache_sizes" -q -p no:cacheprovider --tb=short 2>&1 | tail -6 ;;
  batch_shapes)
    # owed since the twenty-eighth session, which shaped the steps of a checkpoint without an MTP layer for its real
    # rows alone (batch 1: a one-row GEMV; batch 16: 16-row tiles) and gave tiles wider than 16 rows one pipeline
    # stage: their kernel tests on the GPU, the engine's tokens across cache sizes and continuous batches, then
    # V2-Lite's offloaded batches 1/4/16 with timelines (the tenth session's: 39.4 / 305.3 / 1,060.7 ms a step)
    timeout 200 python3 -m pytest "$(junit)" tests/test_kernels.py -q -p no:cacheprovider --tb=short \
      -k "one_row_step or measured_tiles or routed_experts_match or gumbel" 2>&1 | tail -3
    timeout 150 python3 -m pytest "$(junit)" tests/test_gpu.py -q -p no:cacheprovider --tb=short \
      -k "continuous or cache_sizes or sampling_kernel" 2>&1 | tail -3
    timeout "${LIMIT:-230}" python3 scripts/bench_gpu.py --out "$out/bench_batch_shapes.json" --workloads v2lite \
      --decode-compute --prefill-lengths "" --new-tokens 16 --profile \
      --systems offloaded_b1,offloaded_b4,offloaded_b16 "$@" 2>&1 | filter ;;
  gemv_rows)
    # the twenty-ninth session's batch-1 regression: one-row GEMV programs (the twenty-eighth session's steps of a
    # checkpoint without an MTP layer) read V2-Lite's misses from host at 22.8 GB/s against 40.0. The host reads of
    # one layer at 1 and 2 rows a program, the one-row kernel test, the engine's tokens across cache sizes, then
    # V2-Lite's offloaded batch-1 row with GEMV_MIN_ROWS = 2 (70.2 ms a token on the H100 with one-row programs)
    for rows in 1 2; do
      timeout 120 python3 scripts/bench_kernels.py --host-sweep --step-rows 1 --missed 0,6 --tiles "16,16,128,4,3" \
        --gemv-min-rows $rows --out "$out/host_gemv_min_rows_$rows.json" 2>&1 | grep -E "^\{|Error" | cut -c1-300
    done
    timeout 120 python3 -m pytest "$(junit)" tests/test_kernels.py tests/test_gpu.py -q -p no:cacheprovider \
      --tb=short -k "one_row_step or cache_sizes" 2>&1 | tail -3
    timeout "${LIMIT:-200}" python3 scripts/bench_gpu.py --out "$out/bench_gemv_rows.json" --workloads v2lite \
      --decode-compute --prefill-lengths "" --new-tokens 16 --profile --systems offloaded_b1 "$@" 2>&1 | filter ;;
  batched_reads)
    # the thirtieth session's question: do the expert kernel's steps of several rows read host memory as slowly
    # alone as in the engine (24 GB/s from batch 4 on, twenty-ninth session)? Steps of 1-16 randomly routed rows,
    # 70 % of each layer's experts read in place; then V2-Lite's offloaded batches 1/4/16 with an MTP layer (owed)
    timeout 150 python3 scripts/bench_kernels.py --host-sweep --sequences 1,2,4,8,16 --out "$out/batched_reads.json" \
      2>&1 | grep -E "^\{|Error" | cut -c1-300
    # compiled for sm_90 (Triton 3.9, cuobjdump), the 4-row GEMV's gate/up program holds 200 registers (2 programs
    # of 4 warps an SM) against 128 at 1-2 rows; these tiles hold 69-110
    timeout 150 python3 scripts/bench_kernels.py --host-sweep --sequences 4 --out "$out/batched_reads_tiles.json" \
      --tiles "16,16,128,4,3;8,8,128,4,3;16,16,128,8,3;16,16,64,4,3;8,8,64,4,3" 2>&1 | grep -E "^\{|Error" | cut -c1-300
    timeout "${LIMIT:-330}" python3 scripts/bench_gpu.py --out "$out/bench_offloaded_mtp.json" --workloads v2lite \
      --decode-compute --prefill-lengths "" --new-tokens 16 --profile --mtp-layer \
      --systems offloaded_b1,offloaded_b4,offloaded_b16 "$@" 2>&1 | filter ;;
  offloaded_batches)
    # issue 14's offloaded batch rows (V2-Lite at 12 GiB, batch 1/4/8/16, reactive and next_layer_gate). The tenth
    # session's reactive rows read host memory at 24 GB/s from batch 4 on (40 at batch 1, 50 in isolation). Owed
    # since the twenty-eighth session, which shaped a checkpoint without an MTP layer's steps for its real rows
    # alone and gave tiles wider than 16 rows one stage; the twenty-ninth measured batches 1/4/16 without an MTP
    # layer (STAGE=batch_shapes, then STAGE=gemv_rows). Still owed: the same with --mtp-layer (32-row tiles at
    # batch 16), `--systems offloaded_b1,offloaded_b4,offloaded_b16 --mtp-layer --profile`
    timeout "${LIMIT:-560}" python3 scripts/bench_gpu.py --out "$out/bench_offloaded_batches.json" --workloads v2lite \
      --decode-compute --prefill-lengths "" --systems "$(echo offloaded{,_gate}_b{1,4,8,16} | tr ' ' ,)" \
      "$@" 2>&1 | filter ;;
  timelines)
    # issue 13's closing timeline: where an offloaded ref17 token's time goes with the default policy (LRFU):
    # reactive, the oracle and the MTP predictor at the cut that kept waste under 20 % in the CPU counts (23 % on the
    # H200 in the tenth session), each traced once (the MTP trace uncut)
    timeout "${LIMIT:-560}" python3 scripts/bench_gpu.py --out "$out/bench_timelines.json" --workloads ref17 \
      --min-confidence 0.05 --systems all_resident,none,oracle,mtp@0.05 --profile \
      --profile-predictors none,oracle,mtp "$@" 2>&1 | filter ;;
  timelines_v2lite)
    # the same for V2-Lite at 12 GiB (reactive and the oracle), then zero-copy reads over a 26 GiB arena with the
    # experts changing every replay (cold address translations), which decode's misses see and isolated runs do not
    timeout "${LIMIT:-300}" python3 scripts/bench_gpu.py --out "$out/bench_timelines_v2lite.json" --workloads v2lite \
      --runs 1 --systems all_resident,none,oracle --profile --profile-predictors none,oracle "$@" 2>&1 | filter
    timeout 100 python3 scripts/arena_reads.py --out "$out/arena_reads_h200.json" 2>&1 | grep -v -i warn | tail -8 ;;
  batches)
    # issue 14's batch rows (V2-Lite, every expert resident, batch 1/4/8/16) with the step timelines of 1 and 8
    timeout 330 python3 scripts/bench_gpu.py --out "$out/bench_batches.json" --workloads v2lite --decode-compute \
      --profile --systems all_resident_b1,all_resident_b4,all_resident_b8,all_resident_b16 --prefill-lengths "" \
      "$@" 2>&1 | filter ;;
  deep_train)
    # issue 36's deep benchmark model (reference/train_reference.py --preset deep: 26 MoE layers of 64 experts top-6,
    # 2 shared, an MTP layer) trained on the project's corpus (.device-data/corpus_min: train/held-out ids and the
    # tokenizer, carried) into .device-data/deep, returned in 15 MB parts (it stays there for the next call while the
    # machine is warm; reference/deep_model keeps the measured one's card), then the GPU tests of issue 36's paths
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current --format=csv,noheader
    train_deep
    tar -C .device-data -cf - deep | split -b 15M - "$out/deep.tar.part-"
    timeout 280 python3 -m pytest "$(junit)" tests/test_gpu.py -k "cache_sizes or idle_link or synchronises" -q \
      -p no:cacheprovider --tb=short --durations=5 2>&1 | grep -v -E "Warning:|warnings.warn"
    timeout 60 python3 reference/evaluate_reference.py --checkpoint .device-data/deep --corpus .device-data/corpus_min \
      --device cuda --max-tokens 100000 2>&1 | tail -3
    cp .device-data/deep/eval.json "$out/deep_eval.json" 2>/dev/null ;;
  learned_deep)
    # issue 38 on the deep model: train it (150 s) when .device-data/deep holds none, record its routing (bf16, as
    # decode runs) over 600k training tokens on the GPU and train its routing head (HEAD_LEADS tokens ahead, a
    # HEAD_HORIZON-token "needed soon" block for victims; 1 and 8 by default, the best pair on the CPU, 36th session; HEAD_HIDDEN_ONLY=1: the final hidden state only, so decode
    # runs no MTP link for it) next to it, evaluated on 160k held-out tokens; the learned predictor's GPU tests; the
    # model and head come back in 15 MB parts. (The thirteenth session's call needed PYTHONPATH for the script.)
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current --format=csv,noheader
    [ -f .device-data/deep/model.safetensors.index.json ] || train_deep
    PYTHONPATH=$PWD timeout 300 python3 experiments/learned_predictor_reference.py --checkpoint .device-data/deep \
      --device cuda --corpus .device-data/corpus_min --leads "${HEAD_LEADS:-1}" --horizon "${HEAD_HORIZON:-8}" \
      --steps "${HEAD_STEPS:-3000}" --threads 8 ${HEAD_HIDDEN_ONLY:+--no-mtp} \
      --head .device-data/deep/routing_head.safetensors --out "$out/learned_predictor_deep.json" 2>&1 | \
      grep -v -E "Warning:|warnings.warn" | tail -14
    tar -C .device-data -cf - deep | split -b 15M - "$out/deep.tar.part-"
    timeout 200 python3 -m pytest "$(junit)" tests/test_gpu.py -q -p no:cacheprovider --tb=short -k learned 2>&1 | \
      grep -v -E "Warning:|warnings.warn" | tail -5 ;;
  deep_bench)
    # issue 36's rows on the deep model, experts padded to 17.3 MB, at --cache-fraction (bench options follow); the
    # model is trained first when .device-data/deep holds none (carry .device-data/corpus_min then) and comes back in
    # 15 MB parts; TESTS="pytest -k expression": those GPU tests afterwards
    [ -f .device-data/deep/model.safetensors.index.json ] || \
      { train_deep; tar -C .device-data -cf - deep | split -b 15M - "$out/deep.tar.part-"; }
    # sampled (TEMPERATURE, 1.0 by default): the small model's greedy continuations loop, and a loop's routing is far
    # more cacheable than text's (CPU, bf16, 518 slots, 128 new tokens: 50-53 reactive misses per token greedy, 57-63
    # sampled at 1.0, 60 on teacher-forced held-out text; the fourteenth session's greedy H200 rows missed 24.6)
    timeout "${LIMIT:-560}" python3 scripts/bench_gpu.py --out "$out/bench_deep.json" --workloads deep --runs "${RUNS:-1}" \
      --temperature "${TEMPERATURE:-1.0}" "$@" 2>&1 | filter
    [ -n "${TESTS:-}" ] && timeout "${TESTS_LIMIT:-150}" python3 -m pytest "$(junit)" tests/test_gpu.py -q -p no:cacheprovider \
      --tb=short -k "$TESTS" 2>&1 | grep -v -E "Warning:|warnings.warn" | tail -6 ;;
  spec_deep)
    # issue 39 on the deep model: plain decode against speculation checking every draft, chains of 2 and 3 drafts
    # and verify_confidence cuts, every expert resident, then at 30 % cached (greedy; TEMPERATURE to sample), with
    # the kernel timelines of a plain and a verify step. The model is trained
    # first when .device-data/deep holds none (carry .device-data/corpus_min, built offline by
    # reference/build_corpus.py) and comes back in 15 MB parts.
    [ -f .device-data/deep/model.safetensors.index.json ] || \
      { train_deep; tar -C .device-data -cf - deep | split -b 15M - "$out/deep.tar.part-"; }
    timeout "${LIMIT:-330}" python3 scripts/bench_gpu.py --out "$out/bench_spec_deep.json" --workloads deep \
      --runs "${RUNS:-3}" --temperature "${TEMPERATURE:-0}" --cache-fraction 0.3 --variant speculation \
      --systems "${SYSTEMS:-all_resident,all_resident_speculative,all_resident_speculative~drafts2,all_resident_speculative~drafts3,all_resident_speculative~verify0.3,none,speculative_mtp,speculative_mtp~drafts2,speculative_mtp~verify0.3,speculative_mtp~verify0.5}" \
      --profile --profile-predictors none,speculative_mtp "$@" 2>&1 | filter
    # chained drafts on the GPU (3 and 4 rows a sequence): the tokens against plain decode's
    timeout "${TESTS_S:-90}" python3 -m pytest "$(junit)" tests/test_gpu.py -q -p no:cacheprovider --tb=short \
      -k "chained_drafts" 2>&1 | tail -3
    # (EMBED_TEST=1) the GPU test of an embedding table in host memory
    [ -n "${EMBED_TEST:-}" ] && timeout "${TESTS_S:-90}" python3 -m pytest "$(junit)" tests/test_streaming.py -q \
      -p no:cacheprovider --tb=short -k "embedding_table_in_host_memory" 2>&1 | tail -3 ;;
  deep_model)
    # the deep benchmark model alone (trained when .device-data/deep holds none; carry .device-data/corpus_min), so a
    # later call on the warm machine (or carrying the returned parts) benchmarks it without training first
    [ -f .device-data/deep/model.safetensors.index.json ] || \
      { train_deep; tar -C .device-data -cf - deep | split -b 15M - "$out/deep.tar.part-"; } ;;
  deep_fp8)
    # issue 36's FP8 aim on the deep model (never measured before the thirty-fourth session): trained first when
    # .device-data/deep holds none (carry .device-data/corpus_min); experts padded to 17.3 MB in bf16, quantised to
    # FP8 on load (8.65 MB records), 30 % cached, sampled at 1.0; SYSTEMS overrides the rows, EXPERT_DTYPE=int4 for
    # the 4-bit rows
    [ -f .device-data/deep/model.safetensors.index.json ] || \
      { train_deep; tar -C .device-data -cf - deep | split -b 15M - "$out/deep.tar.part-"; }
    timeout "${LIMIT:-500}" python3 scripts/bench_gpu.py --out "$out/bench_deep_${EXPERT_DTYPE:-fp8}.json" \
      --workloads deep --runs "${RUNS:-1}" --temperature "${TEMPERATURE:-1.0}" --cache-fraction 0.3 \
      --expert-dtype "${EXPERT_DTYPE:-fp8}" \
      --systems "${SYSTEMS:-all_resident,none,oracle_next~idle,mtp+next_layer_gate~idle,mtp~idle,oracle}" "$@" \
      2>&1 | filter ;;
  sparing)
    # issue 36 after oracle_next stopped sparing recent experts (thirty-fifth session, `26af468`; that session's one
    # call ended after the FP8 reactive row, so these are owed): the 8-bit kernel tests (256-wide gemv_8bit), then
    # the deep model at 30 % cached, sampled at 1.0, with FP8 experts and in bf16: reactive, the one-token oracle
    # with and without yielding the link, the best MTP row and the full oracle (carry .device-data/deep; FP8_S
    # bounds the FP8 rows, the bf16 rows take the rest). The bf16 rows end with protection only (no fills): the
    # learned head (thirty-sixth session's, horizon 8, trained on the CPU: .device-data/deep/routing_head.safetensors)
    # with and without bypass, and the MTP shadow row, which on the CPU moved 12.3 %, 11.7 % and 3.4 % fewer experts
    # than reactive. Carry .device-data/deep with that head only: the tree and the model with the session's three
    # other heads beside it (routing_head_h0/h16/l2h8) pass the 64 MiB carry limit
    t0=$(date +%s)
    timeout 150 python3 -m pytest "$(junit)" tests/test_kernels.py -q -p no:cacheprovider --tb=short -x \
      -k "fp8 or int8 or 8bit or eight" 2>&1 | grep -v -E "Warning:|warnings.warn" | tail -4
    timeout 50 python3 -m pytest "$(junit)" tests/test_gpu.py -q -p no:cacheprovider --tb=short -k dequantisation 2>&1 | \
      tail -2
    timeout "${FP8_S:-230}" python3 scripts/bench_gpu.py --out "$out/bench_deep_fp8.json" --workloads deep --runs 1 \
      --temperature 1.0 --cache-fraction 0.3 --expert-dtype fp8 \
      --systems all_resident,none,oracle_next~idle,oracle_next,mtp+next_layer_gate~idle,oracle 2>&1 | filter
    timeout $(( ${LIMIT:-575} - ($(date +%s) - t0) )) python3 scripts/bench_gpu.py --out "$out/bench_deep.json" \
      --workloads deep --runs 1 --temperature 1.0 --cache-fraction 0.3 \
      --systems all_resident,none,oracle_next~idle,oracle_next,oracle,learned~budget0~reuse0.7,mtp~budget0,\
learned~budget0~reuse0.7~bypass,mtp+next_layer_gate~idle 2>&1 | filter ;;
  learned_rows)
    # issues 36 and 38 (thirty-seventh session): the deep model at 30 % cached, sampled at 1.0, after that session's
    # first call measured the learned head's protection in bf16 (25.67 ms against reactive 27.75, H100): the head's
    # confident predictions also filled into idle link time (cuts 0.6 and 0.8, beside protection and bypass), then
    # the FP8 rows with every predictor kind (carry .device-data/deep with its one head, routing_head.safetensors)
    t0=$(date +%s)
    timeout "${BF16_S:-200}" python3 scripts/bench_gpu.py --out "$out/bench_deep_learned.json" --workloads deep \
      --runs 1 --temperature 1.0 --cache-fraction 0.3 \
      --systems all_resident,learned~idle~fill0.6~reuse0.7~bypass,learned~idle~fill0.8~reuse0.7~bypass 2>&1 | filter
    timeout $(( ${LIMIT:-560} - ($(date +%s) - t0) )) python3 scripts/bench_gpu.py --out "$out/bench_deep_fp8.json" \
      --workloads deep --runs 1 --temperature 1.0 --cache-fraction 0.3 --expert-dtype fp8 \
      --systems all_resident,none,learned~budget0~reuse0.7~bypass,learned~idle~fill0.6~reuse0.7~bypass,\
oracle_next~idle,oracle,mtp~budget0 2>&1 | filter ;;
  timelines_deep)
    # issue 36's split of a token's time (thirty-seventh session): the deep model at 30 % cached, bf16, sampled at
    # 1.0: CUDA-trace timelines of reactive, the learned head protecting (the fastest real row), the MTP shadow row
    # protecting (3 ms a token slower than reactive though it misses fewer experts), the one-token oracle
    # filling on the idle link and the full oracle; then the 60 % cached rows (carry .device-data/deep with its head)
    t0=$(date +%s)
    timeout "${TIMELINE_S:-300}" python3 scripts/bench_gpu.py --out "$out/bench_deep_timelines.json" --workloads deep \
      --runs 1 --temperature 1.0 --cache-fraction 0.3 --systems all_resident,none --profile \
      --profile-predictors "${PROFILE:-none,learned~budget0~reuse0.7~bypass,mtp~budget0,oracle_next~idle,oracle}" 2>&1 | filter
    timeout $(( ${LIMIT:-560} - ($(date +%s) - t0) )) python3 scripts/bench_gpu.py --out "$out/bench_deep_60.json" \
      --workloads deep --runs 1 --temperature 1.0 --cache-fraction 0.6 \
      --systems all_resident,none,learned~budget0~reuse0.7~bypass,oracle_next~idle,oracle 2>&1 | filter ;;
  fp8_reads)
    # FP8 experts read in place over PCIe and from VRAM (thirty-fourth session; its first deep FP8 rows read misses at
    # 29 GB/s, which turned out to be that machine's link). One layer's GEMV (2-row step) at the deep model's padded
    # shape and at V2-Lite's, 128- and 256-wide reductions, with this tree's kernel and, when OLD_EXPERTS names an
    # earlier kernels/experts.py (an untracked copy), with that one; then the FP8 kernel tests and the deep model's
    # FP8 rows (carry .device-data/deep)
    for version in new ${OLD_EXPERTS:+old}; do
      if [ "$version" = old ]; then
        cp moeprefetch/kernels/experts.py /tmp/experts_new.py; cp "$OLD_EXPERTS" moeprefetch/kernels/experts.py
      fi
      for shape in deep v2lite; do
        timeout 90 python3 scripts/bench_kernels.py --host-sweep --shape "$shape" --expert-dtype fp8 --step-rows 2 \
          --tiles "16,16,128,4,3;16,16,256,4,3" --out "$out/host_fp8_${shape}_$version.json" 2>&1 | \
          grep -E "^\{|Error" | cut -c1-220
      done
    done
    [ -n "${OLD_EXPERTS:-}" ] && cp /tmp/experts_new.py moeprefetch/kernels/experts.py
    timeout 120 python3 -m pytest "$(junit)" tests/test_kernels.py -q -p no:cacheprovider --tb=short -k "fp8" 2>&1 | \
      grep -v -E "Warning:|warn" | tail -3
    timeout "${LIMIT:-250}" python3 scripts/bench_gpu.py --out "$out/bench_deep_fp8.json" --workloads deep --runs 1 \
      --temperature 1.0 --cache-fraction 0.3 --expert-dtype fp8 \
      --systems "${SYSTEMS:-all_resident,none,oracle_next~idle,oracle}" "$@" 2>&1 | filter ;;
  spec_ref17)
    # issue 39 on the shipped reference model (ref17: trained, its MTP head kept ~74 % of drafts on the CPU; nothing
    # to train first): plain decode against chains of 1 to 3 drafts, every expert resident, with the timelines of a
    # plain and a verify step; then the GPU test of chained drafts
    timeout "${LIMIT:-200}" python3 scripts/bench_gpu.py --out "$out/bench_spec_ref17.json" --workloads ref17 \
      --runs "${RUNS:-3}" --variant speculation --profile \
      --systems all_resident,all_resident_speculative,all_resident_speculative~drafts2,all_resident_speculative~drafts3 \
      "$@" 2>&1 | filter
    timeout "${TESTS_S:-100}" python3 -m pytest "$(junit)" tests/test_gpu.py -q -p no:cacheprovider --tb=short \
      -k "chained_drafts" 2>&1 | tail -3 ;;
  shared_rows)
    # issue 39 item 1: verify_rows='shared' (every step one batch of 1 + draft_tokens rows a sequence) against the
    # separate layout: V2-Lite's shape (random weights, so no draft is kept) every expert resident, a 1-row and a
    # 2-row step of each layout with their kernel timelines, then the GPU test of both layouts
    for rows in separate shared; do
      timeout "${LIMIT:-170}" python3 scripts/bench_gpu.py --out "$out/bench_rows_v2lite_$rows.json" --workloads v2lite \
        --runs "${RUNS:-3}" --systems all_resident,all_resident_speculative --profile --keep-checkpoints --mtp-layer \
        --verify-rows "$rows" --variant "rows_$rows" "$@" 2>&1 | filter
    done
    timeout "${TESTS_S:-200}" python3 -m pytest "$(junit)" tests/test_gpu.py -q -p no:cacheprovider --tb=short \
      -k "chained_drafts" 2>&1 | tail -3 ;;
  shared_rows_deep)
    # issue 39 on the deep model (trained first when .device-data/deep holds none; carry .device-data/corpus_min),
    # both layouts of a step's rows: plain decode against speculation with 1 and 2 drafts, every expert resident,
    # then at 30 % cached (greedy), with the kernel timelines of a plain and a verify step
    [ -f .device-data/deep/model.safetensors.index.json ] || \
      { train_deep; tar -C .device-data -cf - deep | split -b 15M - "$out/deep.tar.part-"; }
    for rows in separate shared; do
      timeout "${LIMIT:-170}" python3 scripts/bench_gpu.py --out "$out/bench_rows_deep_$rows.json" --workloads deep \
        --runs "${RUNS:-3}" --temperature 0 --cache-fraction 0.3 --verify-rows "$rows" --variant "rows_$rows" \
        --systems "${SYSTEMS:-all_resident,all_resident_speculative,all_resident_speculative~drafts2,none,speculative_mtp~verify0.5}" \
        --profile --profile-predictors none,speculative_mtp "$@" 2>&1 | filter
    done ;;
  spec_v2lite)
    # issue 39's first aim at V2-Lite's shape (random weights, so the draft is never accepted): a 2-row verify step
    # against a 1-row step, every expert resident, each with its kernel timeline
    timeout "${LIMIT:-400}" python3 scripts/bench_gpu.py --out "$out/bench_spec_v2lite.json" --workloads v2lite \
      --runs "${RUNS:-3}" --systems all_resident,all_resident_speculative --profile "$@" 2>&1 | filter ;;
  v2lite_trace)
    # issue 36's V2-Lite-shape rows with the real V2-Lite routing trace forced (.device-data/traces, carried)
    timeout "${LIMIT:-560}" python3 scripts/bench_gpu.py --out "$out/bench_v2lite_trace.json" --workloads v2lite_trace \
      --runs 1 "$@" 2>&1 | filter ;;
  int4_tests)
    # issue 37: the 4-bit expert kernels compiled for the H200 against their float64 references (decode and grouped
    # prefill), then the engine's tokens within int4 across cache sizes and predictors, GPU against CPU
    # dequantisation, and issue 36's idle-link / forced-routing test
    timeout 250 python3 -m pytest "$(junit)" tests/test_kernels.py -q -p no:cacheprovider --tb=short \
      -k "routed_experts_match or grouped_prefill_experts_match or host_read_gives" 2>&1 | grep -v -E "Warning:|warn"
    timeout 300 python3 -m pytest "$(junit)" tests/test_gpu.py -q -p no:cacheprovider --tb=short --durations=5 \
      -k "int4 or dequantisation or idle_link" 2>&1 | grep -v -E "Warning:|warnings.warn"
    # published 4-bit checkpoints (compressed-tensors, GPTQ, AWQ) on CUDA: owed since the thirty-third session, whose
    # device time ran out before this test ran
    timeout 200 python3 -m pytest "$(junit)" tests/test_int4_checkpoints.py -q -p no:cacheprovider --tb=short \
      -k "on_cuda" 2>&1 | grep -v -E "Warning:|warnings.warn" ;;
  int4_bench)
    # issue 37's rows, V2-Lite shape (one random checkpoint kept between the runs): int4 at 12 GiB (every expert
    # resident) and at 4 GiB offloaded (reactive, the one-token oracle, the oracle, Belady's floor); FP8 at 12 GiB
    # (reactive against the oracles: the FP8 prefetch path); bf16 reactive at 12 GiB, the baseline
    run() { timeout "${LIMIT:-140}" python3 scripts/bench_gpu.py --out "$out/bench_int4.json" --workloads v2lite \
      --runs 1 --keep-checkpoints "$@" 2>&1 | filter; }
    [ -n "${WITH_TESTS:-}" ] && timeout 100 python3 -m pytest "$(junit)" tests/test_kernels.py -q -p no:cacheprovider \
      --tb=short -k "routed_experts_match or grouped_prefill_experts_match" 2>&1 | tail -2
    run --expert-dtype int4 --budget-gib 12 --systems resident_at_budget "$@"
    LIMIT=${LIMIT2:-170} run --expert-dtype int4 --budget-gib 4 --systems "${INT4_SYSTEMS:-all_resident,none,oracle_next,oracle}" "$@"
    [ -n "${FP8_SYSTEMS:-}" ] && run --expert-dtype fp8 --budget-gib 12 --systems "$FP8_SYSTEMS" "$@"
    [ -n "${WITH_BF16:-}" ] && run --budget-gib 12 --systems all_resident,none "$@"
    # TESTS="pytest -k expression": those GPU tests of the engine afterwards
    [ -n "${TESTS:-}" ] && timeout "${TESTS_LIMIT:-150}" python3 -m pytest "$(junit)" tests/test_gpu.py -q \
      -p no:cacheprovider --tb=short -k "$TESTS" 2>&1 | grep -v -E "Warning:|warnings.warn" | tail -6 ;;
  int4_gemv)
    # issue 37's resident aim: the 4-bit GEMV's tiles at V2-Lite's shape (one MoE layer, experts in VRAM), then the
    # int4 rows at 12 GiB (every expert resident) and bf16 all-resident beside them
    timeout 200 python3 scripts/bench_kernels.py --out "$out/tiles_int4.json" --tiles-sweep --expert-dtype int4 \
      ${TILES:+--tiles "$TILES"} 2>&1 | grep -E "^\{|Error|error" | cut -c1-300
    timeout "${LIMIT:-300}" python3 scripts/bench_gpu.py --out "$out/bench_int4.json" --workloads v2lite --runs 1 \
      --expert-dtype int4 --budget-gib 12 --systems "${SYSTEMS:-resident_at_budget}" "$@" 2>&1 | filter ;;
  divergence)
    # the FP8 oracles' token defect at V2-Lite's shape (fourteenth session): the first differing token of each row and
    # which setting keeps the tokens (scripts/oracle_divergence.py; bench options do not apply). The fifteenth
    # session's probe found stale hits (published slots without their record), no early waits, no overwrites during
    # reads; the sixteenth's whole-table probe kept every fill in time (no race). Next: --predictors oracle_next --probe
    # --probe-reads-only --repeats 3 --variants late_reread,repeat,late_reread,repeat (BENCHMARKS "4-bit and FP8 experts")
    timeout "${LIMIT:-400}" python3 scripts/oracle_divergence.py --out "$out/oracle_divergence.json" "$@" 2>&1 | \
      grep -E '^\{|Error|error' | cut -c1-300 ;;
  table_stress)
    # the slot race without a model (scripts/table_stress.py): the residency driven as a decode step over the real
    # V2-Lite trace (carry .device-data/traces), every expert product against all-resident's; bf16, then FP8 (RUNS,
    # REPEATS, TOKENS override; the second run gets what time is left)
    runs=${RUNS:-none,oracle,oracle_next:spare0,oracle:reread,oracle:eager}
    timeout "${LIMIT:-280}" python3 scripts/table_stress.py --out "$out/table_stress_bf16.json" --runs "$runs" \
      --repeats "${REPEATS:-3}" --tokens "${TOKENS:-128}" --slots 544 "$@" 2>&1 | grep -E "table_stress|Error|error" | cut -c1-400
    timeout "${LIMIT2:-250}" python3 scripts/table_stress.py --out "$out/table_stress_fp8.json" --runs "$runs" \
      --repeats "${REPEATS:-3}" --tokens "${TOKENS:-128}" --slots 1040 --expert-dtype fp8 "$@" 2>&1 | \
      grep -E "table_stress|Error|error" | cut -c1-400 ;;
  distributed)
    timeout 150 python3 -m pytest "$(junit)" tests/test_distributed.py -q -p no:cacheprovider --tb=short -k gpus 2>&1 | tail -5
    timeout 200 torchrun --nproc-per-node 1 scripts/bench_distributed.py --out "$out/distributed_1gpu.json" \
      "$@" 2>&1 | filter
    timeout 220 torchrun --nproc-per-node 2 scripts/bench_distributed.py --out "$out/distributed_2gpu.json" \
      "$@" 2>&1 | filter ;;
esac
