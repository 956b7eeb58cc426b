"""Exact accounting of every routed-expert need, transfer, eviction and prediction, from the table's device counters.

The residency plans count on the device (one row of counters per MoE layer); the host reads them once after prefill
and once at the end of a call. Vocabulary (per generate call):

- a *use* is one distinct (step, layer, expert) needed by the rows that must be exact (real tokens and, under
  speculative decoding, drafts being verified);
- its *outcome* is `hit` (published, not brought by an unused prefetch), `prefetched` (brought by a prefetch that
  landed in time), `late` (its prefetch was still in flight: with `late_prefetch="wait"`, the default, read
  from its slot once the fill landed, if it did within the wait's bound, else from host memory; with "reread", from
  host memory) or `miss` (read from host memory,
  and admitted into a victim slot as it streamed when one was free); hits = hit + prefetched + late, so hits + misses
  = uses;
- bytes over the link are *zero-copy* bytes (late and missed experts read in place by the expert kernel, or copied by
  prefill; a late expert whose wait succeeded is not one) plus *fill* bytes (prefetches copied into slots);
- a prefetch is `useful` (first used in time), `late`, or `wasted` (evicted unused, abandoned because its need came
  first, or still unused at the end of the call);
- prediction recall/precision compare, per (decode step, main MoE layer), the experts predicted with enough
  confidence before the layer ran with the experts it truly needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .residency.state import COUNTERS, ResidencyConfig


@dataclass
class LayerCounters:
    uses: int = 0
    hit: int = 0
    prefetched: int = 0
    late: int = 0
    miss: int = 0
    zero_copy: int = 0  # experts read from host memory (count)
    admitted: int = 0
    evictions: int = 0
    prefetch_issued: int = 0
    prefetch_wasted: int = 0
    fills_done: int = 0
    fill_chunks: int = 0
    lead_sum: int = 0  # clock units: two per MoE layer
    predicted: int = 0
    truth: int = 0
    predicted_correct: int = 0
    record_bytes: int = 0
    chunk_bytes: int = 1
    chunks_per_record: int = 1

    @staticmethod
    def from_row(row: list[int], record_bytes: int, chunk_bytes: int) -> "LayerCounters":
        values = dict(zip(COUNTERS, row))
        return LayerCounters(**values, record_bytes=record_bytes, chunk_bytes=chunk_bytes,
                             chunks_per_record=-(-record_bytes // chunk_bytes))

    def __add__(self, other: "LayerCounters") -> "LayerCounters":
        out = LayerCounters(record_bytes=self.record_bytes or other.record_bytes,
                            chunk_bytes=max(self.chunk_bytes, other.chunk_bytes),
                            chunks_per_record=max(self.chunks_per_record, other.chunks_per_record))
        for name in COUNTERS:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def __sub__(self, other: "LayerCounters") -> "LayerCounters":
        out = LayerCounters(record_bytes=self.record_bytes, chunk_bytes=self.chunk_bytes,
                            chunks_per_record=self.chunks_per_record)
        for name in COUNTERS:
            setattr(out, name, getattr(self, name) - getattr(other, name))
        return out

    @property
    def zero_copy_bytes(self) -> int:
        return self.zero_copy * self.record_bytes

    @property
    def fill_bytes(self) -> int:
        partial = self.fill_chunks - self.fills_done * self.chunks_per_record
        return self.fills_done * self.record_bytes + max(partial, 0) * self.chunk_bytes

    @property
    def bytes_h2d(self) -> int:
        return self.zero_copy_bytes + self.fill_bytes

    def as_dict(self) -> dict[str, Any]:
        hits = self.hit + self.prefetched + self.late
        return {
            "expert_uses": self.uses,
            "hits": hits,
            "misses": self.miss,
            "hit_rate": hits / self.uses if self.uses else 0.0,
            "bytes_h2d": self.bytes_h2d,
            "zero_copy_bytes": self.zero_copy_bytes,
            "fill_bytes": self.fill_bytes,
            "admitted": self.admitted,
            "evictions": self.evictions,
            "prefetch_issued": self.prefetch_issued,
            "prefetch_useful": self.prefetched,
            "prefetch_late": self.late,
            "prefetch_wasted": self.prefetch_wasted,
            "prediction_recall": self.predicted_correct / self.truth if self.truth else None,
            "prediction_precision": self.predicted_correct / self.predicted if self.predicted else None,
            "predicted": self.predicted,  # raw counts, so runs can be merged exactly
            "truth": self.truth,
            "predicted_correct": self.predicted_correct,
        }


@dataclass
class Stats:
    """What a generate call did and how fast; `to_dict()` is the stable, documented view."""

    per_layer: dict[int, LayerCounters] = field(default_factory=dict)  # the whole call
    decode_per_layer: dict[int, LayerCounters] = field(default_factory=dict)  # decode steps only
    main_layers: tuple[int, ...] = ()
    prompt_tokens: int = 0
    generated_tokens: int = 0
    sequences: int = 0
    decode_steps: int = 0
    decode_syncs: int = 0  # device->host synchronisations during decode
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0  # from the call's start to its first tokens (every sequence's, after prefill)
    decode_seconds: float = 0.0
    draft_offered: int = 0  # speculation: live rows of verify steps (each could check its drafts)
    # ... drafts reached (those before them kept) and checked (verify_confidence: their chance >= the cut), summed
    # over the draft positions; and kept (the draft was the token sampled before it)
    draft_proposed: int = 0
    draft_accepted: int = 0
    # the same per draft position (draft_tokens > 1: position j's acceptance is of the drafts whose j - 1 before
    # them were kept)
    draft_proposed_by_position: list[int] = field(default_factory=list)
    draft_accepted_by_position: list[int] = field(default_factory=list)
    speculative: bool = False
    predictor: str = "none"
    lookahead: int = 1
    policy: str = ResidencyConfig.policy
    lrfu_halflife: float = ResidencyConfig.frequency_halflife
    cache_slots: int = 0
    expert_bytes: int = 0
    mtp_drafts_checked: int = 0
    mtp_drafts_correct: int = 0
    # streamed layers' weights copied into the VRAM ring, and the compute stream's waits for them
    prefill_stream_bytes: int = 0
    prefill_stream_stall_seconds: float = 0.0
    decode_stream_bytes: int = 0
    decode_stream_stall_seconds: float = 0.0
    # per lead (steps between a prediction and its target), main MoE layers: (predicted, correct, truth)
    lead_counts: list[tuple[int, int, int]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def totals(self) -> LayerCounters:
        return _sum(self.per_layer.values())

    @property
    def decode_tokens(self) -> int:
        # The first generated token of each sequence comes out of prefill; decode throughput excludes it.
        return max(self.generated_tokens - self.sequences, 0)

    def to_dict(self) -> dict[str, Any]:
        t = self.totals
        decode = _sum(self.decode_per_layer.values())
        tokens = self.decode_tokens
        per_token = (lambda v: v / tokens) if tokens else (lambda v: 0.0)
        out = t.as_dict()
        out.update(self.prediction(self.main_layers))
        out.update(
            {
                "mtp_drafts_checked": self.mtp_drafts_checked,
                "mtp_drafts_correct": self.mtp_drafts_correct,
                "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens,
                "decode_steps": self.decode_steps,
                "prefill_seconds": self.prefill_seconds,
                "ttft_seconds": self.ttft_seconds,
                "decode_seconds": self.decode_seconds,
                "prefill_tokens_per_s": self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0,
                "decode_tokens_per_s": tokens / self.decode_seconds if self.decode_seconds else 0.0,
                "ms_per_token": 1000.0 * self.decode_seconds / tokens if tokens else 0.0,
                "syncs_per_token": self.decode_syncs / tokens if tokens else 0.0,
                "decode_bytes_h2d_per_token": per_token(decode.bytes_h2d),
                # the prompts' expert bytes over the link: the plans' misses, and experts copied ahead of a layer's
                # router that the layer then did not use
                "prefill_bytes_h2d": t.bytes_h2d - decode.bytes_h2d
                + int(self.extra.get("prefill_experts_ahead_unused", 0)) * self.expert_bytes,
                "prediction_recall_by_lead": [c / t if t else None for _, c, t in self.lead_counts],
                "prediction_precision_by_lead": [c / p if p else None for p, c, _ in self.lead_counts],
                "streamed_bytes_per_token": per_token(self.decode_stream_bytes),
                "stream_stall_ms_per_token": per_token(1000.0 * self.decode_stream_stall_seconds),
                "prefill_streamed_bytes": self.prefill_stream_bytes,
                "prefill_stream_stall_seconds": self.prefill_stream_stall_seconds,
                "zero_copy_bytes_per_token": per_token(decode.zero_copy_bytes),
                "fill_bytes_per_token": per_token(decode.fill_bytes),
                "decode_hit_rate": (decode.hit + decode.prefetched + decode.late) / decode.uses if decode.uses else 0.0,
                "decode_misses_per_token": per_token(decode.miss),
                "miss_coverage": (t.prefetched + t.late) / max(t.prefetched + t.late + t.miss, 1),
                "prefetch_waste": t.prefetch_wasted / t.prefetch_issued if t.prefetch_issued else None,
                "prefetch_wasted_bytes": t.prefetch_wasted * self.expert_bytes,
                "mean_lead_layers": t.lead_sum / 2 / max(t.prefetched, 1),
                "predictor": self.predictor,
                "lookahead": self.lookahead,
                "policy": self.policy,
                "lrfu_halflife": self.lrfu_halflife,
                "cache_slots": self.cache_slots,
                "expert_bytes": self.expert_bytes,
                "speculative": self.speculative,
                "mtp_draft_accuracy": self.mtp_drafts_correct / self.mtp_drafts_checked
                if self.mtp_drafts_checked else None,
                "per_layer": {str(layer): c.as_dict() for layer, c in sorted(self.per_layer.items())},
            }
        )
        if self.speculative:
            out["draft_offered"] = self.draft_offered
            out["draft_proposed"] = self.draft_proposed
            out["draft_accepted"] = self.draft_accepted
            # of the drafts checked; the tokens a verify step adds per row are draft_accepted / draft_offered
            out["draft_acceptance"] = self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0
            out["draft_proposed_by_position"] = list(self.draft_proposed_by_position)
            out["draft_accepted_by_position"] = list(self.draft_accepted_by_position)
            out["draft_acceptance_by_position"] = [a / p if p else None for a, p in zip(
                self.draft_accepted_by_position, self.draft_proposed_by_position)]
            out["tokens_per_verify_step"] = 1.0 + self.draft_accepted / self.draft_offered \
                if self.draft_offered else None
        out.update(self.extra)
        return out

    def count_drafts(self, offered: int, proposed: list[int], accepted: list[int]) -> None:
        """A verify step's tallies (`decode.Advance`): live rows, and per draft position the drafts checked and
        kept."""
        self.draft_offered += offered
        self.draft_proposed += sum(proposed)
        self.draft_accepted += sum(accepted)
        self.draft_proposed_by_position = _add_lists(self.draft_proposed_by_position, proposed)
        self.draft_accepted_by_position = _add_lists(self.draft_accepted_by_position, accepted)

    def prediction(self, main_layers: tuple[int, ...]) -> dict[str, float | None]:
        """Recall/precision over the model's main MoE layers: the MTP head's own layer is the drafter, and no
        predictor targets it. None when no prediction was scored (the predictor is `none`, or nothing ran)."""
        counters = _sum(c for layer, c in self.per_layer.items() if layer in main_layers)
        scored = counters.predicted > 0
        return {
            "prediction_recall_main_layers": counters.predicted_correct / counters.truth
            if scored and counters.truth else None,
            "prediction_precision_main_layers": counters.predicted_correct / counters.predicted if scored else None,
        }

    def write_jsonl(self, path: str | Path) -> None:
        """One line for the call, then one line per MoE layer with its counters."""
        with open(path, "w") as fh:
            summary = {k: v for k, v in self.to_dict().items() if k != "per_layer"}
            fh.write(json.dumps({"kind": "call", **summary}) + "\n")
            for layer, counters in sorted(self.per_layer.items()):
                decode = self.decode_per_layer.get(layer)
                fh.write(json.dumps({"kind": "layer", "layer": layer, **counters.as_dict(),
                                     "decode": decode.as_dict() if decode else None}) + "\n")


def merge_stats(runs: list[Stats]) -> Stats:
    """Several calls of one configuration as one: counters summed per layer, times and tokens summed (so the
    rates are totals over totals)."""
    merged = Stats(**{k: getattr(runs[0], k) for k in ("main_layers", "speculative", "predictor", "lookahead",
                                                         "policy", "lrfu_halflife", "cache_slots", "expert_bytes")})
    leads = max((len(run.lead_counts) for run in runs), default=0)
    merged.lead_counts = [tuple(sum(run.lead_counts[i][j] for run in runs if i < len(run.lead_counts))
                                for j in range(3)) for i in range(leads)]
    for run in runs:
        for target, source in ((merged.per_layer, run.per_layer), (merged.decode_per_layer, run.decode_per_layer)):
            for layer, counters in source.items():
                target[layer] = target[layer] + counters if layer in target else counters
        for name in ("prompt_tokens", "generated_tokens", "sequences", "decode_steps", "decode_syncs",
                     "prefill_seconds", "ttft_seconds", "decode_seconds", "draft_offered", "draft_proposed",
                     "draft_accepted", "mtp_drafts_checked", "mtp_drafts_correct", "prefill_stream_bytes",
                     "prefill_stream_stall_seconds", "decode_stream_bytes", "decode_stream_stall_seconds"):
            setattr(merged, name, getattr(merged, name) + getattr(run, name))
        merged.draft_proposed_by_position = _add_lists(merged.draft_proposed_by_position,
                                                       run.draft_proposed_by_position)
        merged.draft_accepted_by_position = _add_lists(merged.draft_accepted_by_position,
                                                       run.draft_accepted_by_position)
    merged.extra = {"main_moe_layers": list(merged.main_layers), "runs": len(runs)}
    return merged


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sums of two count lists of any lengths."""
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]


def _sum(items) -> LayerCounters:
    total = LayerCounters()
    for item in items:
        total = total + item
    return total


def prediction_table(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-layer rows (layer, recall, precision, hit_rate, misses, prefetch counts) from `Stats.to_dict()`."""
    rows = []
    for layer, counters in stats.get("per_layer", {}).items():
        rows.append({"layer": int(layer), **{k: counters[k] for k in (
            "prediction_recall", "prediction_precision", "hit_rate", "expert_uses", "misses",
            "prefetch_issued", "prefetch_useful", "prefetch_late", "prefetch_wasted")}})
    return sorted(rows, key=lambda r: r["layer"])
