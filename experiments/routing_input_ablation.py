"""Does the learned routing head predict the next token's experts better when it also sees the current token's
routing? (issue 38: next-token recall is 58 % on the deep model against an aim of 85 %.)

The shipped head (`learned_predictor.RoutingHead`) reads the final hidden state of token t (and the MTP block's
output). At the end of decode step t the step also knows which experts token t used at every MoE layer, and routing
is correlated from token to token (the `previous` predictor). This script records a checkpoint's teacher-forced
routing over the corpus' training and held-out ids (CPU), trains heads of the same shape and training recipe on
three inputs, and reports each one's next-token recall on held-out windows when it names top_k experts per layer
(so recall equals precision):

- `hidden`: the final hidden state (and the MTP output), as shipped;
- `hidden+routing`: the same, plus token t's routing as a multi-hot vector over every layer's experts;
- `routing`: the multi-hot routing alone (a learned `previous`);
- `previous`: token t's own experts as the guess (no training).

    python experiments/routing_input_ablation.py --checkpoint .device-data/deep --corpus .device-data/corpus_min \
        --out experiments/results/routing_input_ablation_deep.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moeprefetch import MoEPrefetchEngine
from moeprefetch.routing_record import RoutingRecord, record_routing


def windows_of(ids: np.ndarray, tokens: int, window: int) -> list[list[int]]:
    ids = ids[:tokens].tolist()
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def pairs(record: RoutingRecord) -> torch.Tensor:
    """Tokens t whose next token lies in the same window."""
    t = torch.arange(record.tokens - 1)
    return t[record.window[t + 1] == record.window[t]]


def multi_hot(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[S, L, k] -> [S, L * E] float."""
    out = torch.zeros(ids.shape[0], ids.shape[1], n_experts)
    out.scatter_(2, ids, 1.0)
    return out.flatten(1)


def features(record: RoutingRecord, index: torch.Tensor, kind: str, n_experts: int) -> torch.Tensor:
    parts = []
    if kind in ("hidden", "hidden+routing"):
        parts.append(record.hidden[index].float())
        if record.mtp_hidden is not None:
            m = record.mtp_hidden[index].float()
            parts.append(m * torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + 1e-6))
    if kind in ("routing", "hidden+routing"):
        parts.append(multi_hot(record.ids[index], n_experts))
    return torch.cat(parts, 1)


def recall(scores: torch.Tensor, truth: torch.Tensor, k: int) -> tuple[float, list[float]]:
    """scores [S, L, E], truth multi-hot [S, L, E] -> overall and per-layer recall of the top-k guess."""
    guess = torch.zeros_like(scores).scatter_(2, scores.topk(k, dim=2).indices, 1.0)
    hit = (guess * truth).sum((0,))  # [L, E]
    per_layer = (hit.sum(1) / truth.sum((0, 2))).tolist()
    return float((guess * truth).sum() / truth.sum()), per_layer


def train_head(x: torch.Tensor, y: torch.Tensor, rank: int, steps: int, batch: int, lr: float, seed: int
               ) -> torch.nn.Module:
    """The shipped head's shape (a low-rank projection, GELU, one linear) and loss (per-expert binary
    cross-entropy), trained with AdamW."""
    torch.manual_seed(seed)
    head = torch.nn.Sequential(torch.nn.Linear(x.shape[1], rank), torch.nn.GELU(), torch.nn.Linear(rank, y.shape[1]))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        pick = torch.randint(0, x.shape[0], (batch,), generator=g)
        loss = F.binary_cross_entropy_with_logits(head(x[pick]), y[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
        for group in opt.param_groups:  # cosine decay
            group["lr"] = lr * 0.5 * (1 + np.cos(np.pi * (step + 1) / steps))
    return head


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default=".device-data/deep")
    parser.add_argument("--corpus", default=".device-data/corpus_min")
    parser.add_argument("--train-tokens", type=int, default=200_000)
    parser.add_argument("--eval-tokens", type=int, default=40_000)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    began = time.monotonic()
    corpus = Path(ns.corpus)
    engine = MoEPrefetchEngine.from_pretrained(ns.checkpoint, device="cpu", dtype="float32", max_batch_size=1,
                                               progress=False)
    train = record_routing(engine, windows_of(np.load(corpus / "train_ids.npy"), ns.train_tokens, ns.window))
    held = record_routing(engine, windows_of(np.load(corpus / "heldout_ids.npy"), ns.eval_tokens, ns.window))
    n_experts, k = engine.args.n_routed_experts, train.ids.shape[2]
    layers = train.ids.shape[1]
    engine.close()
    recorded_s = time.monotonic() - began
    ti, hi = pairs(train), pairs(held)
    y_train = multi_hot(train.ids[ti + 1], n_experts)
    y_held = multi_hot(held.ids[hi + 1], n_experts).view(-1, layers, n_experts)
    rows: dict[str, dict] = {}
    current = multi_hot(held.ids[hi], n_experts).view(-1, layers, n_experts)  # exactly k per layer: its top-k
    overall, per_layer = recall(current, y_held, k)
    rows["previous"] = {"recall": overall, "recall_per_layer": per_layer, "inputs": 0}
    for kind in ("hidden", "hidden+routing", "routing"):
        start = time.monotonic()
        x = features(train, ti, kind, n_experts)
        head = train_head(x, y_train, ns.rank, ns.steps, ns.batch, ns.lr, seed=0)
        with torch.no_grad():
            scores = head(features(held, hi, kind, n_experts)).view(-1, layers, n_experts)
        overall, per_layer = recall(scores, y_held, k)
        rows[kind] = {"recall": overall, "recall_per_layer": per_layer, "inputs": x.shape[1],
                      "train_seconds": time.monotonic() - start}
        print(json.dumps({"input": kind, "recall": round(overall, 4), "inputs": x.shape[1]}), flush=True)
    result = {"checkpoint": ns.checkpoint, "train_tokens": int(ti.numel()), "heldout_tokens": int(hi.numel()),
              "layers": layers, "n_experts": n_experts, "top_k": k, "steps": ns.steps, "batch": ns.batch,
              "rank": ns.rank, "lr": ns.lr, "record_seconds": recorded_s, "device": "cpu",
              "torch": torch.__version__, "rows": rows}
    print(json.dumps({name: round(r["recall"], 4) for name, r in rows.items()}))
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
