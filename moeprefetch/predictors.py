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
| `mtp` | the MTP draft as a shadow row through the main layers (resident experts only); with k > 1, the MTP head chained k times, every main router on link j's output | (t+1, l); (t+j, every layer) for j = 2..k | k, the tokens ahead |
| `mtp_router` | every main router on the MTP head's output, the head chained k times | (t+j, every layer), j = 1..k | k, the tokens ahead |
| `oracle` | the routing recorded by an identical earlier run, and Belady's victims (the whole future) | (t .. t+d, every layer) | d, steps ahead |
| `oracle_next` | the recorded routing of the next token only; the policy's victims | (t, t+1, every layer) | unused (must be 1) |
| `learned` | a trained routing head (`learned_predictor.py`, `predictor_path=`) on the final hidden state and, when it was trained with it, the MTP head's output | (t+j, every layer), j = 1..k | k, the tokens ahead (at most the head's leads) |

In a combination each component reads `lookahead` its own way (`mtp+next_layer_gate` with 2: drafts chained twice
and gates two MoE layers ahead). Chained drafts: link 1 drafts token t+2 from the main hidden state (as the MTP head
does); link j > 1 drafts token t+j+1 from link j-1's output and draft, as vLLM and SGLang reuse DeepSeek's one MTP
module for several draft tokens. Leads beyond 1 route the link's output instead of running another shadow row: a
shadow row per lead would add rows to every main layer's expert kernel, whose configuration follows the rows a step
computes, and the real rows' bits must not depend on the lookahead.

Confidence: a routed expert's share of its row's top-k weight; for `mtp` also times the draft's probability, and for
a chained lead times the probabilities of the drafts it was chained through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

PREDICTOR_NAMES = ("none", "previous", "next_layer_gate", "mtp", "mtp_router", "oracle", "oracle_next", "learned")
MTP_PREDICTORS = ("mtp", "mtp_router")
ORACLES = ("oracle", "oracle_next")  # predictors that replay a recorded run's routing
_LOOKAHEAD_IS_DEPTH = ("next_layer_gate", "oracle", "learned")
LOOKAHEAD_READERS = _LOOKAHEAD_IS_DEPTH + MTP_PREDICTORS  # the components a lookahead above 1 means something to


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
    if set(ORACLES) <= set(names):
        raise ValueError("predictors 'oracle' and 'oracle_next' cannot be combined: one knows what the other does")
    return names


def default_lookahead(spec: str, engine_lookahead: int) -> int:
    """The lookahead a call takes from the engine's options: that one where the predictor reads it, else 1 (an
    engine's lookahead=3 is for its MTP or gate predictors; a call with predictor 'none' must still work)."""
    try:
        names = parse_predictor(spec)
    except ValueError:
        return engine_lookahead  # the spec's own error is reported where it is parsed
    return engine_lookahead if any(n in LOOKAHEAD_READERS for n in names) else 1


