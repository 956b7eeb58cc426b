#!/usr/bin/env python
"""What `verify_confidence` trades in speculative decoding (issue 39): drafts the MTP head gave less than the cut
are not verified, so their rows read no routed expert; fewer tokens per step, fewer expert bytes per token.

Runs the checkpoint offloaded (a share of its experts cached) on held-out prompts: plain decode, then
`speculative="mtp"` at each cut, each generation from an empty cache, the tokens checked against all-resident plain
decode. With `--draft-experts cached,all` every row runs with the MTP head drafting from VRAM only and reading its
experts wherever they are (what `draft_experts="auto"` chooses between by time): the drafts' acceptance against the
bytes. `--draft-tokens 1,2,3` runs each row with chains of that many drafts checked per step (the engine is loaded
for the longest). Counts only (bytes and steps, the same on any device); time is the GPU bench's.

    python experiments/verify_confidence.py --out experiments/results/verify_confidence_reference_cpu.json
    python experiments/verify_confidence.py --draft-experts cached,all --cuts 0,0.5 \
        --out experiments/results/draft_experts_reference_cpu.json
    python experiments/verify_confidence.py --draft-tokens 1,2,3 --draft-experts cached,all --cuts 0 \
        --out experiments/results/draft_chains_reference_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moeprefetch import MoEPrefetchEngine  # noqa: E402

logger = logging.getLogger("verify_confidence")


def held_out_prompts(engine: MoEPrefetchEngine, path: Path, count: int, tokens: int) -> list[list[int]]:
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()][:count]
    return [engine.tokenizer.encode(text)[:tokens] for text in texts]


def run(engine: MoEPrefetchEngine, prompts: list[list[int]], expected: list[list[int]], new_tokens: int,
        speculative: str | None) -> dict[str, float]:
    """Each prompt from an empty cache -> expert bytes per decode token, tokens per step, drafts checked and kept."""
    moved = tokens = steps = proposed = accepted = 0
    reached: list[int] = []
    kept: list[int] = []
    for prompt, want in zip(prompts, expected):
        engine.reset_expert_cache(forget_routing=True)
        result = engine.generate([prompt], max_new_tokens=new_tokens, stop_at_eos=False, speculative=speculative)
        if result.sequences[0] != want:
            raise AssertionError(f"tokens changed at verify_confidence={engine.options.verify_confidence}")
        stats = result.stats.to_dict()
        decoded = len(result.sequences[0]) - 1
        moved += stats["decode_bytes_h2d_per_token"] * decoded
        tokens += decoded
        steps += stats["decode_steps"]
        proposed += stats.get("draft_proposed") or 0
        accepted += stats.get("draft_accepted") or 0
        for j, (n, k) in enumerate(zip(stats.get("draft_proposed_by_position") or [],
                                       stats.get("draft_accepted_by_position") or [])):
            reached += [0] * (j + 1 - len(reached))
            kept += [0] * (j + 1 - len(kept))
            reached[j] += n
            kept[j] += k
    return {"mb_per_token": moved / tokens / 1e6, "tokens_per_step": tokens / steps,
            "checked_per_step": proposed / steps if speculative else 0.0,
            "acceptance_of_checked": accepted / proposed if proposed else None,
            "acceptance_by_position": [k / n if n else None for k, n in zip(kept, reached)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "moeprefetch" / "reference_model")
    parser.add_argument("--prompts", type=Path, default=ROOT / "experiments" / "prompts" / "heldout.jsonl")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--fraction", type=float, default=0.25, help="share of the experts cached")
    parser.add_argument("--cuts", default="0,0.3,0.5,0.7,0.9")
    parser.add_argument("--draft-experts", default="cached", help="the MTP head's experts, comma list (cached, all)")
    parser.add_argument("--draft-tokens", default="1", help="drafts checked per verify step, comma list (1 to 4)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with MoEPrefetchEngine.from_pretrained(args.checkpoint, progress=False) as resident:
        prompts = held_out_prompts(resident, args.prompts, args.count, args.prompt_tokens)
        expected = [resident.generate([p], max_new_tokens=args.new_tokens, stop_at_eos=False).sequences[0]
                    for p in prompts]
    rows = []
    chains = [int(d) for d in args.draft_tokens.split(",")]
    with MoEPrefetchEngine.from_pretrained(args.checkpoint, progress=False, expert_cache_fraction=args.fraction,
                                           draft_tokens=max(chains)) as engine:
        engine.options = dataclasses.replace(engine.options, draft_tokens=1)
        rows.append({"speculative": None, **run(engine, prompts, expected, args.new_tokens, None)})
        logger.info("%s", rows[-1])
        for mode in args.draft_experts.split(","):
            # the options are the engine's: one engine serves every row (its options, not its weights, change)
            engine.options = dataclasses.replace(engine.options, draft_experts=mode)
            for chain in chains:
                for cut in (float(c) for c in args.cuts.split(",")):
                    engine.options = dataclasses.replace(engine.options, verify_confidence=cut, draft_tokens=chain)
                    rows.append({"speculative": "mtp", "verify_confidence": cut, "draft_experts": mode,
                                 "draft_tokens": chain, **run(engine, prompts, expected, args.new_tokens, "mtp")})
                    logger.info("%s", rows[-1])
        slots = engine.residency.n_slots
    report = {"checkpoint": args.checkpoint.name, "cache_slots": slots, "prompts": len(prompts),
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "tokens_identical": True,
              "command": " ".join(sys.argv), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
