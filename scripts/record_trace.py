#!/usr/bin/env python
"""Record a checkpoint's own decode routing as a trace file (the format of ../shared/traces), for
`moeprefetch replay`: greedy generation with reactive fetching from each prompt, every decode token's experts per
main MoE layer (the table's recorded trace, read once per prompt), appended prompt after prompt.

    python scripts/record_trace.py reference/deep_model-or-any-checkpoint --prompts experiments/prompts/heldout.jsonl \\
        --new-tokens 64 --out deep.trace.jsonl
    moeprefetch replay deep.trace.jsonl --slots 518 --predictor none,oracle_next

With `--heldout-ids FILE.npy --tokens N` the trace is the teacher-forced routing of N held-out tokens instead
(`routing_record.py`, 512-token windows one after another; `--dtype bfloat16` routes as CUDA decode does):

    python scripts/record_trace.py .device-data/deep --heldout-ids .device-data/corpus/heldout_ids.npy \
        --tokens 2048 --dtype bfloat16 --out deep_bf16.tokens.jsonl
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
        needed = engine.trace_buffer()[:steps, :main].cpu()
        parts.append(trace_from_needed(needed, engine.args.moe_layers))
    return torch.cat(parts)


def heldout_trace(args: argparse.Namespace) -> int:
    """The routing of held-out text, teacher-forced in 512-token windows (what the learned head is judged on)."""
    import numpy as np

    from moeprefetch.routing_record import record_routing as record_text

    ids = np.load(args.heldout_ids)[: args.tokens].astype(np.int64).tolist()
    with MoEPrefetchEngine.from_pretrained(args.checkpoint, device=args.device, dtype=args.dtype, max_batch_size=1,
                                           progress=False) as engine:
        experts = record_text(engine, [ids[i:i + 512] for i in range(0, len(ids), 512)]).ids
        write_trace(args.out, engine.args.moe_layers, experts)
    print(f"wrote {args.out}: {experts.shape[0]} tokens, {experts.shape[1]} MoE layers, top-{experts.shape[2]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompts", type=Path, default=ROOT / "experiments/prompts/heldout.jsonl",
                        help="JSON lines with 'text' (needs the checkpoint's tokenizer)")
    parser.add_argument("--count", type=int, default=8, help="prompts to use")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--heldout-ids", type=Path, default=None, help="teacher-forced routing of these token ids "
                        "(.npy) instead of generations")
    parser.add_argument("--tokens", type=int, default=2048, help="--heldout-ids: tokens recorded")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the engine's on --device)")
    args = parser.parse_args(argv)
    if args.heldout_ids is not None:
        return heldout_trace(args)
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
