#!/usr/bin/env python
"""Where a 4-bit record's scales should live (issue 37, item 2), judged by bytes on a real routing trace.

Two layouts of the same VRAM given to routed experts (`cache` bytes):
- **with the records** (what the engine does): a slot holds codes, scales and zero points; a miss moves all of it;
- **resident**: every expert's scales and zero points stay in VRAM (experts x metadata bytes, taken from the cache),
  a slot holds codes only, and a miss moves codes only.

For each cache size both layouts' slot counts are replayed through the residency's own victim code
(`moeprefetch.replay`, LRFU, with and without `oracle_next` protection) and through Belady's bound, and the link
bytes per decode token are compared. Under uniform routing the two layouts move the same bytes exactly (misses per
token k(1 - s/E) times the record: r - C/E in both); real routing decides.

    python experiments/scale_placement.py --trace ../shared/traces/nvmoe-dsv2lite-a.tokens.jsonl \\
        --out experiments/results/scale_placement_v2lite_trace.json
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

from moeprefetch.expert_records import ExpertFormat  # noqa: E402
from moeprefetch.replay import ReplaySetup, floors, replay  # noqa: E402
from moeprefetch.traces import load_trace  # noqa: E402

logger = logging.getLogger("scale_placement")


def layouts(cache_bytes: int, fmt: ExpertFormat, keys: int) -> dict[str, tuple[int, int]]:
    """(slots, bytes a miss moves) of each layout for `cache_bytes` of expert VRAM; slots clamped to the experts."""
    with_records = min(cache_bytes // fmt.record_bytes, keys)
    codes_only = fmt.record_bytes - fmt.scale_bytes
    resident = min(max(cache_bytes - keys * fmt.scale_bytes, 0) // codes_only, keys)
    return {"with_records": (with_records, fmt.record_bytes), "resident": (resident, codes_only)}


def rows_for(trace, fmt: ExpertFormat, cache_bytes: int, predictors: list[str]) -> list[dict]:
    keys = len(trace.layers) * trace.n_experts
    rows = []
    for layout, (slots, miss_bytes) in layouts(cache_bytes, fmt, keys).items():
        row = {"cache_gb": cache_bytes / 1e9, "layout": layout, "slots": slots, "miss_bytes": miss_bytes}
        if slots < 1:
            rows.append({**row, "note": "the resident scales alone exceed this cache"})
            continue
        bounds = floors(trace, slots, aheads=())
        row["belady_mb_per_token"] = bounds.belady_misses * miss_bytes / trace.tokens / 1e6
        for name in predictors:
            result = replay(trace, ReplaySetup(slots=slots, predictor=name, expert_bytes=miss_bytes))
            row[f"{name}_hit_rate"] = result.hit_rate
            row[f"{name}_mb_per_token"] = result.bytes_per_token / 1e6
        logger.info("%s", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--slots", default="185,300,544,832,1100,1400,1600",
                        help="cache sizes, as slots of the with-records layout")
    parser.add_argument("--predictors", default="none,oracle_next")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    fmt = ExpertFormat.build(args.hidden, args.intermediate, torch.bfloat16, "int4", group_size=args.group_size)
    trace = load_trace(args.trace)
    rows = []
    for slots in (int(s) for s in args.slots.split(",")):
        rows += rows_for(trace, fmt, slots * fmt.record_bytes, args.predictors.split(","))
    report = {"trace": args.trace.name, "tokens": trace.tokens, "experts": len(trace.layers) * trace.n_experts,
              "format": fmt.describe(), "record_bytes": fmt.record_bytes, "scale_bytes": fmt.scale_bytes,
              "policy": "lrfu", "command": " ".join(sys.argv), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
