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

from dataclasses import dataclass, fields

import torch

FREE, RESIDENT, FILLING = 0, 1, 2  # slot states
E_FREE, E_ACTIVE, E_DONE = 0, 1, 2  # fill entry states
NO_ENTRY, ADMITTING = -1, -2  # inflight_of values besides an entry index
FAR = 1 << 60  # "never" as a clock

# static = LRU outside the pinned hot set; lrfu = least recently/frequently used: uses counted with a decay per step
POLICY_CODES = {"lru": 0, "lfu": 1, "static": 0, "lrfu": 2}
POLICIES = tuple(POLICY_CODES)
ROUTING_HISTORY = ("use_count", "frequency", "counted")  # what LFU and LRFU rank by; no cache content

# per-position counters, one row per MoE position
COUNTERS = (
    "uses", "hit", "prefetched", "late", "miss", "zero_copy", "evictions", "prefetch_issued", "prefetch_wasted",
    "lead_sum", "predicted", "truth", "predicted_correct", "fills_done", "fill_chunks", "admitted",
)
C = {name: i for i, name in enumerate(COUNTERS)}


def _as_fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


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

    @staticmethod
    def allocate(cfg: ResidencyConfig, admissions: int, device: torch.device) -> "TableState":
        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        i32, i64 = torch.int32, torch.int64
        k, s, m = cfg.keys, cfg.n_slots, cfg.entries
        return TableState(
            slot_of=full((k,), -1, i32), key_of=full((s,), -1, i32), slot_state=full((s,), FREE, i32),
            last_use=full((s,), -1, i64), protect=full((s,), -1, i64), prefetched_at=full((s,), -1, i64),
            use_count=full((k,), 0, i32), frequency=full((k,), 0.0, torch.float32), counted=full((k,), 0, i32),
            pinned=full((k,), 0, i32), inflight_of=full((k,), NO_ENTRY, i32),
            e_state=full((m,), E_FREE, i32), e_key=full((m,), -1, i32), e_slot=full((m,), -1, i32),
            e_deadline=full((m,), -1, i64), e_made=full((m,), -1, i64), e_next=full((m,), 0, i32),
            e_done=full((m,), 0, i32), e_ready=full((m,), 0, i32), order=full((cfg.positions + 1, m), -1, i32),
            adm_key=full((admissions,), -1, i32), adm_slot=full((admissions,), -1, i32),
            victims=torch.arange(s, dtype=i32, device=device), cursor=full((1,), 0, i32),
            step=full((1,), 0, i64), step_base=full((1,), -1, i64), progress=full((1,), -1, i64),
            decode_step=full((1,), 0, i64), demand=full((1,), 0, i32),
            pred=full((cfg.ring, cfg.positions, cfg.n_experts), 0.0, torch.float32),
            reuse=full((k,), 0.0, torch.float32),
            fills_for=full((cfg.ring, cfg.positions), 0, i32), counters=full((cfg.positions, len(COUNTERS)), 0, i64),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.tensors().items()}

    def load(self, snap: dict[str, torch.Tensor]) -> None:
        """Copy a snapshot back in place (captured graphs keep pointing at these tensors)."""
        for name, t in self.tensors().items():
            t.copy_(snap[name])
