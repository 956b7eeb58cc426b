"""The residency table: where every routed expert is, as device tensors that graph-captured kernels read and update.

Keys are `position * n_experts + expert`, where `position` is the MoE layer's index in the table (main MoE layers in
order, then the MTP layer). A key's bytes always live in the page-locked host arena (row = key); `slot_of[key]` says
whether a complete copy also sits in a VRAM slot. Clocks order everything: the plan point of MoE position p in step
t is `2 * (t * P + p)`, the start of step t is `2 * t * P - 1` (odd, between steps).

Slot states: FREE (empty), RESIDENT (published: complete and listed in `slot_of`), FILLING (reserved for a fill or
an admission whose bytes are still on their way; never read, never evicted).

Fill entries (prefetches in flight) move FREE -> ACTIVE (reserved, copied chunk by chunk by the side stream) -> DONE
(published by the main stream once `ready` is set) -> FREE at the next step start, when no fill kernel can still be
looking at them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

FREE, RESIDENT, FILLING = 0, 1, 2  # slot states
E_FREE, E_ACTIVE, E_DONE = 0, 1, 2  # fill entry states
NO_ENTRY, ADMITTING = -1, -2  # inflight_of values besides an entry index
FAR = 1 << 60  # "never" as a clock

# static = LRU outside the pinned hot set; lrfu = least recently/frequently used: uses counted with a decay per step
POLICY_CODES = {"lru": 0, "lfu": 1, "static": 0, "lrfu": 2}
POLICIES = tuple(POLICY_CODES)
ROUTING_HISTORY = ("use_count", "frequency", "counted")  # what LFU and LRFU rank by; no cache content

# The table's fields live in one buffer per element type, in these orders; the plan kernels find each field from the
# buffer's start and the table's sizes (`plan_kernel._words`, `_clocks`, `_floats` repeat these orders). Fields whose
# length depends on the ring come last: the ring allocated may be longer than the one a call plans with.
BUFFERS = (("words", torch.int32), ("clocks", torch.int64), ("floats", torch.float32))
BUFFER_NAMES = tuple(name for name, _ in BUFFERS)
PACKED = (
    ("slot_of", "use_count", "counted", "pinned", "inflight_of", "e_state", "e_key", "e_slot", "e_next", "e_done",
     "e_ready", "order", "adm_key", "adm_slot", "cursor", "demand", "key_of", "slot_state", "victims", "fills_for"),
    ("e_deadline", "e_made", "counters", "step", "step_base", "progress", "decode_step", "last_use", "protect",
     "prefetched_at"),
    ("frequency", "reuse", "pred"),
)

# per-position counters, one row per MoE position
COUNTERS = (
    "uses", "hit", "prefetched", "late", "miss", "zero_copy", "evictions", "prefetch_issued", "prefetch_wasted",
    "lead_sum", "predicted", "truth", "predicted_correct", "fills_done", "fill_chunks", "admitted",
)
C = {name: i for i, name in enumerate(COUNTERS)}


def _as_fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def effective_spare_recent(spare_recent: int, predictions_exact: bool, policy: str) -> int:
    """The sparing a call runs with. Sparing keeps wrong prefetches off the working set; predictions that are never
    wrong (an oracle's, a trace's) gain nothing from it and lose fills to demand reads (the thirty-fifth session's
    deep model, 30 % cached, sampled, CPU counts: oracle_next missed 34.3 experts a token sparing one step, 2.8
    sparing none; BENCHMARKS "Sparing and the one-token ceiling"). LFU's queue is not in recency order, which the
    rule relies on. LRFU's is not either, but sparing still pays there: prefetches stop at the first recently used
    slot of the queue (reference model at 25 % cached, mtp @ 0.05: 5.07 experts per token with sparing, 5.38
    without; BENCHMARKS)."""
    return 0 if predictions_exact or policy == "lfu" else spare_recent


@dataclass(frozen=True)
class ResidencyConfig:
    positions: int  # P: MoE positions in the table (main MoE layers, then the MTP layer if any)
    main_positions: int  # the main MoE layers among them (predictions and recall count these)
    n_experts: int  # E
    n_slots: int  # S
    record_bytes: int
    ring: int = 2  # R: steps of predictions kept (the current step and the next ones)
    entries: int = 64  # M: fill entries (a power of two)
    max_inflight: int = 16  # fills reserved and not yet complete, at most
    budget_per_target: int = 9  # fills per (step, layer), at most
    min_confidence: float = 0.0  # predictions below this are neither fetched nor counted
    fill_confidence: float = 0.0  # predictions below this are not fetched; they still protect what they name
    spare_recent: int = 1  # prefetches never evict an expert used within this many previous steps (misses may)
    prefetch_lead: int = 0  # fills only for needs at most this many MoE positions ahead of the plan (0: no limit)
    chunk_bytes: int = 1 << 16  # unit of a fill: claimed and copied by one program at a time
    # the engine's defaults (options.EngineConfig: lrfu, late_prefetch="wait"), so that a table built without them
    # (tests, tools) behaves as an engine's does
    policy: str = "lrfu"
    frequency_halflife: float = 16.0  # lrfu: a use counts half after this many steps (BENCHMARKS "LRFU half-lives on real routing")
    wait_late: bool = True  # a late prefetch: wait (bounded) for its fill instead of reading it from host again
    fill_idle_link: bool = False  # fills for later steps pause while a layer reads missed experts from host
    # victims by predicted reuse: w x P(needed soon, `TableState.reuse`) + (1 - w) x the policy's
    # rank, lowest first (0: the policy's order alone)
    reuse_weight: float = 0.0
    # a miss whose P(needed soon) is below its victim's is read in place without admission (the victim stays)
    bypass: bool = False

    def __post_init__(self) -> None:
        # confidences live in fp32 tensors (the prediction ring), and the plan kernel compares them with its fp32
        # arguments: the cuts are held as the fp32 values they become there, so that a confidence equal to a cut
        # passes it in every path (as a Python double, 0.7 is above fp32(0.7) = 0.699999988)
        for name in ("min_confidence", "fill_confidence"):
            object.__setattr__(self, name, _as_fp32(getattr(self, name)))

    @property
    def fills(self) -> bool:
        """Whether a plan may issue fills at all (else its reservation only repeats the window's protection)."""
        return self.budget_per_target > 0 and self.max_inflight > 0

    @property
    def fill_cut(self) -> float:
        """The confidence a prediction needs to be fetched (protecting needs only `min_confidence`)."""
        return max(self.min_confidence, self.fill_confidence)

    @property
    def keys(self) -> int:
        return self.positions * self.n_experts

    @property
    def chunks(self) -> int:
        return -(-self.record_bytes // self.chunk_bytes)

    @property
    def steps_clock(self) -> int:
        return 2 * self.positions

    @property
    def lead_clock(self) -> int:
        """The farthest a reserved fill's need may lie after the plan point, in clock units: at MoE position p a need
        at position p + d is 2 * d later (a step start, just before position 0, is odd: position d - 1 fits)."""
        return 2 * self.prefetch_lead if self.prefetch_lead > 0 else FAR


@dataclass
class TableState:
    """Every mutable tensor of the residency table (device-resident on the GPU)."""

    slot_of: torch.Tensor  # [K] int32, published slot or -1
    key_of: torch.Tensor  # [S] int32, key held or being filled, -1
    slot_state: torch.Tensor  # [S] int32
    last_use: torch.Tensor  # [S] int64 clock
    protect: torch.Tensor  # [S] int64 clock of the latest known need (predicted); evictable once passed
    prefetched_at: torch.Tensor  # [S] int64 clock a not-yet-used prefetch was made, -1
    use_count: torch.Tensor  # [K] int32 (LFU; survives eviction)
    frequency: torch.Tensor  # [K] fp32 uses decayed per step (LRFU), as of the last step start
    counted: torch.Tensor  # [K] int32 use_count as of the last step start (the uses `frequency` holds)
    pinned: torch.Tensor  # [K] int32 1 = the static policy's hot set
    inflight_of: torch.Tensor  # [K] int32 entry index, NO_ENTRY or ADMITTING
    e_state: torch.Tensor  # [M] int32
    e_key: torch.Tensor  # [M] int32
    e_slot: torch.Tensor  # [M] int32
    e_deadline: torch.Tensor  # [M] int64 clock of the need
    e_made: torch.Tensor  # [M] int64 clock the prediction was made; -1 once the need was served late
    e_next: torch.Tensor  # [M] int32 next chunk to claim (fills claim with atomics)
    e_done: torch.Tensor  # [M] int32 chunks copied
    e_ready: torch.Tensor  # [M] int32 1 once every chunk has landed
    order: torch.Tensor  # [P + 1, M] int32 entries in deadline order, per fill launch
    adm_key: torch.Tensor  # [A] int32 admissions of the last plan, published by the next one
    adm_slot: torch.Tensor  # [A] int32
    victims: torch.Tensor  # [S] int32 slots in eviction order, computed at each step start
    cursor: torch.Tensor  # [1] int32 next position in `victims`
    step: torch.Tensor  # [1] int64 step counter (prefill chunks and decode steps)
    step_base: torch.Tensor  # [1] int64 clock of the current step's start
    progress: torch.Tensor  # [1] int64 the main stream's latest plan point, read by fills
    decode_step: torch.Tensor  # [1] int64 index of the decode step (oracle traces, rings)
    demand: torch.Tensor  # [1] int32 experts the current layer reads from host (`fill_idle_link`), 0 once read
    pred: torch.Tensor  # [R, P, E] fp32 prediction confidence per target (step mod R, position, expert)
    reuse: torch.Tensor  # [K] fp32 a predictor's P(the key is needed soon) (`RoutingHead.predict`; 0: none)
    fills_for: torch.Tensor  # [R, P] int32 fills reserved per target
    counters: torch.Tensor  # [P, len(COUNTERS)] int64

    # the three packed buffers every field above is a view of (`allocate`); not fields themselves
    words: torch.Tensor = field(default=None, repr=False)  # int32
    clocks: torch.Tensor = field(default=None, repr=False)  # int64
    floats: torch.Tensor = field(default=None, repr=False)  # fp32

    @staticmethod
    def allocate(cfg: ResidencyConfig, admissions: int, device: torch.device) -> "TableState":
        """A cold table: its fields are views into one buffer per element type (`PACKED`), which the plan kernels
        take instead of a pointer per field."""
        k, s, m, p, r = cfg.keys, cfg.n_slots, cfg.entries, cfg.positions, cfg.ring
        shapes = {"slot_of": (k,), "use_count": (k,), "counted": (k,), "pinned": (k,), "inflight_of": (k,),
                  "e_state": (m,), "e_key": (m,), "e_slot": (m,), "e_next": (m,), "e_done": (m,), "e_ready": (m,),
                  "order": (p + 1, m), "adm_key": (admissions,), "adm_slot": (admissions,), "cursor": (1,),
                  "demand": (1,), "key_of": (s,), "slot_state": (s,), "victims": (s,), "fills_for": (r, p),
                  "e_deadline": (m,), "e_made": (m,), "counters": (p, len(COUNTERS)), "step": (1,),
                  "step_base": (1,), "progress": (1,), "decode_step": (1,), "last_use": (s,), "protect": (s,),
                  "prefetched_at": (s,), "frequency": (k,), "reuse": (k,), "pred": (r, p, cfg.n_experts)}
        start = {"slot_of": -1, "key_of": -1, "slot_state": FREE, "last_use": -1, "protect": -1,
                 "prefetched_at": -1, "inflight_of": NO_ENTRY, "e_state": E_FREE, "e_key": -1, "e_slot": -1,
                 "e_deadline": -1, "e_made": -1, "order": -1, "adm_key": -1, "adm_slot": -1, "step_base": -1,
                 "progress": -1}  # every other field starts at 0
        views, buffers = {}, {}
        for (buffer, dtype), names in zip(BUFFERS, PACKED):
            flat = torch.empty(sum(math.prod(shapes[n]) for n in names), dtype=dtype, device=device)
            buffers[buffer] = flat
            offset = 0
            for name in names:
                size = math.prod(shapes[name])
                views[name] = flat[offset : offset + size].view(shapes[name]).fill_(start.get(name, 0))
                offset += size
        views["victims"].copy_(torch.arange(s, dtype=torch.int32, device=device))
        return TableState(**views, **buffers)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every field by name (views; not the buffers they share)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in BUFFER_NAMES}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.tensors().items()}

    def load(self, snap: dict[str, torch.Tensor]) -> None:
        """Copy a snapshot back in place (captured graphs keep pointing at these tensors)."""
        for name, t in self.tensors().items():
            t.copy_(snap[name])
