#!/usr/bin/env python
"""Quick GPU smoke run: one checkpoint, all-resident vs a 25% expert cache under each predictor.

Checks that the tokens are identical everywhere and prints decode ms/token and cache statistics as JSON. This is a
development aid (first look at overheads), not the benchmark: see scripts/bench_gpu.py for that.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeprefetch import MoEPrefetchEngine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--fraction", type=float, default=0.25)
    ns = parser.parse_args(argv)
    prompts = [[0, 464, 1085, 262, 1628, 318], [0, 383, 3047, 286]]
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    base = MoEPrefetchEngine.from_pretrained(ns.checkpoint, device="cuda", dtype=torch.bfloat16, progress=False)
    base.generate(prompts, max_new_tokens=8, stop_at_eos=False)  # warm-up
    t = time.perf_counter()
    expected = base.generate(prompts, max_new_tokens=ns.new_tokens, stop_at_eos=False)
    out["rows"].append({"system": "all_resident", "seconds": time.perf_counter() - t, **_brief(expected)})
    slots = max(int(base.plan.total_experts * ns.fraction), base.args.num_experts_per_tok)
    engine = MoEPrefetchEngine.from_pretrained(
        ns.checkpoint, device="cuda", dtype=torch.bfloat16, expert_cache_slots=slots, progress=False
    )
    for predictor in ("none", "previous", "next_layer_gate", "mtp", "mtp+next_layer_gate", "oracle"):
        engine.reset_expert_cache()
        engine.generate(prompts, max_new_tokens=4, stop_at_eos=False, predictor=predictor)
        engine.reset_expert_cache()
        result = engine.generate(prompts, max_new_tokens=ns.new_tokens, stop_at_eos=False, predictor=predictor)
        out["rows"].append(
            {"system": predictor, "slots": slots, "same_tokens": result.sequences == expected.sequences, **_brief(result)}
        )
    spec = engine.generate(prompts, max_new_tokens=ns.new_tokens, stop_at_eos=False, speculative="mtp")
    out["rows"].append({"system": "speculative_mtp", "same_tokens": spec.sequences == expected.sequences, **_brief(spec)})
    print(json.dumps(out, indent=1))
    return 0


def _brief(result) -> dict:
    d = result.stats.to_dict()
    keys = ("ms_per_token", "decode_tokens_per_s", "hit_rate", "misses", "expert_uses", "bytes_h2d", "stall_seconds",
            "prefetch_issued", "prefetch_useful", "prefetch_late", "prefetch_wasted", "prediction_recall",
            "prediction_precision", "mtp_draft_accuracy", "draft_acceptance")
    return {k: d.get(k) for k in keys}


if __name__ == "__main__":
    sys.exit(main())
