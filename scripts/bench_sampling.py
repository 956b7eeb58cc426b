"""What logit bias, penalties and log-probabilities add to a decode step: the sampler's device work alone, captured in
a CUDA graph as the decode step captures it, at real vocabularies and batch rows.

Rows (a `RowSampler`, as a continuous batch's step runs it): greedy rows (the argmax), with bias and penalties
(`LogitAdjuster`: count the input token, adjust), with log-probabilities too (log-sum-exp and the 20 most likely);
greedy rows on a step with every path on (a served step before `row_paths`); seeded sampling at a temperature, with
top-p, and with top-p, bias, penalties and log-probabilities. Each is the median of `--replays` graph replays timed
by CUDA events, after warm-up replays.

    python3 scripts/bench_sampling.py --out experiments/results/sampling_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import timed  # noqa: E402
from moeprefetch.sampling import LOGPROBS_MAX, RowSampler, SamplingParams, row_paths, token_logprobs  # noqa: E402

VOCABS = {"deepseek_v2_lite": 102400, "qwen3": 151936, "deepseek_v3": 129280}


def rows_for(vocab: int, batch: int, replays: int) -> list[dict]:
    dev = torch.device("cuda")
    logits = torch.randn(batch, vocab, device=dev) * 3
    tokens = torch.randint(0, vocab, (batch,), device=dev)
    active = torch.ones(batch, dtype=torch.bool, device=dev)
    positions = torch.arange(batch, device=dev) + 100
    rows = torch.arange(batch, device=dev)
    out = torch.zeros(batch, dtype=torch.int64, device=dev)

    def sampler_of(params: SamplingParams) -> RowSampler:
        sampler = RowSampler(vocab, dev, batch)
        for row in range(batch):
            sampler.set_row(row, params)
        return sampler

    greedy = sampler_of(SamplingParams())
    hot = sampler_of(SamplingParams(temperature=0.8, seed=3))
    top_p = sampler_of(SamplingParams(temperature=0.8, top_p=0.9, seed=3))
    adjusted = SamplingParams(temperature=0.8, top_p=0.9, seed=3, logit_bias=((5, 2.0), (9, -100.0)),
                              presence_penalty=0.5, frequency_penalty=0.3, logprobs=5)
    everything = sampler_of(adjusted)
    every_path = SamplingParams(temperature=1.0, top_k=1, top_p=0.5)  # a served step's paths before `row_paths`

    def draw(sampler: RowSampler, paths: SamplingParams, adjust: bool = False, logprobs: bool = False):
        def body():
            if adjust:
                sampler.logit_adjuster().count(tokens, active)
            out.copy_(sampler(logits, paths, rows, positions, adjust=adjust))
            if logprobs:
                token_logprobs(logits, out, LOGPROBS_MAX)
        return body

    cases = {"greedy": draw(greedy, SamplingParams()),
             "greedy_bias_penalties": draw(everything, SamplingParams(), adjust=True),
             "greedy_bias_penalties_logprobs": draw(everything, SamplingParams(), adjust=True, logprobs=True),
             "greedy_rows_every_path": draw(greedy, every_path),
             "temperature": draw(hot, row_paths([SamplingParams(temperature=0.8)], vocab)),
             "top_p": draw(top_p, row_paths([SamplingParams(temperature=0.8, top_p=0.9)], vocab)),
             "top_p_bias_penalties_logprobs": draw(everything, row_paths([adjusted], vocab), adjust=True,
                                                   logprobs=True)}
    return [{"vocab": vocab, "batch": batch, "case": name, "us_per_step": round(1000.0 * timed(body, repeats=replays, warmup=20, graph=True), 2)}
            for name, body in cases.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--replays", type=int, default=200)
    ns = parser.parse_args()
    results = []
    for name, vocab in VOCABS.items():
        for batch in map(int, ns.batches.split(",")):
            for row in rows_for(vocab, batch, ns.replays):
                results.append({"model_vocab": name, **row})
                print(json.dumps(results[-1]), flush=True)
    environment = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "replays": ns.replays,
                   "statistic": "median of graph replays, CUDA events"}
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"environment": environment, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
