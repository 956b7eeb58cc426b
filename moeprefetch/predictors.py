"""Expert predictors: device-side writers of guesses into the residency table's prediction ring.

The ring `pred[R, P, E]` holds, per target (decode step mod R, MoE position, expert), a confidence in (0, 1]; 0 means
not predicted. Every predictor runs inside the step's CUDA graph and only writes the ring (scatter with `amax`, so
combined predictors merge by taking the more confident guess); the table's plans turn the ring into prefetches, in
deadline order, cut by `min_confidence` and a per-target budget. A prediction never changes what is computed.

Each predictor declares the device signals it needs, and what `lookahead` means for it:

| predictor | signal | targets | lookahead |
|---|---|---|---|
| `none` | - | - | unused (must be 1) |
| `previous` | the exact rows' routing at layer l | (t+1, l) | unused (must be 1) |
| `next_layer_gate` | the router input of layer l | (t, l+1 .. l+d) | d, the MoE layers looked ahead |
| `mtp` | the MTP draft as a shadow row through the main layers (resident experts only) | (t+1, l) | must be 1 |
| `mtp_router` | every main router on the MTP head's output | (t+1, every layer) | must be 1 |
| `oracle` | the routing recorded by an identical earlier run | (t .. t+d, every layer) | d, steps ahead |

Confidence: a routed expert's share of its row's top-k weight; for `mtp` also times the draft's probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PREDICTOR_NAMES = ("none", "previous", "next_layer_gate", "mtp", "mtp_router", "oracle")
MTP_PREDICTORS = ("mtp", "mtp_router")
_LOOKAHEAD_IS_DEPTH = ("next_layer_gate", "oracle")


def parse_predictor(spec: str) -> list[str]:
    """'mtp+next_layer_gate' -> ['mtp', 'next_layer_gate'], validated."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("predictor must be a non-empty name such as 'mtp' or 'mtp+next_layer_gate'")
    names = [part.strip() for part in spec.split("+")]
    unknown = [n for n in names if n not in PREDICTOR_NAMES]
    if unknown:
        raise ValueError(f"unknown predictor {unknown[0]!r}; choose from {', '.join(PREDICTOR_NAMES)} or a '+' "
                         f"combination")
    if len(set(names)) != len(names):
        raise ValueError(f"predictor {spec!r} names a component twice")
    if "none" in names and len(names) > 1:
        raise ValueError("predictor 'none' cannot be combined with others")
    return names


@dataclass(frozen=True)
class PredictorSpec:
    """A parsed predictor (or combination) with its lookahead: which device signals a decode step must produce."""

    names: tuple[str, ...]
    lookahead: int = 1

    @staticmethod
    def parse(spec: str, lookahead: int = 1) -> "PredictorSpec":
        names = tuple(parse_predictor(spec))
        if lookahead > 1 and not any(n in _LOOKAHEAD_IS_DEPTH for n in names):
            raise ValueError(
                f"lookahead={lookahead} means nothing to predictor {spec!r}: only next_layer_gate (MoE layers ahead) "
                f"and oracle (steps ahead) use it")
        return PredictorSpec(names, lookahead)

    @property
    def name(self) -> str:
        return "+".join(self.names)

    @property
    def shadow(self) -> bool:
        return "mtp" in self.names

    @property
    def mtp_router(self) -> bool:
        return "mtp_router" in self.names

    @property
    def needs_mtp(self) -> bool:
        return any(n in MTP_PREDICTORS for n in self.names)

    @property
    def gate_depth(self) -> int:
        return self.lookahead if "next_layer_gate" in self.names else 0

    @property
    def previous(self) -> bool:
        return "previous" in self.names

    @property
    def oracle(self) -> bool:
        return "oracle" in self.names

    @property
    def ring(self) -> int:
        """Decode steps of predictions the table must hold: this one and the ones predicted ahead."""
        return (self.lookahead if self.oracle else 1) + 1

    @property
    def active(self) -> bool:
        return self.names != ("none",)


def routing_confidence(weights: torch.Tensor) -> torch.Tensor:
    """weights [N, k] (>= 0) -> each expert's share of its row's routed weight, in [0, 1]."""
    w = weights.float().clamp(min=0)
    return w / w.sum(-1, keepdim=True).clamp(min=1e-20)


class PredictionRing:
    """Writes into `pred[R, P, E]` at targets addressed by device tensors, so the writes can be captured."""

    def __init__(self, pred: torch.Tensor, decode_step: torch.Tensor, ring: int):
        self.pred = pred
        self.flat = pred.view(-1)
        self.decode_step = decode_step  # [1] int64 on the device
        self.ring = ring
        self.positions, self.experts = pred.shape[1], pred.shape[2]

    def write(self, steps_ahead: int, position: int, ids: torch.Tensor, conf: torch.Tensor) -> None:
        """ids/conf [N, k]: guesses for (decode step + steps_ahead, position); rows with conf 0 write nothing."""
        row = (self.decode_step + steps_ahead) % self.ring  # [1]
        index = (row * self.positions + position) * self.experts + ids.reshape(-1).long()
        self.flat.scatter_reduce_(0, index, conf.reshape(-1).float(), reduce="amax")

    def write_trace(self, trace: torch.Tensor, steps: int) -> None:
        """Oracle: the recorded routing of decode steps t .. t+steps-1 (trace [T, P, E] uint8) into the ring."""
        total = trace.shape[0]
        for ahead in range(steps):
            target = self.decode_step + ahead  # [1]
            inside = (target < total).to(torch.float32)
            recorded = trace.index_select(0, target.clamp(max=total - 1)).float() * inside  # [1, P, E]
            row = target % self.ring
            current = self.pred.index_select(0, row)
            self.pred.index_copy_(0, row, torch.maximum(current, recorded[:, : self.positions]))
