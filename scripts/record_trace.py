#!/usr/bin/env python
"""Record a checkpoint's own decode routing as a trace file (the format of ../shared/traces), for
`moeprefetch replay`: greedy generation with reactive fetching from each prompt, every decode token's experts per
main MoE layer (the table's recorded trace, read once per prompt), appended prompt after prompt.

    python scripts/record_trace.py reference/deep_model-or-any-checkpoint --prompts experiments/prompts/heldout.jsonl \\
        --new-tokens 64 --out deep.trace.jsonl
    moeprefetch replay deep.trace.jsonl --slots 518 --predictor none,oracle_next
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moeprefetch import MoEPrefetchEngine  # noqa: E402
from moeprefetch.analysis import record_routing  # noqa: E402
from moeprefetch.traces import trace_from_needed, write_trace  # noqa: E402


def record(engine: MoEPrefetchEngine, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """[tokens, main MoE layers, k]: the decode routing of every prompt, one after the other."""
    main = engine.residency.cfg.main_positions
    parts = []
    for prompt in prompts:
        engine.reset_expert_cache(forget_routing=True)
        steps = record_routing(engine, prompt, new_tokens).decode_tokens
        needed = engine._trace_buffer()[:steps, :main].cpu()
        parts.append(trace_from_needed(needed, engine.args.moe_layers))
    return torch.cat(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompts", type=Path, default=ROOT / "experiments/prompts/heldout.jsonl",
                        help="JSON lines with 'text' (needs the checkpoint's tokenizer)")
    parser.add_argument("--count", type=int, default=8, help="prompts to use")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    engine = MoEPrefetchEngine.from_pretrained(args.checkpoint, device=args.device, max_batch_size=1,
                                               expert_cache_fraction=0.25, progress=False)
    lines = [json.loads(line)["text"] for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [engine.tokenizer(text)["input_ids"] for text in lines[: args.count]]
    experts = record(engine, prompts, args.new_tokens)
    write_trace(args.out, engine.args.moe_layers, experts)
    print(f"wrote {args.out}: {experts.shape[0]} tokens, {experts.shape[1]} MoE layers, top-{experts.shape[2]}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
