"""Exact accounting of every routed-expert need, copy, eviction and prediction; imports no model code.

Vocabulary (per generate call):
- a *use* is one distinct (step, layer, expert) needed by the rows that must be exact (real tokens and, under
  speculative decoding, drafts being verified);
- its *outcome* is `hit` (resident, not brought by an unused prefetch), `prefetched` (brought by a prefetch that had
  landed in time), `late` (brought by a prefetch still in flight: compute waited) or `miss` (reactive fetch);
  hits = hit + prefetched + late, so hits + misses = uses;
- `bytes_h2d` counts every routed-expert byte copied host->device (reactive fetches and prefetches);
- a prefetch is `useful` (first used in time), `late`, or `wasted` (evicted, or still unused at the end of the call);
- prediction recall/precision compare, per (decode step, layer), the experts predicted before the layer ran with the
  experts it truly needed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

OUTCOMES = ("hit", "prefetched", "late", "miss")


@dataclass
class LayerCounters:
    uses: int = 0
    hit: int = 0
    prefetched: int = 0
    late: int = 0
    miss: int = 0
    bytes_h2d: int = 0
    evictions: int = 0
    prefetch_issued: int = 0
    prefetch_useful: int = 0
    prefetch_late: int = 0
    prefetch_wasted: int = 0
    predicted: int = 0  # |P| summed over (step, layer)
    truth: int = 0  # |N| summed over decode (step, layer)
    predicted_correct: int = 0  # |P ∩ N|
    lead_layers_sum: int = 0

    def as_dict(self) -> dict[str, Any]:
        hits = self.hit + self.prefetched + self.late
        out = {
            "expert_uses": self.uses,
            "hits": hits,
            "misses": self.miss,
            "hit_rate": hits / self.uses if self.uses else 0.0,
            "bytes_h2d": self.bytes_h2d,
            "evictions": self.evictions,
            "prefetch_issued": self.prefetch_issued,
            "prefetch_useful": self.prefetch_useful,
            "prefetch_late": self.prefetch_late,
            "prefetch_wasted": self.prefetch_wasted,
            "prediction_recall": self.predicted_correct / self.truth if self.truth else 0.0,
            "prediction_precision": self.predicted_correct / self.predicted if self.predicted else 0.0,
            "predicted": self.predicted,  # raw counts, so runs can be merged exactly
            "truth": self.truth,
            "predicted_correct": self.predicted_correct,
        }
        return out


@dataclass
class Stats:
    """What a generate call did and how fast; `to_dict()` is the stable, documented view."""

    totals: LayerCounters = field(default_factory=LayerCounters)
    per_layer: dict[int, LayerCounters] = field(default_factory=dict)
    stall_seconds: float = 0.0
    prefill_stall_seconds: float = 0.0
    decode_stall_seconds: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_proposed: int = 0
    draft_accepted: int = 0
    speculative: bool = False
    predictor: str = "none"
    lookahead: int = 1
    policy: str = "lru"
    cache_slots: int = 0
    expert_bytes: int = 0
    mtp_drafts_checked: int = 0
    mtp_drafts_correct: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        t = self.totals
        out = t.as_dict()
        decode_tokens = max(self.generated_tokens - self._first_tokens(), 0)
        out.update(
            {
                "mtp_drafts_checked": self.mtp_drafts_checked,
                "mtp_drafts_correct": self.mtp_drafts_correct,
                "stall_seconds": self.stall_seconds,
                "prefill_stall_seconds": self.prefill_stall_seconds,
                "decode_stall_seconds": self.decode_stall_seconds,
                "stall_ms_per_token": 1000.0 * self.decode_stall_seconds / decode_tokens if decode_tokens else 0.0,
                "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens,
                "decode_steps": self.decode_steps,
                "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds,
                "prefill_tokens_per_s": self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0,
                "decode_tokens_per_s": decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
                "ms_per_token": 1000.0 * self.decode_seconds / decode_tokens if decode_tokens else 0.0,
                "miss_coverage": (t.prefetch_useful + t.prefetch_late)
                / max(t.prefetch_useful + t.prefetch_late + t.miss, 1),
                "prefetch_wasted_bytes": t.prefetch_wasted * self.expert_bytes,
                "mean_lead_layers": t.lead_layers_sum / max(t.prefetch_useful + t.prefetch_late, 1),
                "predictor": self.predictor,
                "lookahead": self.lookahead,
                "policy": self.policy,
                "cache_slots": self.cache_slots,
                "expert_bytes": self.expert_bytes,
                "speculative": self.speculative,
                "mtp_draft_accuracy": self.mtp_drafts_correct / self.mtp_drafts_checked
                if self.mtp_drafts_checked
                else None,
                "per_layer": {str(layer): c.as_dict() for layer, c in sorted(self.per_layer.items())},
            }
        )
        if self.speculative:
            out["draft_proposed"] = self.draft_proposed
            out["draft_accepted"] = self.draft_accepted
            out["draft_acceptance"] = self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0
        out.update(self.extra)
        return out

    def main_layer_prediction(self, main_layers: set[int]) -> dict[str, float]:
        """Recall/precision over the model's main MoE layers only: the MTP head's own layer is the drafter, not part
        of the next step's routing, and no predictor predicts it."""
        counters = [c for layer, c in self.per_layer.items() if layer in main_layers]
        truth = sum(c.truth for c in counters)
        predicted = sum(c.predicted for c in counters)
        correct = sum(c.predicted_correct for c in counters)
        return {
            "prediction_recall_main_layers": correct / truth if truth else 0.0,
            "prediction_precision_main_layers": correct / predicted if predicted else 0.0,
        }

    def _first_tokens(self) -> int:
        # The first generated token of each sequence comes out of prefill; decode throughput excludes it.
        return int(self.extra.get("sequences", 0))


