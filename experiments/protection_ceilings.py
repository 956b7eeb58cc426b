"""How far protection alone can go (issues 36 and 38, CPU, exact counts): misses per decode token of LRU that never
evicts what the next K tokens need (a perfect K-token predictor that only protects, `analysis.ahead_misses`), beside
Belady's replacement with and without bypass, over the routing of the same sampled generations as
`scripts/prefetch_bytes.py --heldout-ids` (each prompt's cache cold; the prompt's prefill warms it, decode counts).

A learned head's "needed within H tokens" block ranks victims (`reuse_weight`): its rows in prefetch_bytes.py sit
between plain LRU/LRFU (K = 0) and the K = H line here, which is what a perfect head of that horizon would give.

    python experiments/protection_ceilings.py --checkpoint .device-data/deep --slots 518 --prompts 4 \
        --new-tokens 64 --aheads 0,1,2,4,8,16,32 --out experiments/results/protection_ceilings_deep34_cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from moeprefetch import MoEPrefetchEngine  # noqa: E402
from moeprefetch.analysis import ahead_misses, belady_misses, record_routing  # noqa: E402
from prefetch_bytes import heldout_prompts  # noqa: E402  (the same prompts as its rows)

logger = logging.getLogger("protection_ceilings")


def decode_steps(uses: list, first_decode: int, layers_per_step: int) -> tuple[list, list[list]]:
    """(the prefill's distinct experts, one list of experts per decode step) from a recorded trace: decode uses come
    layer by layer, each layer's distinct experts, one step after another; every step uses all `layers_per_step`
    MoE layers, or the trace was not split where its steps begin."""
    prefill = list(dict.fromkeys(uses[:first_decode]))
    steps, current, last_layer = [], [], None
    for layer, expert in uses[first_decode:]:
        if last_layer is not None and layer < last_layer:  # layer order restarts: a new step
            steps.append(current)
            current = []
        current.append((layer, expert))
        last_layer = layer
    if current:
        steps.append(current)
    if any(len({key[0] for key in step}) != layers_per_step for step in steps):
        raise ValueError(f"a decode step of this trace does not use all {layers_per_step} MoE layers")
    return prefill, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / ".device-data" / "deep")
    parser.add_argument("--slots", type=int, default=518)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--heldout-ids", type=Path, default=ROOT / ".device-data" / "corpus_min" / "heldout_ids.npy")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--aheads", default="0,1,2,4,8,16,32")
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prompts = heldout_prompts(ns.heldout_ids, ns.prompts)
    engine = MoEPrefetchEngine.from_pretrained(ns.checkpoint, progress=False, expert_cache_slots=ns.slots,
                                               dtype=getattr(torch, ns.dtype))
    slots, n_layers = engine.residency.n_slots, engine.residency.cfg.main_positions  # decode routes these
    aheads = [int(a) for a in ns.aheads.split(",")]
    totals = {f"ahead_{a}": 0 for a in aheads} | {"belady": 0, "belady_bypass": 0}
    tokens = 0
    for prompt in prompts:
        trace = record_routing(engine, prompt, ns.new_tokens, ns.temperature, ns.seed)
        prefill, steps = decode_steps(trace.uses, trace.first_decode, n_layers)
        # the prefill is one step before decode: its distinct experts all miss (a cold cache), counted out
        for a in aheads:
            totals[f"ahead_{a}"] += ahead_misses([prefill] + steps, slots, a) - len(prefill)
        flat = prefill + [key for step in steps for key in step]
        totals["belady"] += belady_misses(flat, slots, count_from=len(prefill))
        totals["belady_bypass"] += belady_misses(flat, slots, count_from=len(prefill), bypass=True)
        tokens += len(steps)
    engine.close()
    per_token = {name: misses / tokens for name, misses in totals.items()}
    for name, value in per_token.items():
        logger.info("%s: %.2f misses per decode token", name, value)
    if ns.out is not None:
        ns.out.write_text(json.dumps({"checkpoint": str(ns.checkpoint), "slots": slots, "prompts": len(prompts),
                                      "new_tokens": ns.new_tokens, "decode_steps": tokens,
                                      "temperature": ns.temperature, "seed": ns.seed, "dtype": ns.dtype,
                                      "misses_per_token": per_token, "torch": torch.__version__}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
