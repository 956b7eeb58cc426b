#!/usr/bin/env python
"""The weight bytes a resident verify step must read at V2-Lite's shape, from real routing (issue 39's first aim).

A verify step of 1 + d rows (the real row and d drafts) reads the shared weights once (attention, shared experts,
the dense layer, the vocabulary head: a GEMV over several rows reads its weights once) and every routed expert that
any of its rows uses, once. All-resident decode is bound by HBM bytes, so its cost against a one-row step is at
least the ratio of those bytes. The distinct experts of consecutive tokens come from a real routing trace
(`../shared/traces` format: the tokens' own routing, so a verify step whose drafts are right reads exactly these);
random routing is given beside it. The MTP layer's own reads are left out (V2-Lite has none).

    python experiments/verify_step_bytes.py --trace ../shared/traces/nvmoe-dsv2lite-a.tokens.jsonl \
        --out experiments/results/verify_step_bytes_v2lite.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moeprefetch.traces import load_trace  # noqa: E402

BF16 = 2
HIDDEN, HEADS, VOCAB, LAYERS, MOE_LAYERS = 2048, 16, 102400, 27, 26
EXPERTS, TOP_K, SHARED, EXPERT_INTERMEDIATE, DENSE_INTERMEDIATE = 64, 6, 2, 1408, 10944
KV_RANK, ROPE, NOPE, V_HEAD = 512, 64, 128, 128


def v2lite_bytes() -> tuple[int, int]:
    """(bytes of one routed expert, bytes a step reads once whatever its rows) at V2-Lite's shape, bf16."""
    expert = 3 * HIDDEN * EXPERT_INTERMEDIATE * BF16
    attention = (HIDDEN * HEADS * (NOPE + ROPE) + HIDDEN * (KV_RANK + ROPE) + KV_RANK * HEADS * (NOPE + V_HEAD)
                 + HEADS * V_HEAD * HIDDEN) * BF16
    shared = SHARED * expert + EXPERTS * HIDDEN * BF16  # the shared experts and the router
    dense = 3 * HIDDEN * DENSE_INTERMEDIATE * BF16
    head = VOCAB * HIDDEN * BF16
    return expert, LAYERS * attention + MOE_LAYERS * shared + dense + head


def distinct_per_layer(tokens: list[dict[int, set[int]]], window: int) -> float:
    """Mean distinct experts per MoE layer over `window` consecutive tokens."""
    counts = [sum(len(set().union(*(t[layer] for t in tokens[i : i + window]))) for layer in tokens[i])
              / len(tokens[i]) for i in range(len(tokens) - window + 1)]
    return sum(counts) / len(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--max-drafts", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    trace = load_trace(args.trace)
    tokens = [{layer: set(ids) for layer, ids in enumerate(token)} for token in trace.experts.tolist()]
    expert, once = v2lite_bytes()
    one_row = once + MOE_LAYERS * TOP_K * expert
    rows = []
    for drafts in range(args.max_drafts + 1):
        n = drafts + 1
        real = distinct_per_layer(tokens, n)
        uniform = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** n)
        rows.append({"rows": n, "distinct_experts_per_layer_trace": real, "distinct_experts_per_layer_random": uniform,
                     "gb_per_step_trace": (once + MOE_LAYERS * real * expert) / 1e9,
                     "gb_per_step_random": (once + MOE_LAYERS * uniform * expert) / 1e9,
                     "bytes_vs_one_row_trace": (once + MOE_LAYERS * real * expert) / one_row,
                     "bytes_vs_one_row_random": (once + MOE_LAYERS * uniform * expert) / one_row})
    report = {"trace": args.trace.name, "tokens": len(tokens), "expert_bytes": expert, "once_bytes": once,
              "one_row_bytes": one_row, "command": " ".join(sys.argv), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