@dataclass(frozen=True)
class PredictorSpec:
    """A parsed predictor (or combination) with its lookahead: which device signals a decode step must produce."""

    names: tuple[str, ...]
    lookahead: int = 1
    learned_mtp: bool = False  # the learned head reads the MTP head's output (the MTP head must run)

    @staticmethod
    def parse(spec: str, lookahead: int = 1) -> "PredictorSpec":
        names = tuple(parse_predictor(spec))
        if lookahead > 1 and not any(n in LOOKAHEAD_READERS for n in names):
            raise ValueError(
                f"lookahead={lookahead} means nothing to predictor {spec!r}: only next_layer_gate (MoE layers ahead), "
                f"oracle (steps ahead) and the MTP predictors (tokens ahead, chained drafts) use it")
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
        return any(n in MTP_PREDICTORS for n in self.names) or (self.learned and self.learned_mtp)

    @property
    def needs_drafts(self) -> bool:
        """The MTP head's draft tokens are used (by an MTP predictor); the learned head reads only link 1's output."""
        return any(n in MTP_PREDICTORS for n in self.names)

    @property
    def learned(self) -> bool:
        return "learned" in self.names

    @property
    def gate_depth(self) -> int:
        return self.lookahead if "next_layer_gate" in self.names else 0

    @property
    def previous(self) -> bool:
        return "previous" in self.names

    @property
    def oracle(self) -> bool:
        """Replays a recorded run's routing (`oracle` or `oracle_next`): the call records it first."""
        return any(n in ORACLES for n in self.names)

    @property
    def belady(self) -> bool:
        """Victims follow the recorded future (Belady's order) instead of the cache policy: the full oracle only."""
        return "oracle" in self.names

    @property
    def oracle_steps(self) -> int:
        """Decode steps of recorded routing written into the ring at each step start (the current one included)."""
        if "oracle" in self.names:
            return self.lookahead + 1
        return 2 if "oracle_next" in self.names else 0

    @property
    def chain(self) -> int:
        """Links of the MTP head run per step (drafts chained): the MTP predictors' lookahead, else 1."""
        return self.lookahead if any(n in MTP_PREDICTORS for n in self.names) else 1

    @property
    def max_lead(self) -> int:
        """The most steps ahead a prediction is made (0: only this step's, as next_layer_gate's)."""
        leads = [1 if self.previous or self.needs_mtp else 0, self.chain if self.needs_mtp else 0,
                 self.oracle_steps - 1 if self.oracle else 0, self.lookahead if self.learned else 0]
        return max(leads)

    @property
    def ring(self) -> int:
        """Decode steps of predictions the table must hold: this one and the ones predicted ahead."""
        return max(self.oracle_steps, self.chain + 1, 2, self.lookahead + 1 if self.learned else 0)

    @property
    def active(self) -> bool:
        return self.names != ("none",)


def routing_confidence(weights: torch.Tensor) -> torch.Tensor:
    """weights [N, k] (>= 0) -> each expert's share of its row's routed weight, in [0, 1]."""
    w = weights.float().clamp(min=0)
    return w / w.sum(-1, keepdim=True).clamp(min=1e-20)


class LeadTracker:
    """Predictions by lead (how many decode steps before their target they were made) and how they fared, on the
    device: `pred[L, R, P, E]` holds lead l+1's confidences for (step mod R, MoE position, expert), merged by `amax`
    like the table's ring. Each main MoE layer of a decode step marks the experts its active rows use (`note`, one
    scatter); at the step's end every lead's guesses for the step meet them at once (`close_step`), `counts[L, 3]`
    (predicted, correct, truth) grows, and the step's entries are cleared. Counted as the table counts its recall:
    the step's predicted experts (at or above the confidence cut) against the distinct experts its active rows use,
    per layer. Read once per call (`read`)."""

    def __init__(self, leads: int, ring: int, positions: int, experts: int, device: torch.device):
        self.leads, self.ring = leads, ring
        self.pred = torch.zeros(leads, ring, positions, experts, dtype=torch.float32, device=device)
        self.used = torch.zeros(positions, experts, dtype=torch.float32, device=device)  # this step's experts
        self.counts = torch.zeros(leads, 3, dtype=torch.int64, device=device)

    def reset(self) -> None:
        self.pred.zero_()
        self.used.zero_()
        self.counts.zero_()

    def record(self, lead: int, row: torch.Tensor, position: int, ids: torch.Tensor, conf: torch.Tensor,
               min_confidence: float) -> None:
        """ids/conf [N, k]: guesses made `lead` steps ahead for ring row `row` ([1] on the device), `position`."""
        if not 1 <= lead <= self.leads:
            return
        positions, experts = self.pred.shape[2], self.pred.shape[3]
        kept = conf.reshape(-1).float()
        kept = kept * (kept >= min_confidence)
        index = ((row * positions + position) * experts + ids.long()).reshape(-1)
        self.pred[lead - 1].view(-1).scatter_reduce_(0, index, kept, reduce="amax")

    def record_rows(self, lead: int, row: torch.Tensor, recorded: torch.Tensor) -> None:
        """An oracle's recorded routing [1, P, E] (0 or 1) for ring row `row`, made `lead` steps ahead."""
        if 1 <= lead <= self.leads:
            current = self.pred[lead - 1].index_select(0, row)
            self.pred[lead - 1].index_copy_(0, row, torch.maximum(current, recorded[:, : self.pred.shape[2]]))

    def note(self, position: int, ids: torch.Tensor, active: torch.Tensor) -> None:
        """At a main MoE layer of a decode step: the experts its active rows use (ids [B, k], active [B] per row or
        [B, k] per entry)."""
        live = (active.float() if active.dim() == 2 else active.float()[:, None]).expand(ids.shape).reshape(-1)
        self.used[position].scatter_reduce_(0, ids.reshape(-1).long(), live, reduce="amax")

    def close_step(self, decode_step: torch.Tensor) -> None:
        """At the end of a decode step: every lead's guesses for it against the experts noted; both are cleared."""
        row = decode_step % self.ring  # [1]
        guesses = self.pred.index_select(1, row)[:, 0] > 0  # [L, P, E]
        used = self.used > 0  # [P, E]
        self.counts[:, 0] += guesses.sum((1, 2))
        self.counts[:, 1] += (guesses & used).sum((1, 2))
        self.counts[:, 2] += used.sum()
        self.pred.index_fill_(1, row, 0.0)
        self.used.zero_()

    def read(self, leads: int) -> list[tuple[int, int, int]]:
        """(predicted, correct, truth) for leads 1..`leads` (reads the device)."""
        return [tuple(int(v) for v in row) for row in self.counts[: min(leads, self.leads)].tolist()]


