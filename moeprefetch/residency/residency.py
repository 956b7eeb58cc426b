"""`Residency`: the VRAM slot pool, the host store, the table and the kernels' launchers, wired for one model (the
package docstring says how a step uses it)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch

from ..expert_records import ExpertFormat, activation
from ..kernels import kernels_usable
from ..kernels.experts import RoutedExperts, combine_in_k_order, row_pad
from ..kernels.grouped import GroupedExperts, grouped_mm_usable
from .fill import Filler
from .plan_kernel import LayerPlanner
from ..store import HostExpertStore
from ..predictors import LeadTracker
from ..transfer import SideStream, TransferEngine
from .plan import finish_call, next_use_table, victim_order
from .prefill import PrefillExperts
from .probe import SlotProbe
from .state import (C, COUNTERS, E_ACTIVE, E_FREE, FILLING, NO_ENTRY, RESIDENT, ROUTING_HISTORY, ResidencyConfig,
                    TableState)

if TYPE_CHECKING:
    from ..distributed import ProcessGroup
    from ..placement import ExpertPlacement

logger = logging.getLogger(__name__)

RING_CAPACITY = 9  # steps of predictions a table can hold (lookahead up to 8)
ENTRIES = 64  # fill entries: reserved fills plus published ones awaiting the step's end
PREFILL_STAGING_BYTES = 512 << 20  # VRAM for prefill's experts that find no slot (two halves: copy while computing)
PREFILL_STAGING_SHARE = 1 / 16  # at most, of the VRAM a budget leaves beside weights and KV cache


def prefill_staging_rows(record_bytes: int, n_experts: int, room_bytes: int | None = None) -> int:
    """Staging rows for prefill (an even number, at least 2, at most two layers' worth), within PREFILL_STAGING_BYTES
    and a sixteenth of `room_bytes` (the VRAM a budget leaves beside weights and KV cache, when there is a budget):
    the memory plan reserves exactly these."""
    cap = PREFILL_STAGING_BYTES if room_bytes is None else min(PREFILL_STAGING_BYTES, PREFILL_STAGING_SHARE * room_bytes)
    rows = min(int(cap) // record_bytes, 2 * n_experts)
    return max(2, rows - rows % 2)


class Residency:
    def __init__(
        self,
        fmt: ExpertFormat,
        layers: list[int],
        main_layers: int,
        n_experts: int,
        top_k: int,
        n_slots: int,
        device: torch.device,
        hidden_act: str,
        store: HostExpertStore | None,
        max_rows: int,
        policy: str = ResidencyConfig.policy,
        frequency_halflife: float = ResidencyConfig.frequency_halflife,
        hot_set: list[tuple[int, int]] | None = None,
        use_kernels: bool | None = None,
        stage_rows: int | None = None,
        placement: "ExpertPlacement | None" = None,
        group: "ProcessGroup | None" = None,
        prefill_chunk: int | None = None,
    ):
        self.fmt = fmt
        self.placement, self.group = placement, group
        # [P, E] each expert's local number on this rank (-1: another rank's); None in one process
        self.local_of = placement.local_table(device) if placement is not None else None
        self.layers = list(layers)
        self.position = {layer: i for i, layer in enumerate(self.layers)}
        self.n_experts, self.top_k, self.n_slots = n_experts, top_k, n_slots
        self.device = device
        self.store = store
        self.preloaded = store is None
        self.act = activation(hidden_act)
        # The kernels read missed experts in place from the host store: only page-locked memory has a device address.
        reachable = store is None or store.pinned or device.type != "cuda"
        self.use_kernels = (kernels_usable(device.type) and reachable) if use_kernels is None else use_kernels
        if use_kernels is None and kernels_usable(device.type) and not reachable:
            logger.warning("the host expert store is not page-locked, so the GPU cannot read it in place: decode "
                           "runs the reference residency path (one synchronisation per MoE layer, much slower)")
        self.max_rows = row_pad(max_rows)  # rows of one decode step's MoE (exact + shadow/draft)
        self.max_experts = max(self.max_rows * top_k, n_experts)
        self.base_cfg = ResidencyConfig(
            positions=len(self.layers), main_positions=main_layers, n_experts=n_experts, n_slots=n_slots,
            record_bytes=fmt.record_bytes, policy=policy, frequency_halflife=float(frequency_halflife))
        self.cfg = self.base_cfg
        self.st = TableState.allocate(replace(self.base_cfg, ring=RING_CAPACITY, entries=ENTRIES), self.max_experts,
                                      device)
        # predictions by lead and how they fared (predictors.py), zeroed per call
        self.leads = LeadTracker(RING_CAPACITY - 1, RING_CAPACITY, len(self.layers), n_experts, device)
        self._launchers: dict[ResidencyConfig, tuple[LayerPlanner, LayerPlanner, Filler]] = {}
        # zero-filled once: a slot is only read once published, but NaN bits must not meet a masked multiply. Prefill's
        # staging rows follow the slots in the same allocation, so the expert kernels address them as slots.
        if store is None:
            self.stage_rows = 0
        else:
            self.stage_rows = stage_rows if stage_rows is not None else prefill_staging_rows(fmt.record_bytes, n_experts)
        self.stage_batch = max(self.stage_rows // 2, 1)  # experts per staged batch (half the rows)
        self.slots_and_staging = torch.zeros((n_slots + self.stage_rows, fmt.record_bytes), dtype=torch.uint8,
                                             device=device)
        self.pool = self.slots_and_staging[:n_slots]
        # prefill's copies of missed experts into the staging rows (prefill.py drives them)
        self.staging = TransferEngine(device, self.stage_rows) if self.stage_rows else None
        self.prefill_extra: dict[str, float] = {}  # the last call's prefill statistics (`_collect_staging_stall`)
        self.host = store.arena if store is not None else None
        self.side = SideStream(device)
        self.trace: torch.Tensor | None = None  # [steps, P, E] uint8 while recording an oracle trace
        self.prefill_log: list[tuple[int, list[int]]] | None = None  # (layer, experts) of prefill, when recording
        self.next_use: torch.Tensor | None = None  # [steps, keys] next need per key, from an oracle trace
        self.probe: SlotProbe | None = None  # debugging: what the expert kernels read (`enable_probe`)
        self._belady_prefill = False  # the open prefill step follows the known future (see begin_step)
        # fixed buffers of the host-side plans (the step start's own plan, prefill plans), which prefill reads too
        i32 = torch.int32
        self._no_rows = torch.zeros(0, top_k, dtype=torch.int64, device=device)
        self._no_act = torch.zeros(0, dtype=torch.bool, device=device)
        self._no_assign = torch.zeros(0, top_k, dtype=i32, device=device)
        self.host_plan = PlanBuffers(n_experts, self.max_experts, 1, 1, device)
        self.every_expert = torch.arange(n_experts, dtype=torch.int64, device=device)[:, None]  # prefill plans' rows
        self.act_name = hidden_act
        self.grouped = GroupedExperts(fmt, self.slots_and_staging, self.host, hidden_act, self.act,
                                      self.use_kernels and device.type == "cuda")
        self.grouped_mm = grouped_mm_usable(fmt, device)  # prefill's experts as CUTLASS grouped GEMMs
        self._prefill = PrefillExperts(self, joint_tokens=prefill_chunk)
        self.experts = RoutedExperts(fmt, self.pool, self.host, hidden_act, self.act, max_rows, top_k,
                                     self.use_kernels)
        self.set_hot_set(hot_set or [])
        self.configure()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # ---- configuration ----------------------------------------------------------------------------------------
    def configure(self, ring: int = 2, budget_per_target: int | None = None, max_inflight: int | None = None,
                  min_confidence: float = 0.0, spare_recent: int | None = None, wait_late: bool = True,
                  prefetch_lead: int = 0, policy: str | None = None,
                  frequency_halflife: float | None = None, fill_confidence: float = 0.0,
                  fill_idle_link: bool = False, reuse_weight: float = 0.0, bypass: bool = False) -> None:
        """Per-call prefetch settings: prediction ring depth, fills per target, fills in flight, confidence cut, the
        steps of recent experts that prefetches spare (0 for the oracle: Belady's victims know better), how many
        MoE positions ahead a fill may be reserved (0: the whole prediction window), the cache policy and LRFU's
        half-life in steps (default: the engine's; the routing history LFU and LRFU rank by is kept whatever the
        policy), the confidence a prediction needs to be fetched rather than only protected, and whether fills for
        later layers yield the link to a layer's host reads, how much a predictor's reuse probabilities weigh in
        the victims' order, and whether a miss less likely to be needed soon than its victim bypasses the cache.
        Each setting gets its own launchers (captured graphs keep theirs); the table tensors never move."""
        budget = budget_per_target if budget_per_target is not None else self.base_cfg.budget_per_target
        inflight = min(max_inflight if max_inflight is not None else self.base_cfg.max_inflight, ENTRIES // 2)
        self.cfg = replace(self.base_cfg, ring=min(max(ring, 1), RING_CAPACITY), budget_per_target=budget,
                           max_inflight=inflight, min_confidence=float(min_confidence), entries=ENTRIES,
                           spare_recent=self.base_cfg.spare_recent if spare_recent is None else spare_recent,
                           wait_late=bool(wait_late), prefetch_lead=int(prefetch_lead),
                           policy=policy or self.base_cfg.policy,
                           frequency_halflife=float(frequency_halflife or self.base_cfg.frequency_halflife),
                           fill_confidence=float(fill_confidence), fill_idle_link=bool(fill_idle_link),
                           reuse_weight=float(reuse_weight), bypass=bool(bypass))
        if self.cfg not in self._launchers:
            self._launchers[self.cfg] = (
                LayerPlanner(self.st, self.cfg, self.top_k, self.max_rows, self.max_rows, self.use_kernels),
                LayerPlanner(self.st, replace(self.cfg, wait_late=False), 1, self.n_experts, 0, self.use_kernels),
                Filler(self.st, self.cfg, self.pool, self.host, self.use_kernels and self.device.type == "cuda"),
            )
        self.planner, self.prefill_planner, self.filler = self._launchers[self.cfg]

    def set_hot_set(self, keys: list[tuple[int, int]]) -> None:
        """The static policy's pinned experts, as (checkpoint layer, expert) pairs."""
        self.st.pinned.zero_()
        self.hot_set_size = 0  # this rank's pinned experts (read by the host, never from the device)
        for layer, expert in keys:
            if self.owns(layer, expert):  # each rank pins its own, under their local numbers
                if self.placement is not None:
                    expert = self.placement.owned(self.position[layer]).index(expert)
                self.st.pinned[self.key(layer, expert)] = 1
                self.hot_set_size += 1

    def owns(self, layer: int, expert: int) -> bool:
        """Whether this rank holds (checkpoint layer, expert); always in one process."""
        return self.placement is None or self.placement.owns(self.position[layer], expert)

    def key(self, layer: int, expert: int) -> int:
        return self.position[layer] * self.n_experts + expert

    def local_ids(self, position: int, ids: torch.Tensor) -> torch.Tensor:
        """Selected experts [..] as this rank's local numbers (-1 where another rank owns one); unchanged in one
        process."""
        if self.local_of is None:
            return ids
        return self.local_of[position].index_select(0, ids.reshape(-1).long()).view(ids.shape)

    def global_key(self, key: int) -> tuple[int, int]:
        """(checkpoint layer, checkpoint expert) of a table key."""
        position, local = divmod(key, self.n_experts)
        expert = self.placement.global_expert(position, local) if self.placement is not None else local
        return self.layers[position], expert

    @property
    def expert_bytes(self) -> int:
        return self.fmt.record_bytes

    # ---- set-up -------------------------------------------------------------------------------------------------
    def preload(self, pack: Callable[[int, int, torch.Tensor], None], progress: bool = True) -> None:
        """All-resident mode: every expert in its own slot (slot = key), for good."""
        from tqdm.auto import tqdm

        staging = torch.empty(self.fmt.record_bytes, dtype=torch.uint8)
        keys = [(layer, e) for layer in self.layers for e in range(self.n_experts)]
        assert len(keys) == self.n_slots
        for key, (layer, expert) in enumerate(tqdm(keys, desc="experts", unit="expert", disable=not progress,
                                                   leave=False)):
            pack(layer, expert, staging)
            self.pool[key].copy_(staging)
        everything = torch.arange(self.n_slots, dtype=torch.int32, device=self.device)
        self.st.slot_of.copy_(everything)
        self.st.key_of.copy_(everything)
        self.st.slot_state.fill_(RESIDENT)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- calls and steps ----------------------------------------------------------------------------------------
    def begin_call(self) -> None:
        self._prefill.begin_call()
        self.leads.reset()
        self.st.counters.zero_()
        self.st.decode_step.fill_(-1)

    def begin_step(self, decode: bool, belady: bool = False) -> None:
        """Open a step; with `belady`, victims follow the known future (`know_future`) instead of the policy. A
        prefill step with `belady` counts as before decode step 0 and re-opens at each layer (`prefill_experts`), so a
        layer may evict what earlier layers of the prompt used: the prompt leaves behind the experts that decode
        needs first, as Belady's replacement over the prompt would, instead of its first layers' experts."""
        self._belady_prefill = belady and not decode
        self.planner.step_start(decode, self.next_use if belady else None)

    def open_prefill_layer(self) -> None:
        """Before a prefill layer's plan: a prefill step that follows the known future re-opens here (`begin_step`),
        so each layer's victims are Belady's over what is left of the prompt and decode."""
        if self._belady_prefill:
            self.planner.step_start(False, self.next_use)

    def defer_pending(self, steps: int) -> None:
        """`steps` table steps that are not decode steps are about to run (a request's prefill joining a running
        batch): the fills reserved and the experts protected for later needs move by as many steps, so neither the
        prefill's step starts release them nor its plans evict them, and the next decode step finds them where they
        were. Device tensors only (no synchronisation)."""
        if steps <= 0:
            return
        st, delta = self.st, steps * self.cfg.steps_clock
        now = st.progress  # [1]: the clock at the last plan or step end
        pending = (st.e_state == E_ACTIVE) & (st.e_deadline > now)
        st.e_deadline.add_(torch.where(pending, delta, 0))
        st.protect.add_(torch.where(st.protect > now, delta, 0))

    def know_future(self, trace: torch.Tensor) -> None:
        """An oracle's recorded routing [decode steps, P, E]: victims become Belady's (farthest next need first)."""
        if self.next_use is None or self.next_use.shape[0] != trace.shape[0]:
            self.next_use = torch.empty(trace.shape[0], trace.shape[1] * trace.shape[2], dtype=torch.int64,
                                        device=self.device)
        next_use_table(trace, self.next_use)

    def plan_step(self) -> None:
        """The step start's own plan: prefetch reservations for targets known before the first layer runs."""
        out = self.host_plan
        self.planner(-1, self._no_rows, self._no_act, None, None, self._no_assign, out.u_key, out.u_slot, out.u_dst,
                     reserve=True, count_recall=False, u_wait=out.u_wait)
        self.fill(-1)

    def fill(self, position: int) -> None:
        if not self.preloaded:
            self.side.launch(lambda: self.filler(position))

    def end_step(self) -> None:
        self.st.progress.copy_(self.st.step * self.cfg.steps_clock + (self.cfg.steps_clock - 1))
        self.side.join()

    def end_call(self) -> torch.Tensor:
        """After the call's last step (streams idle): settle fills and unused prefetches; the counters, on the host."""
        self.settle()
        self._collect_staging_stall()
        if self.group is not None:  # the call's statistics are every rank's together
            self.group.all_reduce_(self.st.counters)
            self.group.all_reduce_(self.leads.counts)
        return self.st.counters.cpu()

    def settle(self) -> None:
        """Streams idle: publish what landed, release unfinished fills and count unused prefetches as wasted, so the
        table holds no half-planned entries; one synchronisation, the counters run on. Every call's end does it, and
        a long-running batch when its last row leaves (no call ends there)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        finish_call(self.st, self.cfg)

    def corrupt_slots(self) -> list[int]:
        """Published slots whose bytes differ from their expert's host record (streams idle; a debugging check, one
        synchronisation and a read of every resident slot). Empty unless a fill or an admission raced a reader or
        another writer: a correct table only ever publishes whole copies."""
        if self.host is None:
            return []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        state, keys = self.st.slot_state.cpu(), self.st.key_of.cpu()
        slots = [s for s in range(self.n_slots) if int(state[s]) == RESIDENT and int(keys[s]) >= 0]
        bad = []
        for start in range(0, len(slots), 64):  # compare in batches: bounded device memory for the host copies
            batch = slots[start:start + 64]
            index = torch.tensor(batch, dtype=torch.long)
            host = self.host.index_select(0, keys[index].long()).to(self.device)
            same = (self.pool.index_select(0, index.to(self.device)) == host).all(dim=1).cpu()
            bad += [slot for slot, ok in zip(batch, same.tolist()) if not ok]
        return bad

    def enable_probe(self, whole_table: bool = True) -> SlotProbe:
        """Check every slot each decode layer reads, before and after its expert kernel, and (`whole_table`) every
        published slot around each layer's plan (`probe.py`; debugging: a device copy of a sample of every record).
        The table checks slow each layer enough that fills stop being late; the read checks cost microseconds.
        Decode steps captured before this call do not run the probe."""
        if self.host is None:
            raise ValueError("every expert is resident: there are no fills or admissions to probe")
        if self.probe is None:
            self.probe = SlotProbe(self.pool, self.host, self.max_rows * self.top_k)
        self.probe.whole_table = whole_table
        return self.probe

    def abort(self) -> None:
        """After an interrupted or failed step: the table may hold half-planned entries, so start cold."""
        self.settle()
        self._collect_staging_stall()
        self.reset()

    def _collect_staging_stall(self) -> None:
        """Read (and release) the staging copies' wait timings and the copies ahead: the call's prefill extras."""
        self._prefill.forget_ahead()
        self.prefill_extra = {
            "prefill_stall_seconds": self.staging.collect_stall_seconds() if self.staging is not None else 0.0,
            "prefill_experts_ahead": self._prefill.copied_ahead,  # copied before their layer's router ran
            "prefill_experts_ahead_unused": self._prefill.unused_ahead,  # of which the layer did not use
            "prefill_chunks_joined": self._prefill.joined_chunks,  # (chunk, layer)s computed in a launch with others
        }

    # ---- decode: one MoE layer inside the step's graph ----------------------------------------------------------
    def decode_experts(self, layer: int, x: torch.Tensor, ids_x: torch.Tensor, act_x: torch.Tensor,
                       ids_s: torch.Tensor | None, act_s: torch.Tensor | None, weights: torch.Tensor,
                       buffers: "PlanBuffers", reserve: bool, count_recall: bool) -> torch.Tensor:
        """x [N, H] (exact rows, then shadow rows), ids/act per group, weights [N, k] -> routed output [N, H] fp32.
        Shadow rows skip experts that are not available: their weights are rescaled over the ones computed."""
        position = self.position[layer]
        n = x.shape[0]
        assign = buffers.assign[:n]
        ids_x = self.local_ids(position, ids_x)
        ids_s = self.local_ids(position, ids_s) if ids_s is not None else None
        if self.probe is not None and self.probe.whole_table:
            self.probe.table(self.st, 0, position)
        self.planner(position, ids_x, act_x, ids_s, act_s, assign, buffers.u_key, buffers.u_slot, buffers.u_dst,
                     reserve, count_recall, self.trace, buffers.u_wait)
        self.fill(position)
        if self.probe is not None and self.probe.whole_table:
            self.probe.table(self.st, 1, position)
        if self.cfg.wait_late and not self.preloaded and ids_x.shape[0] > 0:  # only exact rows can be late
            self.filler.await_fills(position, buffers.u_wait, buffers.u_slot)
        if self.probe is not None:
            self.probe.before(buffers.u_key, buffers.u_slot, buffers.u_wait)
        if self.group is not None:
            return self._exchanged(x, assign, weights, ids_x.shape[0] if ids_s is not None else n, buffers)
        if ids_s is not None:
            nx = ids_x.shape[0]
            weights = torch.cat((weights[:nx], renormalise(weights[nx:], assign[nx:] >= 0)))
        out = self.experts(x, assign, weights.contiguous(), buffers.u_key, buffers.u_slot, buffers.u_dst,
                           out=buffers.out[:n], step_rows=buffers.step_rows)
        if self.probe is not None:
            self.probe.after(buffers.u_key, buffers.u_slot)
        self._host_reads_done()
        return out

    def _host_reads_done(self) -> None:
        """After a layer's experts (main stream): its host reads are over, so yielding fills may use the link."""
        if self.cfg.fill_idle_link and not self.preloaded:
            self.st.demand.zero_()

    def _exchanged(self, x: torch.Tensor, assign: torch.Tensor, weights: torch.Tensor, nx: int,
                   buffers: "PlanBuffers") -> torch.Tensor:
        """Expert parallelism: this rank's products per (row, k) (zeros for the rest) and a flag per computed entry,
        summed over the ranks in one all-reduce (each entry comes from one rank: the sum is exact), then combined in
        k order as one process combines them. Shadow rows renormalise over the experts some rank had in VRAM."""
        terms = self.experts.terms(x, assign, buffers.u_key, buffers.u_slot, buffers.u_dst,
                                   step_rows=buffers.step_rows)  # [N, k, H] fp32
        packed = torch.cat((terms, (assign >= 0).float()[..., None]), -1)
        self._host_reads_done()
        self.group.all_reduce_(packed)  # type: ignore[union-attr]
        valid = packed[..., -1] > 0
        if nx < x.shape[0]:
            weights = torch.cat((weights[:nx], renormalise(weights[nx:], valid[nx:])))
        return combine_in_k_order(packed[..., :-1], weights.float(), valid)

    # ---- prefill: many tokens per expert (prefill.py) -----------------------------------------------------------
    def prefill_experts(self, layer: int, xs: list[torch.Tensor], ids: list[torch.Tensor],
                        weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """A prefill window's routed experts at one layer: per chunk, xs [T, H] and ids/weights [T, k] -> [T, H] fp32;
        each used expert once per window, on all of its tokens."""
        position = self.position[layer]
        return self._prefill(layer, xs, [self.local_ids(position, i) for i in ids], weights)

    # ---- cold starts and snapshots -----------------------------------------------------------------------------
    def reset(self, forget_routing: bool = False) -> None:
        """Forget every cached expert (cold cache); all-resident tables never change. The routing history (use
        counts, LRFU frequencies) is kept unless `forget_routing`."""
        if self.preloaded:  # all resident: only the routing history can be forgotten
            if forget_routing:
                for name in ROUTING_HISTORY:
                    getattr(self.st, name).zero_()
            return
        pinned = self.st.pinned.clone()
        history = {} if forget_routing else {name: getattr(self.st, name).clone() for name in ROUTING_HISTORY}
        fresh = TableState.allocate(replace(self.cfg, ring=RING_CAPACITY, entries=ENTRIES), self.max_experts,
                                    self.device)
        self.st.load(fresh.tensors())
        self.st.pinned.copy_(pinned)
        for name, values in history.items():  # routing history is no cache content: LFU and LRFU keep it
            getattr(self.st, name).copy_(values)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return self.st.snapshot()

    def restore(self, snap: dict[str, torch.Tensor]) -> None:
        """Put back a snapshot taken between calls, re-copying the bytes of every slot it lists as resident."""
        if self.preloaded:
            return
        self.st.load(snap)
        for slot, key in enumerate(snap["key_of"].tolist()):
            if key >= 0 and int(snap["slot_state"][slot]) == RESIDENT:
                self.pool[slot].copy_(self.host[key], non_blocking=True)  # type: ignore[index]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def problems(self) -> list[str]:
        """Invariants of a table between calls (empty when consistent); for tests and debugging."""
        st = self.st
        slot_of, key_of, state = st.slot_of.tolist(), st.key_of.tolist(), st.slot_state.tolist()
        found = []
        for key, slot in enumerate(slot_of):
            if slot >= 0 and (key_of[slot] != key or state[slot] != RESIDENT):
                found.append(f"key {key} lists slot {slot}, which holds key {key_of[slot]} in state {state[slot]}")
        for slot, key in enumerate(key_of):
            if state[slot] == RESIDENT and (key < 0 or slot_of[key] != slot):
                found.append(f"resident slot {slot} holds key {key}, which is not published there")
            if state[slot] == FILLING:
                found.append(f"slot {slot} is still filling between calls")
        if any(s != E_FREE for s in st.e_state.tolist()):
            found.append("fill entries are still in use between calls")
        if any(k >= 0 for k in st.adm_key.tolist()) or any(i != NO_ENTRY for i in st.inflight_of.tolist()):
            found.append("admissions or fills are still pending between calls")
        return found

    def resident_keys(self) -> list[tuple[int, int]]:
        """(layer, expert) of every resident slot (one read of the table)."""
        keys = (self.global_key(k) for k in self.st.key_of.tolist() if k >= 0)
        return [key for key in keys if key[1] >= 0]  # not a rank's padding records

    # ---- reporting ------------------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        table = sum(t.numel() * t.element_size() for t in self.st.tensors().values())
        return {
            "vram_expert_cache_bytes": self.pool.numel(),
            "vram_prefill_staging_bytes": self.stage_rows * self.expert_bytes,
            "vram_residency_table_bytes": table,
            "expert_cache_slots": self.n_slots,
            "host_expert_bytes": self.store.nbytes if self.store else 0,
            "host_pinned_bytes": self.store.pinned_bytes if self.store else 0,
            "expert_record_bytes": self.expert_bytes,
            # a quantised record's scales (and 4-bit zero points) live in the record, in its slot and on the link:
            # resident scales would move 6 % fewer bytes a miss (int4) but take slots, which pays only near full
            # residency on real routing (BENCHMARKS "Where 4-bit scales should live")
            "expert_record_scale_bytes": self.fmt.scale_bytes,
        }

    def close(self) -> None:
        """Free the slot pool and unpin the host store (the engine drops its last references after this)."""
        if self.store is not None:
            self.store.close()
        self.pool = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.slots_and_staging = self.pool
        self.grouped = None  # type: ignore[assignment]
        self.experts = None  # type: ignore[assignment]
        self.filler = None  # type: ignore[assignment]
        self.probe = None


class PlanBuffers:
    """Static per-step buffers between a layer's plan and its expert kernel (reused by every layer of a step)."""

    def __init__(self, rows: int, max_experts: int, top_k: int, hidden: int, device: torch.device,
                 step_rows: int | None = None):
        self.step_rows = step_rows or rows  # the most rows one of the step's layers computes (fixes the kernel)
        i32 = torch.int32
        self.assign = torch.full((rows, top_k), -1, dtype=i32, device=device)
        self.u_key = torch.full((max_experts,), -1, dtype=i32, device=device)
        self.u_slot = torch.full((max_experts,), -1, dtype=i32, device=device)
        self.u_dst = torch.full((max_experts,), -1, dtype=i32, device=device)
        self.u_wait = torch.full((max_experts,), -1, dtype=i32, device=device)  # late experts' fill entries
        self.out = torch.zeros(rows, hidden, dtype=torch.float32, device=device)


def renormalise(weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Shadow rows skip missing experts: rescale the kept weights to the full weight mass, at most k-fold (a lone
    low-weight expert must not be blown up into values that overflow fp16)."""
    kept = torch.where(valid, weights, torch.zeros_like(weights)).sum(-1, keepdim=True)
    total = weights.sum(-1, keepdim=True)
    scale = torch.where(kept > 0, total / kept.clamp(min=1e-20), torch.zeros_like(kept))
    return weights * scale.clamp(max=float(weights.shape[-1]))


def counters_by_layer(counters: torch.Tensor, layers: list[int]) -> dict[int, dict[str, int]]:
    rows = counters.tolist()
    return {layer: {name: rows[p][C[name]] for name in COUNTERS} for p, layer in enumerate(layers)}


__all__ = ["Residency", "PlanBuffers", "counters_by_layer", "prefill_staging_rows", "victim_order"]
