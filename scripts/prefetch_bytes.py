#!/usr/bin/env python
"""Experts moved per decode token by each predictor at several prefetch leads, beside Belady's optimum (CPU).

The counts are exact (the CPU runs the reference plans; every fill lands before the next plan, so nothing is late):
this measures the bytes a plan asks for, not the time they take on a GPU. Each prompt starts with a cold cache and no
routing history (what LFU and LRFU rank by). Belady's replacement is run over the routing of the same greedy
generations (prefill included, misses counted from the first decode token).

    python scripts/prefetch_bytes.py --model reference --slots 40 --leads 0,1,2,4,8
    python scripts/prefetch_bytes.py --model deep --slots 200 --predictors oracle,next_layer_gate --new-tokens 64
    python scripts/prefetch_bytes.py --model reference --leads 0 --policies lru,lrfu,lfu --predictors none,mtp@0.05
    python scripts/prefetch_bytes.py --model deep --slots 200 --new-tokens 64 --prompts 4 --leads 0 \
        --policies lrfu:2,lrfu:4,lrfu:8,lrfu:16 --predictors none

`--model reference` is the embedded trained model with the held-out prompts; `--model deep` builds a random
26-MoE-layer DeepSeek-V2-style checkpoint (64 experts, top-6; random prompts), the depth of V2-Lite; any other value
is a checkpoint path (random prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from moeprefetch import MoEPrefetchEngine  # noqa: E402
from moeprefetch.analysis import belady_misses, record_routing  # noqa: E402
from moeprefetch.options import POLICIES, EngineConfig  # noqa: E402

logger = logging.getLogger("prefetch_bytes")


def model_and_prompts(name: str, count: int, workdir: Path) -> tuple[Path, list[list[int]]]:
    if name == "reference":
        path = ROOT / "moeprefetch" / "reference_model"
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        lines = (ROOT / "experiments" / "prompts" / "heldout.jsonl").read_text().splitlines()
        return path, [tokenizer(json.loads(line)["text"])["input_ids"] for line in lines[:count]]
    if name == "deep":
        from make_tiny_checkpoint import make_tiny_checkpoint

        path = make_tiny_checkpoint(workdir / "deep", "deepseek_v2", with_mtp=False, num_hidden_layers=27,
                                    n_routed_experts=64, num_experts_per_tok=6)
    else:
        path = Path(name)
    generator = torch.Generator().manual_seed(0)
    return path, [torch.randint(2, 250, (24,), generator=generator).tolist() for _ in range(count)]


def heldout_prompts(path: Path, count: int) -> list[list[int]]:
    """`count` prompts of 64 tokens from a token-id file (.npy), 1,000 tokens apart: the rows of every script that
    counts a trained checkpoint's held-out text see the same prompts."""
    import numpy as np

    held = np.load(path).astype(np.int64).tolist()
    return [held[i * 1000:i * 1000 + 64] for i in range(count)]


def measure(engine: MoEPrefetchEngine, prompts: list[list[int]], new_tokens: int, predictor: str,
            min_confidence: float = 0.0, lookahead: int | None = None, temperature: float = 0.0,
            seed: int = 0) -> dict[str, Any]:
    """Experts moved (fills and zero-copy reads) and misses per decode token, over every prompt, and each prompt's
    tokens (`sequences`: rows that must agree compare them)."""
    moved = misses = wasted = issued = 0.0
    tokens = 0
    sequences = []
    for prompt in prompts:
        engine.reset_expert_cache(forget_routing=True)  # LFU and LRFU learn each prompt's routing from scratch
        result = engine.generate([prompt], max_new_tokens=new_tokens, predictor=predictor, stop_at_eos=False,
                                 min_confidence=min_confidence, lookahead=lookahead, temperature=temperature,
                                 seed=seed)
        sequences.append(result.sequences)
        stats = result.stats.to_dict()
        steps = stats["decode_steps"]
        moved += stats["decode_bytes_h2d_per_token"] / stats["expert_bytes"] * steps
        misses += stats["decode_misses_per_token"] * steps
        wasted += stats["prefetch_wasted"]
        issued += stats["prefetch_issued"]
        tokens += steps
    return {"experts_per_token": moved / tokens, "misses_per_token": misses / tokens,
            "prefetch_waste": wasted / issued if issued else None, "decode_tokens": tokens, "sequences": sequences}


