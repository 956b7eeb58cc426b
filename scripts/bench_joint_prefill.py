#!/usr/bin/env python
"""Prompts prefilled together with every expert resident: a window's chunks in one launch of the grouped expert
kernel (`residency/prefill.py`, `_in_place_joint`) against one launch per chunk, in one engine and one call.

V2-Lite's shape (random weights), int4 or FP8 experts at a budget that holds them all, B prompts of T random tokens
prefilled together (the engine's batch of B, as a server's requests admitted together are), one new token; the
median of --runs timed generations after a warm-up, each way; the first token and its log-probability must be the
same bits both ways.

    python scripts/bench_joint_prefill.py --out OUT/joint_prefill.json [--expert-dtype int4] [--batches 4,16]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_gpu import environment, random_v2lite_engine  # noqa: E402
from moeprefetch import MoEPrefetchEngine  # noqa: E402


def timed_prefill(engine: MoEPrefetchEngine, prompts: list[list[int]], runs: int) -> tuple[float, list, list, int]:
    """Median seconds of a generation of one token for every prompt (warm-up first), with its tokens,
    log-probabilities and the (chunk, layer)s computed in a launch with others."""
    engine.generate(prompts, max_new_tokens=1, stop_at_eos=False)
    seconds, result = [], None
    for _ in range(runs):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = engine.generate(prompts, max_new_tokens=1, stop_at_eos=False, logprobs=0)
        seconds.append(time.perf_counter() - start)
    assert result is not None
    logprobs = [[entry.logprob for entry in row] for row in result.logprobs]
    return statistics.median(seconds), result.sequences, logprobs, result.stats.to_dict()["prefill_chunks_joined"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=["full", "tiny"], default="full")
    parser.add_argument("--expert-dtype", default="int4")
    parser.add_argument("--budget-gib", type=float, default=12.0)
    parser.add_argument("--batches", default="4,16")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=1024, help="sets the prefill chunk and window (the "
                        "engine's defaults: min(max_seq_len, 2,048 / 8,192 tokens)); a window holds the prompts "
                        "prefilled together")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moeprefetch-bench"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    engine = random_v2lite_engine(args.workdir, "v2lite_joint", args.scale, device, args.budget_gib,
                                  max_batch_size=max(batches), max_seq_len=args.max_seq_len,
                                  expert_dtype=args.expert_dtype)
    prefill = engine.residency._prefill
    joint_limit = prefill.joint_tokens
    g = torch.Generator().manual_seed(5)
    report = {"environment": environment(device), "plan": engine.plan.describe(), "expert_dtype": args.expert_dtype,
              "prompt_tokens": args.prompt_tokens, "runs": args.runs, "joint_tokens": joint_limit,
              "prefill_chunk": engine.options.prefill_chunk, "prefill_window": engine.options.prefill_window,
              "rows": []}
    for batch in batches:
        prompts = [torch.randint(3, engine.args.vocab_size, (args.prompt_tokens,), generator=g).tolist()
                   for _ in range(batch)]
        measured = {}
        for joint in (False, True):
            prefill.joint_tokens = joint_limit if joint else None
            measured[joint] = timed_prefill(engine, prompts, args.runs)
        row = {"batch": batch, "seconds_per_chunk_launch": measured[False][0],
               "seconds_joint_launch": measured[True][0],
               "speedup": measured[False][0] / measured[True][0],
               "same_tokens": measured[False][1] == measured[True][1],
               "same_logprob_bits": measured[False][2] == measured[True][2],
               "chunks_joined": measured[True][3], "chunks_joined_when_off": measured[False][3]}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
