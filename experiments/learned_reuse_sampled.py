"""Experts moved per decode token on sampled text (CPU, exact counts): reactive, the learned head protecting only,
the same with victims by its "needed soon" probabilities (`reuse_weight`), and the one-token oracle, on the deep
model with its routing head, in bf16 at 518 slots (30 % cached), the bench's held-out prompts, temperature 1.0.

Sampled because the small model's greedy continuations loop, and a loop's routing is far more cacheable than text's
(BENCHMARKS "Sparing, timelines and a horizon head"). Every row must give reactive's tokens (seeded sampling).

    python experiments/learned_reuse_sampled.py --checkpoint .device-data/deep --prompts 2 --new-tokens 128
    # reactive at LRFU half-lives instead (the bench's 64 new tokens): is the default's half-life right on sampled text?
    python experiments/learned_reuse_sampled.py --halflives 4,8,16,32 --prompts 8 --new-tokens 64 \
        --out experiments/results/lrfu_halflife_sampled.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from moeprefetch import MoEPrefetchEngine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from prefetch_bytes import measure  # noqa: E402  (the same count as the policy and lead rows)
ROWS = (("none", {}), ("learned", {"fill_confidence": 1.0}),
        ("learned", {"fill_confidence": 1.0, "reuse_weight": 0.7}), ("oracle_next", {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / ".device-data" / "deep")
    parser.add_argument("--slots", type=int, default=518)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--halflives", default=None,
                        help="comma-separated LRFU half-lives: reactive rows at each, instead of the learned rows")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "learned_reuse_sampled.json")
    ns = parser.parse_args()
    rows_to_run = ROWS if ns.halflives is None else \
        [("none", {"lrfu_halflife": float(h)}) for h in ns.halflives.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tokenizer = AutoTokenizer.from_pretrained(ns.checkpoint)
    lines = (ROOT / "experiments" / "prompts" / "heldout.jsonl").read_text().splitlines()[: ns.prompts]
    prompts = [tokenizer(json.loads(line)["text"])["input_ids"] for line in lines]
    engine = MoEPrefetchEngine.from_pretrained(ns.checkpoint, dtype=torch.bfloat16, expert_cache_slots=ns.slots,
                                               progress=False,
                                               predictor_path=str(ns.checkpoint / "routing_head.safetensors"))
    base, rows, reference = engine.options, [], None
    for predictor, options in rows_to_run:
        engine.options = dataclasses.replace(base, **options)
        counts = measure(engine, prompts, ns.new_tokens, predictor, temperature=ns.temperature, seed=ns.seed)
        reference = reference or counts["sequences"]
        row = {"predictor": predictor, **options, "experts_moved_per_token": counts["experts_per_token"],
               "misses_per_token": counts["misses_per_token"],
               "same_tokens_as_reactive": counts["sequences"] == reference}
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine.close()
    ns.out.write_text(json.dumps({"rows": rows, "slots": ns.slots, "prompts": ns.prompts,
                                  "new_tokens": ns.new_tokens, "temperature": ns.temperature, "seed": ns.seed,
                                  "dtype": "bfloat16", "device": "cpu", "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
