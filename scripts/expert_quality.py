#!/usr/bin/env python
"""Quality of compressed experts, measured through the engine itself: held-out perplexity of a checkpoint with its
routed experts in the model dtype, FP8, int8 and int4 (group sizes, symmetric or not), and greedy-token agreement
with the model-dtype engine over generated continuations.

    python scripts/expert_quality.py --checkpoint moeprefetch/reference_model --corpus .device-data/corpus \
        --formats model,fp8,int4:128,int4:64,int4s:128 --out experiments/results/expert_quality_reference.json

Perplexity: non-overlapping windows of the corpus' held-out ids (heldout_ids.npy), each scored by one full forward
(`MoEPrefetchEngine.forward`); every expert resident, so only the format differs between rows. Agreement: greedy
continuations of held-out prompts, the share of positions equal to the model-dtype engine's up to the first
difference and overall (after a first difference the contexts differ, so the overall share is a looser measure).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moeprefetch import MoEPrefetchEngine

LOG = logging.getLogger("expert_quality")


def parse_format(spec: str) -> dict:
    """'model' | 'fp8' | 'int8' | 'int4:G' (asymmetric groups of G) | 'int4s:G' (symmetric) -> engine options."""
    name, _, group = spec.partition(":")
    if name in ("int4", "int4s"):
        return dict(expert_dtype="int4", int4_group_size=int(group or 128), int4_symmetric=name == "int4s")
    if group:
        raise SystemExit(f"format {spec!r}: only int4 formats take a group size")
    return dict(expert_dtype=name)


def heldout_perplexity(engine: MoEPrefetchEngine, ids: np.ndarray, window: int, max_tokens: int,
                       batch: int) -> tuple[float, int]:
    """exp(mean next-token loss) over non-overlapping windows of `window` + 1 ids."""
    count = max(1, min(max_tokens // window, (len(ids) - 1) // window))
    windows = torch.from_numpy(ids[: count * window + 1].astype(np.int64))
    rows = torch.stack([windows[i * window : (i + 1) * window + 1] for i in range(count)])
    total, tokens = 0.0, 0
    for start in range(0, count, batch):
        chunk = rows[start : start + batch]
        logits = engine.forward(chunk[:, :-1].tolist()).float().cpu()
        loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        tokens += chunk[:, 1:].numel()
    return math.exp(total / tokens), tokens


def greedy_agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    prefix, same, total = 0, 0, 0
    for ref, out in zip(reference, tokens):
        n = min(len(ref), len(out))
        first = next((i for i in range(n) if ref[i] != out[i]), n)
        prefix += first
        same += sum(a == b for a, b in zip(ref[:n], out[:n]))
        total += len(ref)
    return {"agree_before_first_difference": prefix / total, "agree_overall": same / total, "tokens": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, required=True, help="a corpus directory with heldout_ids.npy")
    parser.add_argument("--formats", default="model,fp8,int8,int4:128,int4:64,int4s:128")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=65536, help="held-out predictions scored")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ids = np.load(ns.corpus / "heldout_ids.npy")
    dtype = ns.dtype or ("bfloat16" if ns.device.startswith("cuda") else "float32")
    prompt_starts = np.linspace(0, len(ids) - 64, ns.prompts).astype(int)
    prompts = [ids[s : s + 32].astype(np.int64).tolist() for s in prompt_starts]
    rows, reference_tokens = [], None
    for spec in ns.formats.split(","):
        options = parse_format(spec)
        start = time.perf_counter()
        with MoEPrefetchEngine.from_pretrained(ns.checkpoint, device=ns.device, dtype=dtype, max_seq_len=1024,
                                               max_batch_size=max(ns.batch, ns.prompts), **options) as engine:
            load_s = time.perf_counter() - start
            ppl, scored = heldout_perplexity(engine, ids, ns.window, ns.max_tokens, ns.batch)
            result = engine.generate(prompts, max_new_tokens=ns.new_tokens, stop_at_eos=False)
            tokens = [list(t) for t in result.sequences]
            record_bytes = engine.memory_stats().get("expert_record_bytes")
        reference_tokens = reference_tokens or tokens
        row = {"format": spec, **options, "perplexity": ppl, "scored_tokens": scored, "load_s": load_s,
               "expert_record_bytes": record_bytes, **greedy_agreement(reference_tokens, tokens)}
        rows.append(row)
        LOG.info("%s: perplexity %.4f, greedy agreement %.3f (before a first difference %.3f)", spec, ppl,
                 row["agree_overall"], row["agree_before_first_difference"])
    base = rows[0]["perplexity"]
    for row in rows:
        row["perplexity_vs_first"] = row["perplexity"] / base
    env = {"device": torch.cuda.get_device_name() if ns.device.startswith("cuda") else platform.processor() or "cpu",
           "torch": torch.__version__, "dtype": dtype, "checkpoint": str(ns.checkpoint), "window": ns.window,
           "prompts": ns.prompts, "new_tokens": ns.new_tokens}
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    for row in rows:
        print(f"{row['format']:>10}  ppl {row['perplexity']:9.4f}  x{row['perplexity_vs_first']:.4f}  "
              f"agree {row['agree_overall']:.3f} / prefix {row['agree_before_first_difference']:.3f}  "
              f"record {row['expert_record_bytes']}")


if __name__ == "__main__":
    main()