class Accounting:
    """Collects per-use outcomes and derived counters; optionally keeps every event for a JSONL log."""

    def __init__(self, keep_events: bool = False):
        self.keep_events = keep_events
        self.events: list[dict[str, Any]] = []
        self.stats = Stats()
        self._predicted: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)  # (step, layer) -> expert -> lead

    def _layer(self, layer: int) -> LayerCounters:
        counters = self.stats.per_layer.get(layer)
        if counters is None:
            counters = self.stats.per_layer[layer] = LayerCounters()
        return counters

    def _bump(self, layer: int, name: str, amount: int = 1) -> None:
        setattr(self.stats.totals, name, getattr(self.stats.totals, name) + amount)
        counters = self._layer(layer)
        setattr(counters, name, getattr(counters, name) + amount)

    def _log(self, **event: Any) -> None:
        if self.keep_events:
            self.events.append(event)

    # ---- events ---------------------------------------------------------------------------------------------------
    def use(self, step: int, phase: str, layer: int, expert: int, outcome: str, lead_layers: int = 0) -> None:
        assert outcome in OUTCOMES
        self._bump(layer, "uses")
        self._bump(layer, outcome)
        if outcome == "prefetched":
            self._bump(layer, "prefetch_useful")
        elif outcome == "late":
            self._bump(layer, "prefetch_late")
        if outcome in ("prefetched", "late"):
            self._bump(layer, "lead_layers_sum", lead_layers)
        self._log(kind="use", step=step, phase=phase, layer=layer, expert=expert, outcome=outcome)

    def copy(self, step: int, layer: int, expert: int, nbytes: int, prefetch: bool) -> None:
        self._bump(layer, "bytes_h2d", nbytes)
        if prefetch:
            self._bump(layer, "prefetch_issued")
        self._log(kind="prefetch" if prefetch else "fetch", step=step, layer=layer, expert=expert, bytes=nbytes)

    def eviction(self, step: int, layer: int, expert: int, unused_prefetch: bool) -> None:
        self._bump(layer, "evictions")
        if unused_prefetch:
            self._bump(layer, "prefetch_wasted")
        self._log(kind="evict", step=step, layer=layer, expert=expert, wasted=unused_prefetch)

    def unused_at_end(self, layer: int, count: int = 1) -> None:
        self._bump(layer, "prefetch_wasted", count)

    # ---- predictions ----------------------------------------------------------------------------------------------
    def predicted(self, step: int, layer: int, experts: Iterable[int], lead_layers: int) -> None:
        table = self._predicted[(step, layer)]
        for expert in experts:
            table.setdefault(int(expert), lead_layers)

    def truth(self, step: int, layer: int, experts: Iterable[int]) -> None:
        """Score the predictions made for (step, layer) against the experts it truly needed (decode steps)."""
        needed = {int(e) for e in experts}
        predicted = self._predicted.pop((step, layer), {})
        self._bump(layer, "truth", len(needed))
        self._bump(layer, "predicted", len(predicted))
        self._bump(layer, "predicted_correct", len(needed & set(predicted)))

    def discard_predictions(self, before: tuple[int, int] | None = None) -> None:
        if before is None:
            self._predicted.clear()
            return
        for key in [k for k in self._predicted if k < before]:
            del self._predicted[key]

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as fh:
            for event in self.events:
                fh.write(json.dumps(event) + "\n")


def prediction_table(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-layer rows (layer, recall, precision, hit_rate, misses, prefetch counts) from `Stats.to_dict()`."""
    rows = []
    for layer, counters in stats.get("per_layer", {}).items():
        rows.append({"layer": int(layer), **{k: counters[k] for k in (
            "prediction_recall", "prediction_precision", "hit_rate", "expert_uses", "misses",
            "prefetch_issued", "prefetch_useful", "prefetch_late", "prefetch_wasted")}})
    return sorted(rows, key=lambda r: r["layer"])
