"""Which victims a learned routing head should pick: experts moved per token by cache rules that use its predictions,
on a trained checkpoint's teacher-forced held-out text (CPU) -> experiments/results/learned_victims_<name>.json.

The checkpoint runs once over held-out windows (`routing_record.py`: each main MoE layer's top-k per token, the
final hidden state and the MTP output); its routing head (`learned_predictor.py`) gives, at every token t, the
probability of every (layer, expert) at tokens t+1..t+leads. One cache of `--slots` experts then replays the tokens
in order, layer by layer, every miss admitted over a victim not used by the current token (a miss with no eligible
victim is read in place), under each rule:

| rule | victims |
|---|---|
| `lru`, `lrfu` | least recently used; lowest use frequency decayed by half every 8 tokens (the engine's default) |
| `lrfu+protect@c` | lrfu, never an expert the head named (top-k) for this token or the next with probability >= c |
| `lrfu+protect2k@c` | the same with the head's top-2k |
| `reuse@w` | lowest w * P(needed by the rest of this token or the next) + (1 - w) * lrfu rank (both in [0, 1]) |
| `reuse_step@w` | the same with P(needed by this token or the next), as a queue sorted at the token's start has it |
| `reuse_soon@w` | the same with the head's own "needed soon" (`RoutingHead.predict`: its horizon block if it has one) |
| `oracle_next` | lrfu, never an expert this token or the next needs (the one-token ceiling) |
| `<rule>+bypass` | `<rule>`'s victims, but a miss is read in place without admission when the head's "needed soon"
  probability of the miss is below its victim's (both from `RoutingHead.predict`) |
| `<rule>+bypass@c` | the same, a miss admitted only at "needed soon" >= c |
| `belady` | the expert needed farthest in the future |

Counts are bytes a policy asks for (misses), not time: fills would move some of them off the critical path. The
engine's own plans replay real traces in `moeprefetch replay`; this script explores rules before one is built.

    python experiments/learned_victims.py --checkpoint .device-data/deep --slots 518 --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from moeprefetch import MoEPrefetchEngine
from moeprefetch.learned_predictor import load_predictor
from moeprefetch.routing_record import record_routing

ROOT = Path(__file__).resolve().parent.parent
HALFLIFE = 8.0


def recorded(checkpoint: Path, head_path: Path, corpus: Path, tokens: int, window: int, dtype: str
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ids [N, L, k], probabilities [N, leads, L, E] the head gave at each token for the next tokens, its "needed
    soon" probabilities [N, L, E] (`RoutingHead.predict`), window [N]), routing recorded in `dtype`."""
    held = np.load(corpus / "heldout_ids.npy")[:tokens].astype(np.int64).tolist()
    windows = [held[i:i + window] for i in range(0, len(held), window)]
    with MoEPrefetchEngine.from_pretrained(checkpoint, dtype=dtype, max_batch_size=1) as engine:
        record = record_routing(engine, windows, progress=True)
    head = load_predictor(head_path, checkpoint)
    leads, soon = [], []
    with torch.no_grad():
        for i in torch.arange(record.tokens).split(4096):
            ids, _, s = head.predict(record.hidden[i], None if record.mtp_hidden is None else record.mtp_hidden[i])
            leads.append(torch.sigmoid(head(record.hidden[i], None if record.mtp_hidden is None else
                                            record.mtp_hidden[i])[:, : head.config.leads]))
            soon.append(s)
    return record.ids.numpy(), torch.cat(leads).numpy(), torch.cat(soon).numpy(), record.window.numpy()


