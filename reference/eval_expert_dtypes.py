#!/usr/bin/env python
"""Accuracy cost of compressed experts (FP8 / int8 block formats) on the reference model's held-out text.

Compares each variant with the uncompressed model (fp32 compute; the checkpoint is bf16) on held-out windows: top-1
agreement of the next-token prediction, mean KL(reference || variant), and the held-out loss itself. Writes a JSON and
a markdown table.

    python reference/eval_expert_dtypes.py --corpus build/corpus --out experiments/results/expert_dtype_accuracy
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moeprefetch import MoEPrefetchEngine  # noqa: E402
from moeprefetch.cli import REFERENCE_MODEL  # noqa: E402


def heldout_windows(corpus: Path, engine: MoEPrefetchEngine, count: int, length: int) -> torch.Tensor:
    ids_file = corpus / "heldout_ids.npy"
    if ids_file.is_file():
        import numpy as np

        ids = torch.from_numpy(np.load(ids_file).astype("int64"))
        stride = max((len(ids) - length) // count, 1)
        return torch.stack([ids[i * stride : i * stride + length] for i in range(count)])
    # without the corpus build: the committed held-out prompts, cut to a common length
    prompts = [json.loads(line)["text"] for line in (ROOT / "experiments/prompts/heldout.jsonl").read_text().splitlines()]
    tokens = [engine.tokenizer(p)["input_ids"] for p in prompts]
    length = min(len(t) for t in tokens)
    return torch.tensor([t[:length] for t in tokens[:count]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REFERENCE_MODEL)
    parser.add_argument("--corpus", type=Path, default=ROOT / "build/corpus")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/expert_dtype_accuracy")
    ns = parser.parse_args(argv)
    start = time.perf_counter()
    reference = MoEPrefetchEngine.from_pretrained(ns.model, progress=False)
    windows = heldout_windows(ns.corpus, reference, ns.windows, ns.length)
    variants = {
        "bf16 compute (all weights)": dict(dtype=torch.bfloat16),
        "fp8 experts (e4m3, 128x128 blocks)": dict(expert_dtype="fp8"),
        "int8 experts (128x128 blocks)": dict(expert_dtype="int8"),
    }
    rows = []
    ref_logits = torch.cat([reference.forward(windows[i : i + 8]) for i in range(0, len(windows), 8)])
    ref_logp = ref_logits.log_softmax(-1)
    targets = windows[:, 1:]

    def loss(logp: torch.Tensor) -> float:
        return float(-logp[:, :-1].gather(-1, targets[..., None]).mean())

    rows.append({"variant": "reference (bf16 weights, fp32 compute)", "expert_bytes": reference.runtime.expert_bytes,
                 "top1_agreement": 1.0, "kl": 0.0, "heldout_loss": loss(ref_logp)})
    for name, kwargs in variants.items():
        engine = MoEPrefetchEngine.from_pretrained(ns.model, progress=False, **kwargs)
        logits = torch.cat([engine.forward(windows[i : i + 8]) for i in range(0, len(windows), 8)])
        logp = logits.float().log_softmax(-1)
        rows.append({
            "variant": name,
            "expert_bytes": engine.runtime.expert_bytes,
            "top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "kl": float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()),
            "heldout_loss": loss(logp),
        })
    result = {"model": str(ns.model), "windows": int(windows.shape[0]), "window_tokens": int(windows.shape[1]),
              "predictions": int(windows.shape[0] * (windows.shape[1] - 1)), "device": "cpu",
              "torch": torch.__version__, "seconds": time.perf_counter() - start, "rows": rows}
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Accuracy cost of compressed experts (reference model, held-out text)",
        "",
        f"{result['windows']} held-out windows x {result['window_tokens']} tokens ({result['predictions']:,} next-token "
        f"predictions), CPU, torch {result['torch']}. Reference: the checkpoint's bf16 weights computed in fp32. The "
        "expert record size is that of the CPU engine's compute dtype (fp32 here; on the GPU the bf16 record is half "
        "of it). Produced by `reference/eval_expert_dtypes.py`.",
        "",
        "| variant | bytes per expert record | top-1 agreement with reference | KL(reference ‖ variant), nats | held-out loss |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['variant']} | {row['expert_bytes']:,} | {row['top1_agreement']:.2%} | {row['kl']:.2e} | "
                     f"{row['heldout_loss']:.4f} |")
    ns.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
