"""What logit bias, penalties and log-probabilities add to a decode step: the sampler's device work alone, captured in
a CUDA graph as the decode step captures it, at real vocabularies and batch rows.

Rows: greedy argmax (what every step pays), + bias and penalties (`LogitAdjuster`: count the input token, adjust),
+ log-probabilities (log-softmax and the 20 most likely), and seeded top-p sampling with all of them. Each is the
median of `--replays` graph replays timed by CUDA events, after warm-up replays.

    python3 scripts/bench_sampling.py --out experiments/results/sampling_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeprefetch.sampling import LOGPROBS_MAX, RowSampler, SamplingParams, token_logprobs  # noqa: E402

VOCABS = {"deepseek_v2_lite": 102400, "qwen3": 151936, "deepseek_v3": 129280}


def timed_graph(body, replays: int) -> float:
    """Median microseconds of one replay of `body` captured as a graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(20):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def rows_for(vocab: int, batch: int, replays: int) -> list[dict]:
    dev = torch.device("cuda")
    logits = torch.randn(batch, vocab, device=dev) * 3
    tokens = torch.randint(0, vocab, (batch,), device=dev)
    active = torch.ones(batch, dtype=torch.bool, device=dev)
    positions = torch.arange(batch, device=dev) + 100
    rows = torch.arange(batch, device=dev)
    sampler = RowSampler(vocab, dev, batch)
    adjusted = SamplingParams(temperature=0.8, top_p=0.9, seed=3, logit_bias=((5, 2.0), (9, -100.0)),
                              presence_penalty=0.5, frequency_penalty=0.3, logprobs=5)
    for row in range(batch):
        sampler.set_row(row, adjusted)
    out = torch.zeros(batch, dtype=torch.int64, device=dev)
    greedy = SamplingParams()

    def argmax():
        out.copy_(logits.argmax(-1))

    def adjust():
        sampler.logit_adjuster().count(tokens, active)
        out.copy_(sampler.adjust(logits).argmax(-1))

    def adjust_logprobs():
        adjust()
        token_logprobs(logits, out, LOGPROBS_MAX)

    def sampled_all():
        sampler.logit_adjuster().count(tokens, active)
        chosen = sampler(logits, greedy, rows, positions, adjust=True)
        token_logprobs(logits, chosen, LOGPROBS_MAX)

    def sampled_plain():
        out.copy_(sampler(logits, greedy, rows, positions, adjust=False))

    cases = {"greedy_argmax": argmax, "greedy_bias_penalties": adjust, "greedy_bias_penalties_logprobs": adjust_logprobs,
             "sampled_top_p": sampled_plain, "sampled_top_p_bias_penalties_logprobs": sampled_all}
    return [{"vocab": vocab, "batch": batch, "case": name, "us_per_step": round(timed_graph(body, replays), 2)}
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