def replay(ids: np.ndarray, probs: np.ndarray, window: np.ndarray, slots: int, rule: str,
           soon: np.ndarray | None = None) -> dict:
    """Misses per token of one rule over every token in order (one warm cache throughout)."""
    n, layers, k = ids.shape
    experts = probs.shape[-1]
    keys = layers * experts
    cached = np.zeros(keys, bool)
    count = 0
    last_use = np.full(keys, -1.0)
    freq = np.zeros(keys)
    decay = 0.5 ** (1.0 / HALFLIFE)
    needed = np.zeros((n, keys), bool)
    for t in range(n):
        needed[t, (np.arange(layers)[:, None] * experts + ids[t]).ravel()] = True
    next_need = None
    if rule == "belady":
        next_need = np.full((n + 1, keys), np.inf)
        for t in range(n - 1, -1, -1):
            next_need[t] = np.where(needed[t], t, next_need[t + 1])
    rule_name, _, bypass_rule = rule.partition("+bypass")
    name, _, arg = rule_name.partition("@")
    arg = float(arg) if arg else 0.0
    bypass_at = float(bypass_rule[1:]) if bypass_rule.startswith("@") else None  # None: compare with the victim
    bypassing = "+bypass" in rule
    misses = bypass = 0
    layer_of = np.repeat(np.arange(layers), experts)
    for t in range(n):
        freq *= decay
        # the head's guesses made at token t-1 (for this token: lead 1; the next: lead 2), inside one window
        known = t > 0 and window[t - 1] == window[t]
        now_p = probs[t - 1, 0].ravel() if known else np.zeros(keys)
        next_p = probs[t - 1, 1].ravel() if known and probs.shape[1] > 1 else np.zeros(keys)
        soon_p = soon[t - 1].ravel() if known else np.zeros(keys)  # the head's own "needed soon"
        if name == "reuse_soon":  # (its horizon block, when it has one)
            now_p, next_p = np.zeros(keys), soon_p
        protect = np.zeros(keys, bool)
        if name in ("lrfu+protect", "lrfu+protect2k") and known:
            g = k if name == "lrfu+protect" else 2 * k
            for lead_p in (probs[t - 1, 0],) + ((probs[t - 1, 1],) if probs.shape[1] > 1 else ()):
                top = np.argsort(-lead_p, axis=-1)[:, :g]
                chosen = (np.arange(layers)[:, None] * experts + top).ravel()
                protect[chosen[lead_p.ravel()[chosen] >= arg]] = True
        elif name == "oracle_next":
            protect = needed[t] | (needed[t + 1] if t + 1 < n else False)
        used_now = np.zeros(keys, bool)
        for p in range(layers):
            for e in ids[t, p]:
                key = p * experts + e
                if not cached[key]:
                    misses += 1
                    eligible = cached & ~used_now & ~protect
                    if name == "oracle_next":
                        eligible &= ~((layer_of > p) & needed[t])
                    if count < slots:
                        cached[key] = True
                        count += 1
                    elif eligible.any():
                        # Belady: a later layer of this token needs a key at t, before anything after it
                        soonest = None if next_need is None else np.where((layer_of > p) & needed[t], t,
                                                                          next_need[t + 1])
                        victim = _victim(name, arg, eligible, last_use, freq, now_p, next_p, layer_of, p, soonest)
                        if bypassing and known and (soon_p[key] < bypass_at if bypass_at is not None
                                                    else soon_p[key] < soon_p[victim]):
                            bypass += 1  # read in place: the victim is likelier to be needed soon than the miss
                        else:
                            cached[victim] = False
                            cached[key] = True
                    else:
                        bypass += 1
                used_now[key] = True
                last_use[key] = t * layers + p
        freq[used_now] += 1.0
    return {"rule": rule, "misses_per_token": misses / n, "bypass_per_token": bypass / n,
            "hit_rate": 1 - misses / (n * layers * k)}


def _victim(name: str, arg: float, eligible: np.ndarray, last_use: np.ndarray, freq: np.ndarray, now_p: np.ndarray,
            next_p: np.ndarray, layer_of: np.ndarray, layer: int, next_need: np.ndarray | None) -> int:
    idx = np.flatnonzero(eligible)
    if name == "belady":
        return int(idx[np.argmax(next_need[idx])])
    if name == "lru":
        return int(idx[np.argmin(last_use[idx])])
    lrfu = freq[idx] * 1e6 + last_use[idx] * 1e-3  # frequency first, ties by recency
    if name not in ("reuse", "reuse_step", "reuse_soon"):
        return int(idx[np.argmin(lrfu)])
    # P(needed again soon): by a later layer of this token (reuse_step: any layer, as a queue sorted once per token
    # at its start sees it), or by the next token
    later = layer_of[idx] > layer if name == "reuse" else np.ones(len(idx), bool)  # reuse_soon: now_p is 0
    reuse = 1 - (1 - np.where(later, now_p[idx], 0.0)) * (1 - next_p[idx])
    rank = np.argsort(np.argsort(lrfu)) / max(len(idx) - 1, 1)
    return int(idx[np.argmin(arg * reuse + (1 - arg) * rank)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / ".device-data" / "deep")
    parser.add_argument("--corpus", type=Path, default=ROOT / ".device-data" / "corpus")
    parser.add_argument("--head", type=Path, default=None, help="the routing head (default: the checkpoint's "
                        "routing_head.safetensors)")
    parser.add_argument("--dtype", default="float32", help="the compute dtype the routing is recorded in")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--slots", type=int, default=518)
    parser.add_argument("--rules", default="lru,lrfu,lrfu+protect@0.0,lrfu+protect@0.2,lrfu+protect2k@0.05,"
                                           "reuse@0.5,reuse@0.8,reuse@1.0,oracle_next,belady")
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(2)
    began = time.monotonic()
    head = ns.head or ns.checkpoint / "routing_head.safetensors"
    ids, probs, soon, window = recorded(ns.checkpoint, head, ns.corpus, ns.tokens, ns.window, ns.dtype)
    rows = []
    for rule in ns.rules.split(","):
        row = replay(ids, probs, window, ns.slots, rule, soon)
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    out = ns.out or ROOT / "experiments" / "results" / f"learned_victims_{ns.checkpoint.name}.json"
    out.write_text(json.dumps({"checkpoint": str(ns.checkpoint), "head": str(head), "dtype": ns.dtype,
                               "tokens": int(ids.shape[0]), "slots": ns.slots,
                               "keys": int(ids.shape[1] * probs.shape[-1]), "window": ns.window,
                               "lrfu_halflife": HALFLIFE, "seconds": round(time.monotonic() - began, 1),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
