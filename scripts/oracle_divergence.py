#!/usr/bin/env python
"""Where an offloaded row's tokens leave all-resident's: the first differing token of each row, and which engine
setting brings the tokens back (an investigation, one device call).

A cache or a predictor must never change tokens. On the H200 at DeepSeek-V2-Lite's shape with FP8 experts (12 GiB,
1,040 slots) the oracles did (fourteenth session, BENCHMARKS "4-bit and FP8 experts"): recall 55.6 % and other
tokens, while reactive kept them. This script runs reactive and a predictor on one random checkpoint, then the same
predictor with one setting changed at a time, and reports for each row the index of the first token that differs
from all-resident's (None: identical) and its counters. A setting whose row keeps the tokens names the path to
look at:

| variant | what it turns off |
|---|---|
| `late_reread` | waiting for a late fill (`late_prefetch="reread"`: read it from host instead) |
| `spare1` | prefetches evicting the last step's experts (`spare_recent=1`; the full oracle never spares) |
| `inflight1` | more than one fill in flight (`max_inflight_experts=1`) |
| `idle_link` | fills beside a layer's host reads (`fill_link="idle"`) |
| `lead1` | fills reserved more than one MoE layer before their need (`prefetch_lead=1`) |
| `no_graphs` | the captured step (each kernel launched eagerly, in the same order and streams) |
| `repeat` | nothing: the base row again (the same first difference says deterministic, another says a race) |

Each row also reports `corrupt_slots`: published slots whose bytes differ from their expert's host record after the
row (`Residency.corrupt_slots`). Corrupt slots mean a fill or an admission raced another writer or a reader; none
with other tokens means a read saw a slot before its copy had landed, or the paths compute differently.

    python scripts/oracle_divergence.py --out OUT/oracle_divergence.json --expert-dtype fp8 --budget-gib 12
    python scripts/oracle_divergence.py --device cpu --scale tiny   # the script itself, on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from moeprefetch import MoEPrefetchEngine  # noqa: E402

logger = logging.getLogger("oracle_divergence")

# variant -> the engine options its rows change (each reaches the residency's per-call settings, so its decode step
# is captured anew)
VARIANTS: dict[str, dict[str, Any]] = {
    "late_reread": {"late_prefetch": "reread"},
    "spare1": {"spare_recent": 1},
    "inflight1": {"max_inflight_experts": 1},
    "idle_link": {"fill_link": "idle"},
    "lead1": {"prefetch_lead": 1},
    "no_graphs": {"cuda_graphs": False},
    "repeat": {},
}


def first_difference(got: list[int], expected: list[int]) -> int | None:
    """The index of the first token that differs (a shorter sequence differs where it ends), or None."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return i
    return None if len(got) == len(expected) else min(len(got), len(expected))


def run(engine: MoEPrefetchEngine, prompt: list[int], new_tokens: int, predictor: str,
        expected: list[int] | None) -> dict[str, Any]:
    engine.reset_expert_cache(forget_routing=True)
    result = engine.generate([prompt], max_new_tokens=new_tokens, predictor=predictor, stop_at_eos=False)
    stats = result.stats.to_dict()
    row = {key: stats.get(key) for key in ("decode_misses_per_token", "prefetch_issued", "prefetch_late",
                                           "prefetch_wasted", "prediction_recall", "ms_per_token")}
    row["first_difference"] = None if expected is None else first_difference(result.sequences[0], expected)
    row["tokens"] = result.sequences[0]
    row["corrupt_slots"] = len(engine.residency.corrupt_slots())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", default="full", help="full (the bench's random V2-Lite) or tiny")
    parser.add_argument("--expert-dtype", default="fp8")
    parser.add_argument("--budget-gib", type=float, default=12.0)
    parser.add_argument("--slots", type=int, default=None, help="expert cache slots instead of the budget")
    parser.add_argument("--predictors", default="oracle_next,oracle")
    parser.add_argument("--spare-recent", type=int, default=0, help="the rows' spare_recent (0 diverged)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the variants to run, in order")
    parser.add_argument("--probe", action="store_true",
                        help="first, each predictor's base row on an engine whose slot probe is on (probe.py)")
    parser.add_argument("--probe-reads-only", action="store_true",
                        help="the probe checks the slots each expert kernel reads, not the whole table around each "
                             "plan (whose cost keeps every fill in time, so the race does not show)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each probe and base row (a race shows in some runs only; a row's first run "
                             "also compiles and captures its step)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moeprefetch-bench"))
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from bench_gpu import V2LITE, tiny, write_random_checkpoint  # the bench's own random V2-Lite

    path = ns.workdir / f"divergence_{ns.scale}"
    if not (path / "model.safetensors.index.json").is_file():
        write_random_checkpoint(path, tiny(V2LITE) if ns.scale == "tiny" else V2LITE, torch.device(ns.device))
    config = json.loads((path / "config.json").read_text())
    prompt = torch.randint(3, config["vocab_size"], (64,), generator=torch.Generator().manual_seed(1)).tolist()
    dtype = torch.bfloat16 if ns.device == "cuda" else torch.float32
    common = dict(device=ns.device, dtype=dtype, max_seq_len=256, max_batch_size=1, progress=False,
                  expert_dtype=ns.expert_dtype)
    with MoEPrefetchEngine.from_pretrained(path, **common) as resident:
        expected = run(resident, prompt, ns.new_tokens, "none", None)["tokens"]
        # all-resident itself must be deterministic, or no row's difference means anything
        again = run(resident, prompt, ns.new_tokens, "none", expected)
    print(json.dumps({"predictor": "all_resident", "variant": "repeat",
                      "first_difference": again["first_difference"]}), flush=True)
    cache = {"expert_cache_slots": ns.slots} if ns.slots else {"vram_budget": f"{ns.budget_gib}GiB"}
    predictors = ns.predictors.split(",")
    rows: list[dict[str, Any]] = []
    record = {"rows": rows, "expected": expected, "all_resident_repeat_first_difference": again["first_difference"],
              "scale": ns.scale, "expert_dtype": ns.expert_dtype, "spare_recent": ns.spare_recent}

    def report(row: dict[str, Any]) -> None:  # each row as it comes (a call may end before the last)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if ns.out:
            ns.out.write_text(json.dumps(record, indent=1))

    if ns.probe:
        with MoEPrefetchEngine.from_pretrained(path, **common, **cache, spare_recent=ns.spare_recent) as engine:
            probe = engine.residency.enable_probe(whole_table=not ns.probe_reads_only)
            for predictor in predictors:
                for attempt in range(ns.repeats):
                    probe.clear()
                    row = run(engine, prompt, ns.new_tokens, predictor, expected)
                    row.pop("tokens")
                    report({"predictor": predictor, "variant": "probe_reads" if ns.probe_reads_only else "probe", "run": attempt, **row, **probe.report()})
    with MoEPrefetchEngine.from_pretrained(path, **common, **cache, spare_recent=ns.spare_recent) as engine:
        base = engine.options
        variants = [name for name in ns.variants.split(",") if name]
        plan = [("none", "base", {})] + [(p, "base", {}) for p in predictors for _ in range(ns.repeats)] + \
            [(p, name, VARIANTS[name]) for p in predictors for name in variants]
        for predictor, variant, change in plan:
            engine.options = dataclasses.replace(base, **change)
            row = run(engine, prompt, ns.new_tokens, predictor, expected)
            row.pop("tokens")
            report({"predictor": predictor, "variant": variant, **row})
        engine.options = base



if __name__ == "__main__":
    main()
