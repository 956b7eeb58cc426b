"""The expert runtime: routed-expert compute over a slot pool, with the cache, copies, prefetching and accounting.

For each MoE layer the runner hands over the rows that must be exact (real tokens, and drafts being verified) and,
optionally, MTP shadow rows. The runtime
1. reads the layer's routing on the host (the one synchronisation per layer that reactive fetching needs),
2. scores predictions made for this (step, layer) and lets the predictor observe the routing,
3. makes the exact rows' experts resident — hits are locked, misses fetched on the demand stream (experts already
   resident are computed first while the misses cross the link),
4. pumps the prefetch queue on the prefetch stream,
5. computes the experts from the slot pool, sums them in a fixed order, and releases the slots.

Because an expert's output never depends on where it sits or when it arrived, and outputs are combined in a fixed
order, the result is bit-identical for every cache size, policy and predictor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .accounting import Accounting
from .cache import Deadline, ExpertCache, ExpertKey
from .experts import ExpertFormat, activation, expert_ffn, gathered_expert_ffn
from .model import Routing, combine_expert_outputs
from .predictors import LayerObservation, NoPredictor, Prediction
from .prefetch import PrefetchQueue
from .store import HostExpertStore
from .transfer import TransferEngine

logger = logging.getLogger(__name__)


@dataclass
class RowBlock:
    """Rows that share one routing call: x [N, H] (router input), their routing, and which rows count."""

    x: torch.Tensor
    routing: Routing
    active: torch.Tensor | None = None  # [N] bool on the host; None = all rows active


class ExpertRuntime:
    def __init__(
        self,
        fmt: ExpertFormat,
        layers: list[int],
        n_experts: int,
        top_k: int,
        n_slots: int,
        device: torch.device,
        hidden_act: str,
        store: HostExpertStore | None,
        policy: str = "lru",
        hot_set: list[ExpertKey] | None = None,
    ):
        self.fmt = fmt
        self.layers = list(layers)
        self.position = {layer: i for i, layer in enumerate(self.layers)}
        self.n_experts = n_experts
        self.top_k = top_k
        self.device = device
        self.act = activation(hidden_act)
        self.store = store
        self.n_slots = n_slots
        self.cache = ExpertCache(n_slots, policy, hot_set or ())
        # Zero-filled once: masked gather entries may point at a never-written slot, and garbage bits could be NaN.
        self.pool = torch.zeros((n_slots, fmt.record_bytes), dtype=torch.uint8, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copy streams must not race the zero fill
        self.transfer = TransferEngine(device, n_slots)
        self.preloaded = store is None
        self.accounting = Accounting()
        self.predictor: NoPredictor = NoPredictor()
        self.queue = PrefetchQueue(0)
        self.max_inflight_bytes = 0
        self.step = 0
        self.phase = "decode"
        self.now: Deadline = (0, -1)
        self.score_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        self._prefetched_unused: dict[ExpertKey, Deadline] = {}
        self._inflight: list[tuple[int, ExpertKey]] = []
        self._pending_release: list[ExpertKey] = []
        self.trace: dict[tuple[int, int], list[int]] | None = None  # filled while recording an oracle trace
        self.use_counts: dict[ExpertKey, int] = {}  # routing profile since the engine started (for `static`)
        if not fmt.quantized:
            self._gate_up = fmt.gate_up_view(self.pool)  # [S, 2I, H]
            self._down = fmt.view(self.pool, "down")  # [S, H, I]

    # ---- set-up ---------------------------------------------------------------------------------------------------
    def preload(self, pack: Callable[[int, int, torch.Tensor], None], progress: bool = True) -> None:
        """All-resident mode: fill one slot per expert straight from the checkpoint; the table never changes."""
        from tqdm.auto import tqdm

        staging = torch.empty(self.fmt.record_bytes, dtype=torch.uint8)
        keys = [(layer, e) for layer in self.layers for e in range(self.n_experts)]
        assert len(keys) == self.n_slots
        for key in tqdm(keys, desc="experts", unit="expert", disable=not progress, leave=False):
            pack(key[0], key[1], staging)
            alloc = self.cache.allocate(key)
            assert alloc is not None and alloc.slot == self.preloaded_base(key[0]) + key[1]
            self.pool[alloc.slot].copy_(staging)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def expert_bytes(self) -> int:
        return self.fmt.record_bytes

    def reset(self) -> None:
        """Forget every cached expert (cold cache); no effect in all-resident mode."""
        if self.preloaded:
            return
        self.transfer.synchronize()
        self.cache.clear()
        self._prefetched_unused.clear()
        self._inflight.clear()

    def snapshot(self) -> list[ExpertKey]:
        """Resident experts, first to be evicted first, so `restore` rebuilds the same recency order."""
        return list(self.cache.policy.eviction_order())

    def restore(self, keys: list[ExpertKey]) -> None:
        """Reload a snapshot of resident experts (used to rerun a pass from the same cache state)."""
        if self.preloaded:
            return
        self.reset()
        for key in keys[: self.n_slots]:
            alloc = self.cache.allocate(key)
            self.transfer.copy(self._host_record(key), self.pool[alloc.slot], alloc.slot, demand=True)
        self.transfer.synchronize()
        self.transfer.collect_stall_seconds()

    def _host_record(self, key: ExpertKey) -> torch.Tensor:
        assert self.store is not None
        return self.store.record(*key)

    # ---- per call / per step --------------------------------------------------------------------------------------
    def begin_call(
        self,
        accounting: Accounting,
        predictor: NoPredictor,
        prefetch_budget_experts: int,
        max_inflight_experts: int,
        score_layer: Callable[[int, torch.Tensor], torch.Tensor] | None,
    ) -> None:
        # nothing of an earlier call may leak into this one's accounting or eviction decisions
        self._prefetched_unused.clear()
        self._pending_release = []
        self.cache.unlock()
        self.cache.clear_protection()
        self.accounting = accounting
        self.predictor = predictor
        self.queue = PrefetchQueue(prefetch_budget_experts)
        self.max_inflight_bytes = max_inflight_experts * self.expert_bytes
        self.score_layer = score_layer
        self.now = (-1, 0)

    @property
    def predictor_wants_scores(self) -> bool:
        """Whether predictors rank by the real rows' router scores (worth a device->host copy per layer)."""
        return self.queue.budget_per_target > 0 and getattr(self.predictor, "uses_real_scores", False)

    def end_call(self) -> float:
        """Finish a generate call: count still-unused prefetches as wasted; return stall seconds not yet collected."""
        self.release_layer()
        self.transfer.synchronize()
        for key in self._prefetched_unused:
            self.accounting.unused_at_end(key[0])
        self._prefetched_unused.clear()
        self._inflight.clear()
        self.queue.clear()
        self.cache.clear_protection()
        self.cache.unlock()
        self.accounting.discard_predictions()
        return self.transfer.collect_stall_seconds()

    def abort(self) -> None:
        """Bring the runtime back to a consistent state after an interrupted or failed step.

        The step may have stopped between publishing a key in the slot table and issuing its copy, so the table
        cannot be trusted: the cache restarts empty (cold) rather than risk computing with the wrong bytes."""
        self.transfer.synchronize()
        self._pending_release = []
        self.cache.unlock()
        self.reset()

    def begin_step(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        self._advance((step, -1))
        self._enqueue(self.predictor.on_step_start(step, phase))
        self._pump()

    def _advance(self, now: Deadline) -> None:
        self.now = now
        self.cache.expire_protection(now)
        self.queue.forget_before(now)

    # ---- the layer ------------------------------------------------------------------------------------------------
    def run_layer(self, layer: int, exact: list[RowBlock]) -> list[torch.Tensor]:
        """Prefill and uncached forwards: the routed-expert output ([N, H] fp32) of each block of rows, computing each
        expert on all its tokens at once, in waves when the cache cannot hold the layer's experts together."""
        self._advance((self.step, self.position[layer]))
        exact_ids = [block.routing.ids.cpu() for block in exact]  # the per-layer host synchronisation
        needed = _distinct_experts(exact_ids, [block.active for block in exact])
        real_scores = exact[0].routing.scores.cpu() if self.predictor_wants_scores and exact else None
        self._observe(layer, needed, real_scores, None, exact[0].x if exact else None)
        outputs = [
            torch.zeros(
                (block.x.shape[0], self.top_k, block.x.shape[1]), dtype=block.x.dtype, device=block.x.device
            )
            for block in exact
        ]
        valid = [self._valid_entries(ids, block.active) for ids, block in zip(exact_ids, exact)]
        for wave, slots in self._waves(layer, needed, split_resident=True):
            for block, ids, out, entry_valid in zip(exact, exact_ids, outputs, valid):
                self._compute_per_expert(block.x, ids, entry_valid, layer, wave, slots, out)
        return [
            combine_expert_outputs(out, block.routing.weights, entry_valid.to(out.device))
            for out, block, entry_valid in zip(outputs, exact, valid)
        ]

    def _valid_entries(self, ids: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
        valid = torch.ones(ids.shape, dtype=torch.bool)
        if active is not None:
            valid &= active[:, None]
        return valid

    # ---- decode: one host hook per MoE layer ---------------------------------------------------------------------
    def working_set_capacity(self) -> int:
        """Experts one decode layer can hold at once (slots not pinned by the static policy)."""
        # every hot-set key may become pinned, resident or not yet
        return self.n_slots - len(self.cache.pinned) if not self.preloaded else self.n_slots

    def decode_layer(
        self,
        layer: int,
        exact: list[tuple[list[list[int]], list[bool]]],
        shadow: tuple[list[list[int]], list[bool], torch.Tensor] | None,
        hidden: torch.Tensor | None,
        real_scores: torch.Tensor | None,
        gate_ranked: dict[int, tuple[int, ...]] | None = None,
    ) -> tuple[list[tuple[list[list[int]], list[list[bool]]]], tuple[list[list[int]], list[list[bool]]] | None]:
        """Plan one decode layer on the host, between the router and the expert compute.

        exact: (ids [N][k], active [N]) per block of rows that must be exact; shadow: (ids, active, scores [M, E]) of
        the MTP shadow rows. Makes every needed expert resident at once (misses fetched on the demand stream,
        prefetches pumped behind them), orders the compute stream after the copies, and returns (slot ids, valid) per
        block and for the shadow block (resident, landed experts only). The slots stay locked until
        `release_layer()`, called once the expert compute that reads them has been enqueued. Plain Python lists: this
        runs once per MoE layer per token, and tiny tensors cost more than the work."""
        self.release_layer()
        self._advance((self.step, self.position[layer]))
        needed = _distinct_lists(exact)
        self._observe(layer, needed, real_scores, shadow[2] if shadow is not None else None, hidden, gate_ranked)
        cache = self.cache
        slot_of = cache.slot_of
        locked = [(layer, e) for e in needed]
        for key in locked:
            if key in slot_of:
                self._account_hit(key)
        cache.lock(locked)
        for key in locked:
            if key in slot_of:
                continue
            alloc = cache.allocate(key)
            if alloc is None:
                raise RuntimeError(
                    f"the expert cache ({self.n_slots} slots) cannot hold the {len(needed)} experts layer {layer} "
                    f"needs in one decode step"
                )
            self._evicted(alloc.evicted)
            self.transfer.copy(self._host_record(key), self.pool[alloc.slot], alloc.slot, demand=True)
            self.accounting.copy(self.step, layer, key[1], self.expert_bytes, prefetch=False)
            self.accounting.use(self.step, self.phase, layer, key[1], "miss")
            cache.use(key)
        self._pump()
        lut = {e: slot_of[(layer, e)] for e in needed}
        self.transfer.wait_for(list(lut.values()))
        stand_in = lut[needed[0]] if needed else 0
        plans = [_plan_lists(lut, ids, active, stand_in) for ids, active in exact]
        shadow_plan = None
        if shadow is not None:
            ids, active, _ = shadow
            present: dict[int, int] = {}
            for row, row_active in zip(ids, active):
                if not row_active:
                    continue
                for expert in row:
                    if expert not in present:
                        slot = slot_of.get((layer, expert))
                        # this layer's own experts are safe even mid-copy: compute already waits for them
                        if slot is not None and (expert in lut or self.transfer.is_ready(slot)):
                            present[expert] = slot
            extra = [(layer, e) for e in present if e not in lut]
            cache.lock(extra)
            locked += extra
            shadow_plan = _plan_lists(present, ids, active, next(iter(present.values()), stand_in))
        self._pending_release = locked
        return plans, shadow_plan

    def release_layer(self) -> None:
        """The expert compute of the last planned layer has been enqueued: its slots may be reused after it."""
        if not self._pending_release:
            return
        slots = [self.cache.slot_of[k] for k in self._pending_release if k in self.cache]
        self.transfer.release(slots)
        self.cache.unlock(self._pending_release)
        self._pending_release = []

    def record_resident_step(self, layer_ids: dict[int, list[list[int]]], active: list[bool]) -> None:
        """All-resident decode computed its routing on the device; account the step's uses afterwards."""
        for layer, ids in layer_ids.items():
            self._advance((self.step, self.position[layer]))
            needed = _distinct_lists([(ids, active)])
            self._observe(layer, needed, None, None, None)
            for expert in needed:
                self._account_hit((layer, expert))
        self.queue.clear_items()

    def _observe(
        self,
        layer: int,
        needed: list[int],
        real_scores: torch.Tensor | None,
        shadow_scores: torch.Tensor | None,
        hidden: torch.Tensor | None,
        gate_ranked: dict[int, tuple[int, ...]] | None = None,
    ) -> None:
        if self.trace is not None:
            self.trace[(self.step, layer)] = needed
        for expert in needed:
            self.use_counts[(layer, expert)] = self.use_counts.get((layer, expert), 0) + 1
        if self.phase == "decode":
            self.accounting.truth(self.step, layer, needed)
        self._enqueue(
            self.predictor.on_layer(
                LayerObservation(
                    step=self.step,
                    layer=layer,
                    phase=self.phase,
                    real_experts=needed,
                    real_scores=real_scores,
                    shadow_scores=shadow_scores,
                    hidden=hidden,
                    score_layer=self.score_layer,
                    gate_ranked=gate_ranked,
                )
            )
        )

    def observe_mtp_output(self, ranked: dict[int, tuple[int, ...]]) -> None:
        """Predictions from the main routers applied to the MTP head's output (end of a decode step)."""
        self._enqueue(self.predictor.on_mtp_output(self.step, ranked))
        self._pump()

    # ---- residency ------------------------------------------------------------------------------------------------
    def _waves(self, layer: int, needed: list[int], split_resident: bool) -> Iterator[tuple[set[int], dict[int, int]]]:
        """Make `needed` experts resident, as many at a time as the cache holds; yield (experts, expert->slot) once
        they may be read. Resident experts come first (and, when `split_resident`, are yielded before the misses'
        copies are waited for, so their compute overlaps the copies)."""
        remaining = list(needed)
        while remaining:
            resident, fetched = [], []
            for expert in remaining:
                key = (layer, expert)
                if key in self.cache:
                    self._account_hit(key)
                    resident.append(expert)
            self.cache.lock((layer, e) for e in resident)
            for expert in remaining:
                key = (layer, expert)
                if key in self.cache:
                    continue
                alloc = self.cache.allocate(key)
                if alloc is None:
                    break  # every slot is locked by this wave: the rest waits for the next wave
                self._evicted(alloc.evicted)
                self.transfer.copy(self._host_record(key), self.pool[alloc.slot], alloc.slot, demand=True)
                self.accounting.copy(self.step, layer, expert, self.expert_bytes, prefetch=False)
                self.accounting.use(self.step, self.phase, layer, expert, "miss")
                self.cache.use(key)
                self.cache.lock([key])
                fetched.append(expert)
            if not resident and not fetched:
                raise RuntimeError(f"expert cache of {self.n_slots} slots cannot hold any expert of layer {layer}")
            self._pump()  # prefetches go out behind this layer's demand copies
            groups = [resident, fetched] if split_resident else [resident + fetched]
            for group in groups:
                if not group:
                    continue
                slots = {e: self.cache.slot_of[(layer, e)] for e in group}
                self.transfer.wait_for(list(slots.values()))
                yield set(group), slots
                self.transfer.release(list(slots.values()))
            self.cache.unlock([(layer, e) for e in resident + fetched])
            done = set(resident) | set(fetched)
            remaining = [e for e in remaining if e not in done]

    def _account_hit(self, key: ExpertKey) -> None:
        made_at = self._prefetched_unused.pop(key, None)
        layer, expert = key
        if made_at is None:
            outcome, lead = "hit", 0
        else:
            slot = self.cache.slot_of[key]
            outcome = "prefetched" if self.transfer.is_ready(slot) else "late"
            lead = (self.now[0] - made_at[0]) * len(self.layers) + (self.now[1] - made_at[1])
        self.accounting.use(self.step, self.phase, layer, expert, outcome, lead)
        self.cache.use(key)

    def _evicted(self, key: ExpertKey | None) -> None:
        if key is None:
            return
        unused = self._prefetched_unused.pop(key, None) is not None
        self.accounting.eviction(self.step, key[0], key[1], unused)

    # ---- prefetching ----------------------------------------------------------------------------------------------
    def _enqueue(self, predictions: list[Prediction]) -> None:
        """Queue predictions (within the per-target budget) and record them for recall/precision."""
        for p in predictions:
            if p.layer not in self.position:
                continue
            deadline = (p.step, self.position[p.layer])
            if deadline <= self.now:
                continue
            accepted = self.queue.add(deadline, p.layer, p.experts, self.now)
            self.accounting.predicted(p.step, p.layer, accepted, 0)
            for expert in accepted:  # a predicted expert that is already here is kept until it is needed
                if (p.layer, expert) in self.cache:
                    self.cache.protect((p.layer, expert), deadline)

    def _pump(self) -> None:
        """Issue queued prefetches, most urgent first, while the bytes in flight stay under the cap."""
        if self.preloaded:
            self.queue.clear_items()  # every expert is resident: predictions are only scored, never fetched
            return
        self._inflight = [(s, k) for s, k in self._inflight if not self.transfer.is_ready(s)]
        while (len(self._inflight) + 1) * self.expert_bytes <= self.max_inflight_bytes:
            item = self.queue.pop(self.now)
            if item is None:
                return
            key = item.key
            if key in self.cache:
                self.cache.protect(key, item.deadline)  # already here (or in flight): keep it until it is needed
                continue
            alloc = self.cache.allocate(key, prefetch_deadline=item.deadline)
            if alloc is None:
                # Nothing may be evicted for it now; later items could evict even less. Retry at the next pump,
                # when this step's earlier needs have been served and their protection has lapsed.
                self.queue.push_back(item)
                return
            self._evicted(alloc.evicted)
            self.transfer.copy(self._host_record(key), self.pool[alloc.slot], alloc.slot, demand=False)
            self.accounting.copy(self.step, key[0], key[1], self.expert_bytes, prefetch=True)
            self._prefetched_unused[key] = item.made_at
            self.cache.protect(key, item.deadline)
            self._inflight.append((alloc.slot, key))

    # ---- compute --------------------------------------------------------------------------------------------------
    def _weights(self, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [n, 2I, H] and down [n, H, I] of the given slots, in the compute dtype."""
        if not self.fmt.quantized:
            return self._gate_up[slot_ids], self._down[slot_ids]
        return self.fmt.dequantize(self.pool[slot_ids])

    def compute_gathered(
        self, x: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Decode: x [N, H], slots/valid/weights [N, k] (device) -> routed output [N, H] fp32.

        One batched GEMV per (row, k) entry over the slot pool; invalid entries point at a stand-in slot and are
        masked out of the fixed-order sum, so the shapes (and each entry's bits) never depend on the cache."""
        n, k = slots.shape
        gate_up, down = self._weights(slots.flatten())
        x_rep = x[:, None, :].expand(n, k, x.shape[-1]).reshape(n * k, -1)
        y = gathered_expert_ffn(x_rep, gate_up, down, self.act).view(n, k, -1)
        return combine_expert_outputs(y, weights, valid)

    def preloaded_base(self, layer: int) -> int:
        """All-resident mode: the slot of expert 0 of `layer` (experts are laid out layer by layer)."""
        return self.position[layer] * self.n_experts

    def _compute_per_expert(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        valid: torch.Tensor,
        layer: int,
        wave: set[int],
        slots: dict[int, int],
        out: torch.Tensor,
    ) -> None:
        """Prefill: each expert of the wave on all the tokens routed to it (one GEMM per expert)."""
        for expert in sorted(wave):
            rows, kpos = torch.nonzero((ids == expert) & valid, as_tuple=True)
            if rows.numel() == 0:
                continue
            rows_d, kpos_d = rows.to(self.device), kpos.to(self.device)
            gate_up, down = self._weights(torch.tensor([slots[expert]], device=self.device))
            out[rows_d, kpos_d] = expert_ffn(x[rows_d], gate_up[0], down[0], self.act).to(out.dtype)

    # ---- reporting ------------------------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        return {
            "vram_expert_cache_bytes": self.pool.numel(),
            "expert_cache_slots": self.n_slots,
            "host_expert_bytes": self.store.nbytes if self.store else 0,
            "host_pinned_bytes": self.store.pinned_bytes if self.store else 0,
            "expert_record_bytes": self.expert_bytes,
        }


def _distinct_experts(ids_blocks: list[torch.Tensor], active_blocks: list[torch.Tensor | None]) -> list[int]:
    """Distinct experts of the active rows, in first-use order."""
    seen: dict[int, None] = {}
    for ids, active in zip(ids_blocks, active_blocks):
        rows = ids if active is None else ids[active]
        for expert in rows.flatten().tolist():
            seen.setdefault(int(expert), None)
    return list(seen)


def _distinct_lists(blocks: list[tuple[list[list[int]], list[bool]]]) -> list[int]:
    """Distinct experts of the active rows, in first-use order."""
    seen: dict[int, None] = {}
    for ids, active in blocks:
        for row, row_active in zip(ids, active):
            if row_active:
                for expert in row:
                    seen[expert] = None
    return list(seen)


def _plan_lists(
    lut: dict[int, int], ids: list[list[int]], active: list[bool], stand_in: int
) -> tuple[list[list[int]], list[list[bool]]]:
    """(slot ids [N][k], valid [N][k]) from an expert->slot table; absent or inactive entries point at a real slot
    so the gathered compute keeps its shape, and are masked out of the sum."""
    slots, valid = [], []
    for row, row_active in zip(ids, active):
        slots.append([lut.get(e, stand_in) if row_active else stand_in for e in row])
        valid.append([row_active and e in lut for e in row])
    return slots, valid


def prefetch_budget(multiple: float, top_k: int, rows: int) -> int:
    return max(int(math.ceil(multiple * top_k * rows)), 0)
