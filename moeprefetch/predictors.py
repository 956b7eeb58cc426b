"""Expert predictors: given what the engine knows now, which experts will upcoming (step, layer) pairs need?

One small interface. The engine calls `on_step_start` before each step and `on_layer` after each MoE layer's routers
have run (real rows, and the MTP shadow rows when a predictor asks for them); each returns `Prediction`s — a ranked
list of experts for a future (step, layer), the time they will be needed. Predictions never change what is
computed: a wrong one costs a wasted copy, a missing one a reactive fetch.

- `none`: reactive fetch only.
- `previous`: the experts the previous token used at the same layer (lead: one step).
- `next_layer_gate`: routers of layers l+1..l+d applied to the hidden state at layer l (mixtral-offloading's design;
  lead: d layers).
- `mtp`: the MTP head's draft of the next token runs as a shadow row through the main layers using only experts
  already in VRAM; its router choices at layer l are the predicted experts of (step+1, l) (lead: one step).
- `mtp_router` (a cheaper variant): every main layer's router applied to the MTP head's output hidden state at the
  end of a step predicts the next step's experts for all layers at once (no shadow row; lead: l layers).
- `oracle`: the routing recorded by an earlier identical run (the upper bound).
- combinations such as `mtp+next_layer_gate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

PREDICTOR_NAMES = ("none", "previous", "next_layer_gate", "mtp", "mtp_router", "oracle")

Trace = dict[tuple[int, int], list[int]]  # (step, layer) -> experts needed, in first-use order


@dataclass(frozen=True)
class Prediction:
    step: int
    layer: int  # checkpoint layer index
    experts: tuple[int, ...]  # ranked, best first
    source: str


@dataclass
class LayerObservation:
    """What the engine knows right after the routers of (step, layer) ran."""

    step: int
    layer: int
    phase: str  # "prefill" | "decode"
    real_experts: list[int]  # experts the exact rows need at this layer (distinct, first-use order)
    real_scores: torch.Tensor | None  # [rows, E] router selection scores of the exact rows (host)
    shadow_scores: torch.Tensor | None  # [shadow rows, E] scores of the MTP shadow rows (host), if any
    hidden: torch.Tensor | None  # [rows, H] router input of the exact rows (device), for look-ahead gates
    score_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None  # (layer, hidden) -> scores [rows, E]
    gate_ranked: dict[int, tuple[int, ...]] | None = None  # next layers' routers on this hidden, computed on device


@dataclass
class PredictorContext:
    moe_layers: list[int]  # checkpoint layer indices of the main MoE layers, in order
    top_k: int
    width: int  # experts to emit per row and target
    lookahead: int
    trace: Trace = field(default_factory=dict)


def _ranked(scores: torch.Tensor, width: int) -> tuple[int, ...]:
    """Rows' top-`width` experts merged by rank (rank 0 of every row first, then rank 1, ...)."""
    width = min(width, scores.shape[-1])
    top = scores.float().topk(width, dim=-1).indices.tolist()
    ranked: list[int] = []
    for rank in range(width):
        for row in top:
            if row[rank] not in ranked:
                ranked.append(row[rank])
    return tuple(ranked)


class Predictor(Protocol):
    name: str
    uses_shadow: bool

    def reset(self, ctx: PredictorContext) -> None: ...

    def on_step_start(self, step: int, phase: str) -> list[Prediction]: ...

    def on_layer(self, obs: LayerObservation) -> list[Prediction]: ...

    def on_mtp_output(self, step: int, ranked: dict[int, tuple[int, ...]]) -> list[Prediction]: ...


class NoPredictor:
    name = "none"
    uses_shadow = False
    uses_real_scores = False  # ranks by the real rows' router scores (costs a device->host copy per layer)

    def reset(self, ctx: PredictorContext) -> None:
        self.ctx = ctx

    def on_step_start(self, step: int, phase: str) -> list[Prediction]:
        return []

    def on_layer(self, obs: LayerObservation) -> list[Prediction]:
        return []

    def on_mtp_output(self, step: int, ranked: dict[int, tuple[int, ...]]) -> list[Prediction]:
        return []


class PreviousStepPredictor(NoPredictor):
    """The previous token's experts at the same layer, predicted for the next step."""

    name = "previous"
    uses_real_scores = True

    def on_layer(self, obs: LayerObservation) -> list[Prediction]:
        if obs.real_scores is not None and self.ctx.width > self.ctx.top_k:
            experts = _ranked(obs.real_scores, self.ctx.width)
        else:
            experts = tuple(obs.real_experts)
        return [Prediction(obs.step + 1, obs.layer, experts, self.name)]