class PredictionRing:
    """Writes into `pred[R, P, E]` at targets addressed by device tensors, so the writes can be captured (and, with a
    `LeadTracker`, into its per-lead copy)."""

    def __init__(self, pred: torch.Tensor, decode_step: torch.Tensor, ring: int, leads: LeadTracker | None = None,
                 min_confidence: float = 0.0, local_ids: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        self.pred = pred
        self.flat = pred.view(-1)
        self.decode_step = decode_step  # [1] int64 on the device
        self.ring = ring
        self.positions, self.experts = pred.shape[1], pred.shape[2]
        self.leads = leads
        self.min_confidence = min_confidence
        # expert parallelism: the table holds this rank's experts under local numbers (-1: another rank's)
        self.local_ids = local_ids

    def _mine(self, position: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ids as the table numbers them, which entries are this rank's, or None when all are)."""
        if self.local_ids is None:
            return ids, None
        local = self.local_ids(position, ids)
        return local.clamp(min=0), local >= 0

    def write(self, steps_ahead: int, position: int | torch.Tensor, ids: torch.Tensor, conf: torch.Tensor) -> None:
        """ids/conf [N, k]: guesses for (decode step + steps_ahead, position); rows with conf 0 write nothing. Each
        rank keeps the guesses of its own experts. `position` may also be a device tensor that broadcasts against
        ids (e.g. [L, 1] with ids [N, L, k]: every layer in one write; not under expert parallelism)."""
        ids, mine = self._mine(position, ids)
        if mine is not None:
            conf = conf * mine
        row = (self.decode_step + steps_ahead) % self.ring  # [1]
        index = ((row * self.positions + position) * self.experts + ids.long()).reshape(-1)
        self.flat.scatter_reduce_(0, index, conf.reshape(-1).float(), reduce="amax")
        if self.leads is not None and steps_ahead >= 1:
            self.leads.record(steps_ahead, (self.decode_step + steps_ahead) % self.leads.ring, position, ids, conf,
                              self.min_confidence)

    def note(self, position: int, ids: torch.Tensor, active: torch.Tensor) -> None:
        """The experts a main MoE layer's active rows use (ids [B, k], active [B]), for scoring by lead."""
        assert self.leads is not None
        ids, mine = self._mine(position, ids)
        self.leads.note(position, ids, active if mine is None else active[:, None] & mine)

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
            if self.leads is not None and ahead >= 1:
                self.leads.record_rows(ahead, target % self.leads.ring, recorded)
