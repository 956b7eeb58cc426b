"""How much of the next token's routing does the next token's identity carry, and can the model's own next-token
distribution carry it a step early? (issue 38: the learned head's next-token recall is 58 % on the deep model
against an aim of 85 %; issue 36: fills need precise guesses.)

A *token routing table* T[v, l, e] counts, over recorded text, how often expert e of MoE layer l routes a token whose
id is v (smoothed towards layer l's overall frequencies). At the end of decode step t the step has the logits of
token t+1, p(v | context), so it can guess token t+1's experts as the mixture sum over v of p(v) T[v] before token
t+1 exists. This script records the checkpoint's teacher-forced routing (CPU, `routing_record.py`) over the first
`--tokens` held-out ids in windows, every `--eval-every`-th window for the evaluation and the others for the table
(windows interleaved: the held-out text changes kind along the file, and a table from its first part scored 17 % on
a later part against 69 % on the text right after it), then reports the next-token recall with top_k guesses per
layer (recall equals precision there) of:

- `previous`: token t's own experts;
- `head`: the checkpoint's trained routing head (`routing_head.safetensors`, its lead-1 block);
- `table_true`: T at the true next token (the ceiling of any guess made from the next token's identity alone);
- `table_mixture`: the mixture over the model's next-token distribution (what decode could compute at step t);
- `table_top1`: T at the model's most likely next token;
- `head+mixture@w`: w x the head's probabilities + (1 - w) x the mixture's.

    python experiments/token_routing_tables.py --checkpoint .device-data/deep --corpus .device-data/corpus \
        --out experiments/results/token_routing_tables_deep.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from moeprefetch import MoEPrefetchEngine
from moeprefetch.learned_predictor import load_predictor
from moeprefetch.routing_record import RoutingRecord, record_routing


def windows_of(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def routing_table(tokens: torch.Tensor, record: RoutingRecord, vocab: int, n_experts: int,
                  smoothing: float) -> torch.Tensor:
    """[V, L, E] float: each token id's expert frequencies per layer, smoothed with `smoothing` pseudo-counts of
    the layer's overall frequencies (an id never seen gets the layer's frequencies)."""
    n, layers, k = record.ids.shape
    counts = torch.zeros(vocab, layers, n_experts)
    hot = torch.zeros(n, layers, n_experts)
    hot.scatter_(2, record.ids, 1.0)
    counts.index_add_(0, tokens, hot)
    overall = hot.sum(0) / n  # [L, E], sums to k per layer
    seen = counts[:, 0].sum(-1, keepdim=True) / k  # occurrences of each id
    return (counts + smoothing * overall) / (seen[..., None] + smoothing)


def recall(scores: torch.Tensor, truth: torch.Tensor, k: int) -> float:
    """scores [S, L, E], truth [S, L, k] -> the share of true experts among each layer's top-k guesses."""
    guess = scores.topk(k, dim=-1).indices
    hit = (guess[..., :, None] == truth[..., None, :]).any(-2)
    return float(hit.float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path(".device-data/deep"))
    parser.add_argument("--corpus", type=Path, default=Path(".device-data/corpus"))
    parser.add_argument("--tokens", type=int, default=90112)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--smoothing", type=float, default=2.0)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args()
    torch.set_num_threads(2)
    began = time.monotonic()
    held = np.load(ns.corpus / "heldout_ids.npy").astype(np.int64).tolist()
    windows = windows_of(held[: ns.tokens], ns.window)
    table_ids = [w for i, w in enumerate(windows) if i % ns.eval_every]
    eval_ids = windows[:: ns.eval_every]
    with MoEPrefetchEngine.from_pretrained(ns.checkpoint, dtype=torch.float32, max_batch_size=1) as engine:
        table_record = record_routing(engine, table_ids, with_mtp=False, progress=True)
        record = record_routing(engine, eval_ids, progress=True)
        with torch.no_grad():
            logits = torch.cat([engine.runner.logits(h[None])[0].float() for h in record.hidden.split(1024)])
        vocab = logits.shape[-1]
        n_experts, top_k = engine.args.n_routed_experts, engine.args.num_experts_per_tok
    record_seconds = time.monotonic() - began
    table = routing_table(torch.tensor([t for w in table_ids for t in w]), table_record, vocab, n_experts,
                          ns.smoothing)
    tokens = torch.tensor([t for w in eval_ids for t in w])
    t = torch.arange(record.tokens - 1)
    t = t[record.window[t + 1] == record.window[t]]  # token t's successor lies in its window
    truth = record.ids[t + 1]
    head = load_predictor(ns.checkpoint / "routing_head.safetensors", ns.checkpoint)
    with torch.no_grad():
        head_p = torch.sigmoid(head(record.hidden[t], None if record.mtp_hidden is None else record.mtp_hidden[t])
                               [:, 0].float())
    layers = truth.shape[1]
    flat = table.reshape(vocab, -1)
    mixture = torch.cat([torch.softmax(logits[i], -1) @ flat for i in t.split(1024)]).view(-1, layers, n_experts)
    rows = {
        "previous": recall(torch.zeros(len(t), layers, n_experts).scatter_(2, record.ids[t], 1.0), truth, top_k),
        "head": recall(head_p, truth, top_k),
        "table_true": recall(table[tokens[t + 1]], truth, top_k),
        "table_mixture": recall(mixture, truth, top_k),
        "table_top1": recall(table[logits[t].argmax(-1)], truth, top_k),
    }
    for w in (0.25, 0.5, 0.75):
        rows[f"head+mixture@{w}"] = recall(w * head_p + (1 - w) * mixture / top_k, truth, top_k)
    top1 = float((logits[t].argmax(-1) == tokens[t + 1]).float().mean())
    result = {"checkpoint": str(ns.checkpoint), "table_tokens": len(table_record.ids), "eval_pairs": len(t),
              "windows": ns.window, "eval_every": ns.eval_every,
              "vocab": vocab, "layers": layers, "n_experts": n_experts, "top_k": top_k, "smoothing": ns.smoothing,
              "next_token_top1_accuracy": top1, "record_seconds": round(record_seconds, 1),
              "seconds": round(time.monotonic() - began, 1), "device": "cpu", "torch": torch.__version__,
              "recall": rows}
    ns.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