def points(args: argparse.Namespace, has_mtp: bool) -> Iterator[tuple[str, float, str, int]]:
    """(policy, LRFU half-life, predictor[@cut], lead) of every row asked for; reactive rows at lead 0 only."""
    for spec in args.policies.split(","):
        policy, _, halflife = spec.partition(":")
        for system in args.predictors.split(","):
            if system.startswith("mtp") and not has_mtp:
                continue
            for lead in [0] if system == "none" else [int(v) for v in args.leads.split(",")]:
                yield policy, float(halflife) if halflife else EngineConfig.lrfu_halflife, system, lead


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="reference", help="reference, deep, or a checkpoint path")
    parser.add_argument("--slots", type=int, default=40, help="expert cache slots")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--leads", default="0,1,2,4,8", help="prefetch leads in MoE layers (0: no limit)")
    parser.add_argument("--predictors", default="none,oracle,next_layer_gate,mtp,mtp+next_layer_gate",
                        help="comma list; NAME@CUT for a confidence cut (min_confidence)")
    parser.add_argument("--policies", default="lrfu", help="cache policies (comma list of lru, lrfu, lfu; "
                        "lrfu:H for a half-life of H steps)")
    parser.add_argument("--predictor-path", default=None, help="a trained routing head, for the 'learned' rows")
    parser.add_argument("--reuse-weight", type=float, default=EngineConfig.reuse_weight,
                        help="engine option reuse_weight (learned rows: victims by predicted reuse; default: the "
                        "engine's, 0.7 where the head runs)")
    parser.add_argument("--heldout-ids", type=Path, default=None,
                        help="prompts from this token-id file (.npy, e.g. the corpus' heldout_ids.npy), 64 each")
    parser.add_argument("--fill-confidence", type=float, default=EngineConfig.fill_confidence,
                        help="engine option fill_confidence: weaker predictions only protect")
    parser.add_argument("--prefetch-budget", type=float, default=EngineConfig.prefetch_budget,
                        help="prefetches per (step, layer) as a multiple of top-k (0: predictions only protect; "
                        "default: the engine's, 0 for 'learned' alone, else 1.5)")
    parser.add_argument("--bypass", action=argparse.BooleanOptionalAction, default=EngineConfig.bypass,
                        help="'learned': misses the head thinks less likely needed soon than their victims are read in "
                        "place, not admitted (default: the engine's, on where the head runs)")
    parser.add_argument("--spare-recent", type=int, default=EngineConfig.spare_recent,
                        help="engine option spare_recent: prefetches never evict experts used in the last N steps")
    parser.add_argument("--lookahead", type=int, default=None, help="tokens (or layers) ahead the predictions reach")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample the generations (0: greedy; a small "
                        "trained model's greedy continuations loop, and loops route far more cacheably than text)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed")
    parser.add_argument("--dtype", default="float32", help="the engine's compute dtype (bfloat16 as the GPU runs)")
    parser.add_argument("--out", type=Path, default=None, help="append the rows to this JSON file")
    args = parser.parse_args(argv)
    unknown = [s for s in args.policies.split(",") if s.partition(":")[0] not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        path, prompts = model_and_prompts(args.model, args.prompts, Path(tmp))
        if args.heldout_ids is not None:  # a trained checkpoint's own held-out text, 64 tokens a prompt
            prompts = heldout_prompts(args.heldout_ids, args.prompts)
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=args.slots,
                                                   dtype=getattr(torch, args.dtype),
                                                   predictor_path=args.predictor_path,
                                                   fill_confidence=args.fill_confidence,
                                                   reuse_weight=args.reuse_weight,
                                                   spare_recent=args.spare_recent,
                                                   prefetch_budget=args.prefetch_budget, bypass=args.bypass)
        sampling = dict(temperature=args.temperature, seed=args.seed)
        traces = [record_routing(engine, prompt, args.new_tokens, **sampling) for prompt in prompts]
        tokens = sum(trace.decode_tokens for trace in traces)
        belady = sum(belady_misses(t.uses, engine.residency.n_slots, t.first_decode) for t in traces) / tokens
        base = {"model": args.model, "slots": engine.residency.n_slots, "moe_layers": len(engine.residency.layers),
                "prompts": len(prompts), "new_tokens": args.new_tokens, "routing_history": "cold per prompt",
                "dtype": args.dtype, **sampling}
        rows = [{**base, "system": "belady", "experts_per_token": belady}]
        logger.info("%s, %d slots: Belady %.2f experts/token", args.model, engine.residency.n_slots, belady)
        for policy, halflife, system, lead in points(args, engine.has_mtp):
            predictor, _, cut = system.partition("@")
            engine.options = dataclasses.replace(engine.options, prefetch_lead=lead, policy=policy,
                                                 lrfu_halflife=halflife)
            measured = measure(engine, prompts, args.new_tokens, predictor, float(cut or 0.0),
                               None if predictor in ("none", "oracle_next") else args.lookahead, **sampling)
            row = {**base, "policy": policy, "lrfu_halflife": halflife, "system": system, "prefetch_lead": lead,
                   "fill_confidence": args.fill_confidence, "lookahead": args.lookahead,
                   "reuse_weight": args.reuse_weight, "prefetch_budget": args.prefetch_budget,
                   "bypass": args.bypass,
                   "spare_recent": engine.residency.cfg.spare_recent,  # what the calls ran (oracles spare nothing)
                   **measured}
            row.pop("sequences")  # counts only in the report
            rows.append(row)
            logger.info("%s (%s, half-life %g) lead %d: %.2f experts/token, %.2f misses/token", system, policy,
                        halflife, lead, row["experts_per_token"], row["misses_per_token"])
        engine.close()
    if args.out is not None:
        report = json.loads(args.out.read_text()) if args.out.is_file() else {"rows": []}
        report["rows"] += rows
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
