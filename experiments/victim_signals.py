"""Which signals say an expert will be needed soon: the learned head's "needed soon", LRFU's decayed frequency, the
tokens since its last use, the head's next-token probability, alone and blended by a logistic fit
-> experiments/results/victim_signals_<name>.json.

A victim rule can only be as good as its estimate of "needed within the next H tokens". The engine blends the head's
probability with the policy's rank (`reuse_weight`); this measures, on a checkpoint's teacher-forced held-out text
(CPU), how much each signal and the best logistic blend of them separate the experts needed within H tokens from the
rest (ROC AUC and log-loss on tokens the fit never saw). Features are usage-based (not cache-based), so they are the
same under every cache size.

    python experiments/victim_signals.py --checkpoint .device-data/deep --corpus .device-data/corpus_min
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

from learned_victims import recorded  # noqa: E402  (the same recording as its replays)
SIGNALS = ("head_soon", "lrfu_frequency", "since_last_use", "head_next")


def features(ids: np.ndarray, probs: np.ndarray, soon: np.ndarray, window: np.ndarray, experts: int,
             halflife: float) -> tuple[np.ndarray, np.ndarray]:
    """Per token t and key: what is known at t's start ([N, keys, 4], as `SIGNALS`) and whether the key is used by
    token t ([N, keys])."""
    n, layers, _ = ids.shape
    keys = layers * experts
    used = np.zeros((n, keys), bool)
    for t in range(n):
        used[t, (np.arange(layers)[:, None] * experts + ids[t]).ravel()] = True
    logit = lambda p: np.log(np.clip(p, 1e-4, 1 - 1e-4) / (1 - np.clip(p, 1e-4, 1 - 1e-4)))  # noqa: E731
    freq, last = np.zeros(keys), np.full(keys, -1e4)
    decay = 0.5 ** (1.0 / halflife)
    out = np.zeros((n, keys, len(SIGNALS)), np.float32)
    for t in range(n):
        known = t > 0 and window[t - 1] == window[t]  # the head's guesses of token t-1, inside one window
        out[t, :, 0] = logit(soon[t - 1].ravel() if known else np.zeros(keys))
        out[t, :, 1] = np.log(freq + 0.05)
        out[t, :, 2] = np.log1p(np.minimum(t - last, 1e4))
        out[t, :, 3] = logit(probs[t - 1, 0].ravel() if known else np.zeros(keys))
        freq *= decay
        freq[used[t]] += 1.0
        last[used[t]] = t
    return out, used


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """ROC AUC by ranks (ties broken arbitrarily: the scores are continuous)."""
    rank = torch.empty_like(score)
    rank[torch.argsort(score)] = torch.arange(score.numel(), dtype=score.dtype)
    pos = label > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return (float(rank[pos].sum()) - n_pos * (n_pos - 1) / 2) / (n_pos * n_neg)


def fit(x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor) -> dict:
    """A logistic blend of the columns fitted on the train tokens, scored on the test tokens."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
    w = torch.zeros(x_train.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits((x_train - mu) / sd @ w + b, y_train)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        z = (x_test - mu) / sd @ w + b
        return {"weights": (w / sd).tolist(), "log_loss": float(
            torch.nn.functional.binary_cross_entropy_with_logits(z, y_test)), "auc": auc(z, y_test)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / ".device-data" / "deep")
    parser.add_argument("--corpus", type=Path, default=ROOT / ".device-data" / "corpus")
    parser.add_argument("--head", type=Path, default=None, help="default: the checkpoint's routing_head.safetensors")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=24576)
    parser.add_argument("--fit-tokens", type=int, default=8192, help="the first tokens fit the blend; the rest score")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--horizon", type=int, default=8, help="needed within this many tokens (from t)")
    parser.add_argument("--halflife", type=float, default=16.0, help="LRFU's half-life (the engine's default)")
    parser.add_argument("--samples", type=int, default=2_000_000, help="train cells the fit uses at most")
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    began = time.monotonic()
    head = ns.head or ns.checkpoint / "routing_head.safetensors"
    ids, probs, soon, window = recorded(ns.checkpoint, head, ns.corpus, ns.tokens, ns.window, ns.dtype)
    x, used = features(ids, probs, soon, window, probs.shape[-1], ns.halflife)
    n, h = len(ids), ns.horizon
    cum = np.concatenate([np.zeros((1, used.shape[1]), np.int32), np.cumsum(used, 0, dtype=np.int32)])
    soon_label = np.zeros(used.shape, np.float32)
    soon_label[: n - h] = (cum[h:n] - cum[: n - h]) > 0  # used by any of tokens t .. t+h-1
    # tokens whose last token's guesses and next h tokens lie in one window
    ok = np.array([0 < t < n - h and window[t - 1] == window[t] == window[t + h - 1] for t in range(n)])
    train, test = np.flatnonzero(ok[: ns.fit_tokens]), ns.fit_tokens + np.flatnonzero(ok[ns.fit_tokens:])
    pick = torch.randperm(len(train) * x.shape[1])[: ns.samples]
    rows = []
    for cols in ([0], [1], [2], [3], [0, 1], [0, 1, 2], [0, 1, 2, 3]):
        x_train = torch.from_numpy(x[train][:, :, cols].reshape(-1, len(cols)))[pick]
        y_train = torch.from_numpy(soon_label[train].reshape(-1))[pick]
        x_test = torch.from_numpy(x[test][:, :, cols].reshape(-1, len(cols)))
        row = {"signals": [SIGNALS[c] for c in cols],
               **fit(x_train, y_train, x_test, torch.from_numpy(soon_label[test].reshape(-1)))}
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    out = ns.out or ROOT / "experiments" / "results" / f"victim_signals_{ns.checkpoint.name}.json"
    out.write_text(json.dumps({"checkpoint": str(ns.checkpoint), "head": str(head), "dtype": ns.dtype,
                               "tokens": n, "fit_tokens": ns.fit_tokens, "test_tokens": int(len(test)),
                               "horizon": h, "lrfu_halflife": ns.halflife,
                               "base_rate": float(soon_label[test].mean()),
                               "seconds": round(time.monotonic() - began, 1), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
