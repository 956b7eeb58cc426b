"""Learned routing predictor on a checkpoint trained on the project's corpus (the shipped reference model by default,
on the CPU; the deep benchmark model on the H200): train on the corpus' training ids, evaluate on its held-out ids
next to the `previous` and `mtp_router` baselines -> experiments/results/learned_predictor_reference.json.

Needs .device-data/corpus (reference/build_corpus.py). Usage: python experiments/learned_predictor_reference.py
[--checkpoint DIR --device cuda] [--train-tokens N] [--eval-tokens N] [--steps N] [--leads K] [--no-mtp --out FILE]
[--head FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import numpy as np
import torch

from moeprefetch.predictor_training import TrainSettings, format_table, train_predictor

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", default=str(ROOT / ".device-data" / "corpus"))
    parser.add_argument("--checkpoint", default=str(ROOT / "moeprefetch" / "reference_model"),
                        help="the checkpoint whose routing is learned (default: the shipped reference model)")
    parser.add_argument("--device", default="cpu", help="where the checkpoint runs while its routing is recorded")
    parser.add_argument("--train-tokens", type=int, default=600_000)
    parser.add_argument("--eval-tokens", type=int, default=160_000)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--leads", type=int, default=2)
    parser.add_argument("--horizon", type=int, default=0, help="also learn 'needed within H tokens' (victims)")
    parser.add_argument("--record-dtype", default=None, help="the dtype the routing is recorded in (default: the "
                        "engine's on --device, bfloat16 on CUDA)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (small GEMMs: 1 is fastest here)")
    parser.add_argument("--no-mtp", action="store_true", help="the head sees the final hidden state only")
    parser.add_argument("--head", default="/tmp/learned_predictor_reference.safetensors",
                        help="where the trained head goes (the shipped one: moeprefetch/reference_model/"
                             "routing_head.safetensors)")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "learned_predictor_reference.json"))
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    torch.set_num_threads(ns.threads)
    corpus = Path(ns.corpus)
    train = np.load(corpus / "train_ids.npy")[: ns.train_tokens].astype(np.int64)
    held = np.load(corpus / "heldout_ids.npy")[: ns.eval_tokens].astype(np.int64)
    settings = TrainSettings(leads=ns.leads, steps=ns.steps, max_tokens=max(ns.train_tokens, ns.eval_tokens),
                             use_mtp=not ns.no_mtp, horizon=ns.horizon, record_dtype=ns.record_dtype)
    began = time.monotonic()
    out = Path(ns.head)
    result = train_predictor(ns.checkpoint, torch.from_numpy(train), out, settings=settings, device=ns.device,
                             eval_ids=torch.from_numpy(held), resume=False, progress=False)
    print(format_table(result))
    result.update({"seconds": round(time.monotonic() - began, 1), "train_tokens": int(train.size),
                   "eval_tokens_given": int(held.size), "settings": vars(settings) if hasattr(settings, "__dict__")
                   else str(settings), "checkpoint": ns.checkpoint, "device": ns.device, "threads": ns.threads,
                   "cpu": platform.processor(),
                   "torch": torch.__version__, "train_source": "train_ids.npy head",
                   "eval_source": "heldout_ids.npy head", "head_inputs": "final hidden" if ns.no_mtp else
                   "final hidden + MTP output",
                   "note": "recall@k == precision@k when exactly k experts are guessed (each layer uses k)"})
    Path(ns.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