class NextLayerGatePredictor(NoPredictor):
    """Routers of the next `lookahead` MoE layers applied to this layer's router input."""

    name = "next_layer_gate"

    def on_layer(self, obs: LayerObservation) -> list[Prediction]:
        if obs.layer not in self.ctx.moe_layers:
            return []
        if obs.gate_ranked is not None:  # decode: computed inside the step's graph, read back with the routing
            return [Prediction(obs.step, t, r, self.name) for t, r in obs.gate_ranked.items()]
        if obs.hidden is None or obs.score_layer is None:
            return []
        out = []
        for target in self.targets(obs.layer):
            scores = obs.score_layer(target, obs.hidden).cpu()
            out.append(Prediction(obs.step, target, _ranked(scores, self.ctx.width), self.name))
        return out

    def targets(self, layer: int) -> list[int]:
        position = self.ctx.moe_layers.index(layer)
        return self.ctx.moe_layers[position + 1 : position + 1 + self.ctx.lookahead]


class MTPShadowPredictor(NoPredictor):
    """The MTP draft of the next token, run as a shadow row with resident experts only; its routing at layer l is the
    prediction for (step + 1, l)."""

    name = "mtp"
    uses_shadow = True

    def on_layer(self, obs: LayerObservation) -> list[Prediction]:
        if obs.shadow_scores is None or obs.phase != "decode":
            return []
        return [Prediction(obs.step + 1, obs.layer, _ranked(obs.shadow_scores, self.ctx.width), self.name)]


class MTPRouterPredictor(NoPredictor):
    """Every main layer's router on the MTP head's output hidden state: the next step's experts, all layers at once.

    Much cheaper than the shadow row (no extra pass through the layers); less accurate, since the routers see the
    MTP block's output rather than each layer's own input."""

    name = "mtp_router"

    def on_mtp_output(self, step: int, ranked: dict[int, tuple[int, ...]]) -> list[Prediction]:
        return [Prediction(step + 1, layer, experts, self.name) for layer, experts in ranked.items()]


class OraclePredictor(NoPredictor):
    """Replays the routing of an earlier identical run: at the start of step t it predicts steps t..t+lookahead."""

    name = "oracle"

    def reset(self, ctx: PredictorContext) -> None:
        super().reset(ctx)
        self._queued: set[int] = set()
        self._steps_by_index: dict[int, list[tuple[int, int]]] = {}
        for step, layer in ctx.trace:
            self._steps_by_index.setdefault(step, []).append((step, layer))

    def on_step_start(self, step: int, phase: str) -> list[Prediction]:
        out = []
        for target in range(step, step + self.ctx.lookahead + 1):
            if target in self._queued or target not in self._steps_by_index:
                continue
            self._queued.add(target)
            for key in self._steps_by_index[target]:
                out.append(Prediction(key[0], key[1], tuple(self.ctx.trace[key]), self.name))
        return out


class CombinedPredictor:
    """Several predictors at once; their predictions for the same target are merged by the prefetch queue."""

    def __init__(self, parts: list[NoPredictor]):
        self.parts = parts
        self.name = "+".join(p.name for p in parts)
        self.uses_shadow = any(p.uses_shadow for p in parts)
        self.uses_real_scores = False  # each part emits only its primary top-k here

    def reset(self, ctx: PredictorContext) -> None:
        # Each part contributes its primary set (top-k per row); the queue's per-target budget caps the union.
        narrow = PredictorContext(ctx.moe_layers, ctx.top_k, ctx.top_k, ctx.lookahead, ctx.trace)
        for part in self.parts:
            part.reset(narrow)

    def on_step_start(self, step: int, phase: str) -> list[Prediction]:
        return [p for part in self.parts for p in part.on_step_start(step, phase)]

    def on_layer(self, obs: LayerObservation) -> list[Prediction]:
        return [p for part in self.parts for p in part.on_layer(obs)]

    def on_mtp_output(self, step: int, ranked: dict[int, tuple[int, ...]]) -> list[Prediction]:
        return [p for part in self.parts for p in part.on_mtp_output(step, ranked)]


_REGISTRY: dict[str, type[NoPredictor]] = {
    "none": NoPredictor,
    "previous": PreviousStepPredictor,
    "next_layer_gate": NextLayerGatePredictor,
    "mtp": MTPShadowPredictor,
    "mtp_router": MTPRouterPredictor,
    "oracle": OraclePredictor,
}


def parse_predictor(spec: str) -> list[str]:
    """'mtp+next_layer_gate' -> ['mtp', 'next_layer_gate'], validated."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("predictor must be a non-empty name such as 'mtp' or 'mtp+next_layer_gate'")
    names = [part.strip() for part in spec.split("+")]
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown predictor {unknown[0]!r}; choose from {', '.join(PREDICTOR_NAMES)} or a '+' combination")
    if len(set(names)) != len(names):
        raise ValueError(f"predictor {spec!r} names a component twice")
    if "none" in names and len(names) > 1:
        raise ValueError("predictor 'none' cannot be combined with others")
    return names


def make_predictor(spec: str) -> NoPredictor | CombinedPredictor:
    names = parse_predictor(spec)
    if len(names) == 1:
        return _REGISTRY[names[0]]()
    return CombinedPredictor([_REGISTRY[n]() for n in names])
