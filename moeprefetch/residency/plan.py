"""What the residency table does at each plan point: the definition that the Triton plan kernel implements.

The main stream runs one plan per MoE layer (after its router), one at each step start and one at each step end;
nothing here waits for the host. A layer plan, in order:

1. **publish**: fills whose every chunk has landed (`e_ready`) and the previous plan's admissions become resident;
2. **the layer's exact experts** (real rows, verified drafts), distinct, in first-use order. A published slot is a hit
   (a `prefetched` one if an unused prefetch brought it); a key whose fill is still in flight is `late`; anything
   else is a `miss`. Late and missed experts are read from host memory by the expert kernel (zero-copy), and a miss
   is *admitted*: a victim slot is reserved and the kernel writes the expert into it as it streams;
3. **shadow rows** (the MTP draft, predictors only) use an expert only if it is already published or read anyway;
4. **accounting** per MoE position, and the recall of the predictions made for this (step, layer);
5. **prefetch reservation**: predictions for later layers of this step and for the next step, in deadline order,
   with confidence >= `min_confidence`, at most `budget_per_target` fills per target and `max_inflight` in flight.
   A predicted expert that is already resident is protected until its need; a missing one gets a victim slot and a
   fill entry once its need is at most `prefetch_lead` MoE positions ahead (a fill reserved earlier holds its slot
   longer, and its victim is chosen on less knowledge: see `_reserve`);
6. the deadline-ordered list of unfinished fills, for the fill launch that follows this plan.

Victims come from a queue sorted once per step (free slots first; LRU: least recently used; LFU: fewest uses; LRFU:
the lowest use frequency decayed per step, `age_frequencies`; the static policy's hot set never). A slot is a victim
only if nothing of the current step used it, no live prediction protects it, and no fill or admission is writing it.
Eviction points the old key back at host memory first.

This module is the CPU implementation and the reference of `plan_kernel.py`; it uses plain Python over small lists,
which is fast enough on the CPU, where every step of the test suite runs through it.
"""

from __future__ import annotations

import array

import torch

from .state import (ADMITTING, C, E_ACTIVE, E_DONE, E_FREE, FAR, FILLING, FREE, NO_ENTRY, POLICY_CODES, RESIDENT,
                    ResidencyConfig, TableState)


class _Lists:
    """Python-list views of the table for one plan; written back at the end."""

    NAMES = ("slot_of", "key_of", "slot_state", "last_use", "protect", "prefetched_at", "use_count", "pinned",
             "inflight_of", "e_state", "e_key", "e_slot", "e_deadline", "e_made", "e_next", "e_done", "e_ready",
             "adm_key", "adm_slot", "victims", "fills_for", "counters")

    def __init__(self, st: TableState):
        self.st = st
        for name in self.NAMES:
            setattr(self, name, getattr(st, name).tolist())
        self.pred = st.pred  # read-mostly, indexed sparsely
        self.cursor = int(st.cursor[0])

    def write_back(self) -> None:
        for name in self.NAMES:
            target = getattr(self.st, name)
            target.copy_(_as_tensor(getattr(self, name), target))
        self.st.cursor.fill_(self.cursor)

    def bump(self, position: int, counter: str, amount: int = 1) -> None:
        self.counters[position][C[counter]] += amount


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q", torch.float32: "f"}


def _as_tensor(values: list, like: torch.Tensor) -> torch.Tensor:
    """A list view back as a tensor shaped like `like` (through a packed buffer: torch.tensor on Python ints is the
    plans' largest cost on the CPU)."""
    if like.dim() == 1 and like.dtype in _ARRAY_CODES and values:
        return torch.frombuffer(array.array(_ARRAY_CODES[like.dtype], values), dtype=like.dtype)
    return torch.tensor(values, dtype=like.dtype)


# ---- pieces shared by every plan ---------------------------------------------------------------------------------


def _publish(t: _Lists, cfg: ResidencyConfig) -> None:
    for j, state in enumerate(t.e_state):
        if state == E_ACTIVE and t.e_ready[j] == 1:
            key, slot = t.e_key[j], t.e_slot[j]
            t.slot_of[key] = slot
            t.slot_state[slot] = RESIDENT
            t.prefetched_at[slot] = t.e_made[j]
            t.inflight_of[key] = NO_ENTRY
            t.e_state[j] = E_DONE
            t.bump(key // cfg.n_experts, "fills_done")
            t.bump(key // cfg.n_experts, "fill_chunks", cfg.chunks)
    for a, key in enumerate(t.adm_key):
        if key >= 0:
            slot = t.adm_slot[a]
            t.slot_of[key] = slot
            t.slot_state[slot] = RESIDENT
            t.inflight_of[key] = NO_ENTRY
            t.adm_key[a] = -1


def _eligible(t: _Lists, slot: int, now: int, step_base: int) -> bool:
    key = t.key_of[slot]
    return (
        t.slot_state[slot] != FILLING
        and not (key >= 0 and t.pinned[key])
        and t.protect[slot] < now
        and t.last_use[slot] < step_base
    )


def _pop_victims(t: _Lists, count: int, now: int, step_base: int, warm_from: int | None = None) -> list[int]:
    """Up to `count` victims, the next eligible slots of the step's eviction queue. With `warm_from` (prefetches),
    the pop stops at the first held slot used at or after that clock, in the last steps or in this one: prefetches
    take only the untouched head of the queue (sorted by recency at the step's start), and everything from the
    first recent slot on stays for demand misses. Stopping also at a slot hit during this step is deliberate: on the
    reference model at 25 % cached, skipping such slots instead let `mtp+next_layer_gate` move 11.6 experts per
    token instead of 8.3, with more misses (1.7 instead of 1.5 per token)."""
    taken: list[int] = []
    i = t.cursor
    while len(taken) < count and i < len(t.victims):
        slot = t.victims[i]
        if warm_from is not None and t.slot_state[slot] != FREE and t.last_use[slot] >= warm_from:
            break
        i += 1
        if _eligible(t, slot, now, step_base):
            taken.append(slot)
    t.cursor = i
    return taken


def _evict(t: _Lists, cfg: ResidencyConfig, slot: int) -> None:
    old = t.key_of[slot]
    if old >= 0:
        t.slot_of[old] = -1
        t.bump(old // cfg.n_experts, "evictions")
        if t.prefetched_at[slot] >= 0:
            t.bump(old // cfg.n_experts, "prefetch_wasted")
    t.prefetched_at[slot] = -1


# ---- the layer plan ----------------------------------------------------------------------------------------------


def _classify_exact(t: _Lists, cfg: ResidencyConfig, position: int, now: int, exact: dict[int, int],
                    keys: list[int], slots: list[int], waits: list[int]) -> list[int]:
    """The exact rows' distinct experts (expert -> u): hit, prefetched, late or miss, with recency and counters.
    Fills keys/slots/waits per u; returns the u of every miss."""
    misses = []
    for e, u in exact.items():
        key = position * cfg.n_experts + e
        keys[u] = key
        t.use_count[key] += 1
        t.bump(position, "uses")
        slot = t.slot_of[key]
        if slot >= 0:
            slots[u] = slot
            t.last_use[slot] = now
            if t.prefetched_at[slot] >= 0:
                t.bump(position, "prefetched")
                t.bump(position, "lead_sum", now - t.prefetched_at[slot])
                t.prefetched_at[slot] = -1
            else:
                t.bump(position, "hit")
        elif t.inflight_of[key] >= 0:
            j = t.inflight_of[key]
            t.bump(position, "late")
            if cfg.wait_late:  # read its slot once the fill lands (await_fills); keep the fill going
                waits[u], slots[u] = j, t.e_slot[j]
                t.e_deadline[j] = max(t.e_deadline[j], now + 1)  # a fill for a later step keeps its own clock
                t.last_use[t.e_slot[j]] = now
            else:
                t.bump(position, "zero_copy")
            t.e_made[j] = -1  # served: on landing it is no unused prefetch
        else:
            t.bump(position, "miss")
            t.bump(position, "zero_copy")
            misses.append(u)
    return misses


def _admit_misses(t: _Lists, cfg: ResidencyConfig, position: int, now: int, step_base: int, misses: list[int],
                  keys: list[int], dsts: list[int]) -> None:
    """Each miss, as far as victims last, is written into a victim slot by the expert kernel as it streams. With
    `bypass`, a miss less likely to be needed soon than its victim's expert (`TableState.reuse`, a predictor's) is
    only read in place: the victim stays (the queue has moved past it for this step)."""
    reuse = t.st.reuse.tolist() if cfg.bypass else None
    for u, slot in zip(misses, _pop_victims(t, len(misses), now, step_base)):
        key = keys[u]
        old = t.key_of[slot]
        if reuse is not None and old >= 0 and reuse[key] < reuse[old]:
            continue
        _evict(t, cfg, slot)
        t.key_of[slot] = key
        t.slot_state[slot] = FILLING
        t.last_use[slot] = now
        t.inflight_of[key] = ADMITTING
        dsts[u] = slot
        t.adm_key[u], t.adm_slot[u] = key, slot
        t.bump(position, "admitted")


def plan_layer(
    st: TableState,
    cfg: ResidencyConfig,
    position: int,
    ids_x: torch.Tensor,
    act_x: torch.Tensor,
    ids_s: torch.Tensor | None,
    act_s: torch.Tensor | None,
    assign: torch.Tensor,
    u_key: torch.Tensor,
    u_slot: torch.Tensor,
    u_dst: torch.Tensor,
    reserve: bool,
    count_recall: bool,
    trace: torch.Tensor | None = None,
    u_wait: torch.Tensor | None = None,
) -> None:
    """One MoE layer's plan. ids_x [NX, k] exact rows, ids_s [NS, k] shadow rows (or None), act_* [rows] bool.
    Writes assign [NX + NS, k] and u_key / u_slot / u_dst [U] (see kernels/experts.py) and updates the table."""
    t = _Lists(st)
    e_count = cfg.n_experts
    step, dstep = int(st.step[0]), int(st.decode_step[0])
    now = 2 * step * cfg.positions - 1 if position < 0 else 2 * (step * cfg.positions + position)
    step_base = int(st.step_base[0])
    st.progress.fill_(now)
    _publish(t, cfg)

    nx, k = ids_x.shape
    out_assign = [[-1] * k for _ in range(assign.shape[0])]
    keys, slots, dsts = [-1] * u_key.shape[0], [-1] * u_key.shape[0], [-1] * u_key.shape[0]
    waits = [-1] * u_key.shape[0]
    exact: dict[int, int] = {}  # expert -> u, first-use order
    rows, active = ids_x.tolist(), act_x.tolist()
    for r in range(nx):
        if active[r]:
            for j, e in enumerate(rows[r]):
                if e >= 0:  # < 0: another rank's expert (expert parallelism)
                    out_assign[r][j] = exact.setdefault(e, len(exact))

    reads_before = t.counters[position][C["zero_copy"]] if position >= 0 else 0
    misses = _classify_exact(t, cfg, position, now, exact, keys, slots, waits)
    if cfg.fill_idle_link and position >= 0:  # the layer's host reads, which yielding fills wait for
        st.demand.fill_(t.counters[position][C["zero_copy"]] - reads_before)
    if reserve:  # live predictions protect their experts before any victim is chosen
        _window(t, cfg, position, step, dstep)
    _admit_misses(t, cfg, position, now, step_base, misses, keys, dsts)

    if ids_s is not None and act_s is not None:
        _shadow_rows(t, position * e_count, ids_s.tolist(), act_s.tolist(), nx, exact, out_assign, keys, slots,
                     now)

    if count_recall and position < cfg.main_positions:
        conf = st.pred[dstep % cfg.ring, position].tolist()
        predicted = {e for e, c in enumerate(conf) if c > 0 and c >= cfg.min_confidence}
        t.bump(position, "predicted", len(predicted))
        t.bump(position, "truth", len(exact))
        t.bump(position, "predicted_correct", len(predicted & set(exact)))
    if trace is not None and exact:
        trace[dstep, position, list(exact)] = True

    if reserve and cfg.fills:  # else the window protected above is all it would do
        _reserve(t, cfg, position, now, step_base, step, dstep)
    _order(t, cfg, position + 1)
    t.write_back()
    if assign.numel():
        assign.copy_(torch.tensor(out_assign, dtype=torch.int32))
    u_key.copy_(torch.tensor(keys, dtype=torch.int32))
    if u_wait is not None:
        u_wait.copy_(torch.tensor(waits, dtype=torch.int32))
    u_slot.copy_(torch.tensor(slots, dtype=torch.int32))
    u_dst.copy_(torch.tensor(dsts, dtype=torch.int32))


def _shadow_rows(t: _Lists, key_base: int, rows: list[list[int]], active: list[bool], offset: int,
                 exact: dict[int, int], out_assign: list[list[int]], keys: list[int], slots: list[int],
                 now: int) -> None:
    """Shadow rows share the exact rows' experts and use other experts only where they are published. A slot a
    shadow row reads counts as used this step, so no fill of this step can overwrite it while it is read."""
    extra: dict[int, int] = {}
    for r, row in enumerate(rows):
        if not active[r]:
            continue
        for j, e in enumerate(row):
            if e < 0:
                continue
            if e in exact:
                out_assign[offset + r][j] = exact[e]
                continue
            if e not in extra:
                slot = t.slot_of[key_base + e]
                if slot < 0:
                    continue
                u = len(exact) + len(extra)
                extra[e] = u
                keys[u], slots[u] = key_base + e, slot
                t.last_use[slot] = now
            out_assign[offset + r][j] = extra[e]


def _window(t: _Lists, cfg: ResidencyConfig, position: int, step: int,
            dstep: int) -> list[tuple[int, int, int, int, float]]:
    """The prediction window after `position` (the rest of this step, then the next `ring - 1` steps: one for every
    predictor but the oracle, which looks `lookahead` steps ahead), in deadline order: protects every predicted expert
    that is resident until its need, and returns the missing ones as (ring row, position, key, deadline,
    confidence), each key once (its earliest need)."""
    e_count, p_count = cfg.n_experts, cfg.positions
    candidates: list[tuple[int, int, int, int, float]] = []  # (ring row, position, key, deadline, conf), in order
    seen: set[int] = set()
    ring = t.pred[: cfg.ring, : cfg.main_positions]
    predicted = (ring > 0) & (ring >= cfg.min_confidence)
    # sparse: visit predicted cells only (nonzero and the mask's values share the row-major order)
    cells = [(*cell, conf) for cell, conf in zip(predicted.nonzero().tolist(), ring[predicted].tolist())]
    # deadline order: steps ahead (ring rows from the current one), then position, then expert
    by_row: dict[int, list[tuple[int, int, int, float]]] = {}
    for cell in cells:
        by_row.setdefault(cell[0], []).append(cell)
    ordered = [cell for offset in range(cfg.ring) for cell in by_row.get((dstep + offset) % cfg.ring, ())]
    for ring_row, q, e, conf in ordered:
        offset = (ring_row - dstep) % cfg.ring
        if offset == 0 and q <= position:
            continue
        deadline = 2 * ((step + offset) * p_count + q)
        key = q * e_count + e
        slot = t.slot_of[key]
        if slot >= 0:
            t.protect[slot] = max(t.protect[slot], deadline)
        elif t.inflight_of[key] == NO_ENTRY and key not in seen:
            seen.add(key)
            candidates.append((ring_row, q, key, deadline, conf))
    return candidates


def _reserve(t: _Lists, cfg: ResidencyConfig, position: int, now: int, step_base: int, step: int,
             dstep: int) -> None:
    """Prefetch reservation: fills for the window's missing experts whose need is within the lead and whose
    confidence reaches the fill cut (`fill_confidence`: a fill costs link bytes, protection none), within the
    per-target budget and the cap on fills in flight, victims permitting. The whole window still protects its
    resident experts. Why a lead: a fill holds its slot from its reservation to its need, and its victim is picked
    from what is known at the reservation. The oracle on a random 26-MoE-layer model at 12 % cached (CPU counts,
    BENCHMARKS "When a fill is reserved") moved 3.93 experts per token with no lead, 3.10 / 2.94 / 2.87 with leads
    of 8 / 4 / 2 MoE layers (Belady: 2.27)."""
    candidates = _window(t, cfg, position, step, dstep)
    per_row: dict[tuple[int, int], int] = {}
    chosen = []
    for ring_row, q, key, deadline, conf in candidates:
        if deadline - now > cfg.lead_clock or conf < cfg.fill_cut:
            continue
        used = t.fills_for[ring_row][q] + per_row.get((ring_row, q), 0)
        if used < cfg.budget_per_target:
            per_row[(ring_row, q)] = per_row.get((ring_row, q), 0) + 1
            chosen.append((ring_row, q, key, deadline))
    active = sum(1 for s in t.e_state if s == E_ACTIVE)
    free_entries = [j for j, s in enumerate(t.e_state) if s == E_FREE]
    room = max(min(cfg.max_inflight - active, len(free_entries)), 0)
    chosen = chosen[:room]
    victims = _pop_victims(t, len(chosen), now, step_base, _warm_from(cfg, step_base))
    for (ring_row, q, key, deadline), slot, j in zip(chosen, victims, free_entries):
        _evict(t, cfg, slot)
        t.key_of[slot] = key
        t.slot_state[slot] = FILLING
        t.protect[slot] = deadline
        t.last_use[slot] = now
        t.inflight_of[key] = j
        t.e_state[j], t.e_key[j], t.e_slot[j] = E_ACTIVE, key, slot
        t.e_deadline[j], t.e_made[j] = deadline, now
        t.e_next[j] = t.e_done[j] = t.e_ready[j] = 0
        t.fills_for[ring_row][q] += 1
        t.bump(q, "prefetch_issued")


def _warm_from(cfg: ResidencyConfig, step_base: int) -> int | None:
    """The clock from which a held expert is too recent to make room for a prefetch (None: no limit; misses are
    never limited). On a cache barely larger than a step's experts, a prefetch that evicts the last step's experts
    mostly evicts experts that the next steps miss again: on the reference model at 25 % cached, sparing them cut
    the experts mtp+next_layer_gate moved per token from 12.6 to 8.3 for 10 % more misses (BENCHMARKS.md)."""
    return step_base - cfg.steps_clock * cfg.spare_recent if cfg.spare_recent > 0 else None


def _order(t: _Lists, cfg: ResidencyConfig, launch: int) -> None:
    """Unfinished fills by deadline, for the fill launch that follows this plan."""
    live = sorted((t.e_deadline[j], j) for j, s in enumerate(t.e_state) if s == E_ACTIVE and t.e_next[j] < cfg.chunks)
    row = [j for _, j in live] + [-1] * (cfg.entries - len(live))
    t.st.order[launch].copy_(torch.tensor(row, dtype=torch.int32))


# ---- step boundaries ---------------------------------------------------------------------------------------------


def step_start(st: TableState, cfg: ResidencyConfig, decode: bool, next_use: torch.Tensor | None = None) -> None:
    """Open a step (no fill kernel is running): count the step, publish landed fills, release fills whose need has
    passed, recycle published entries, clear the ring row that the new step makes available, and sort the victims."""
    t = _Lists(st)
    step = int(st.step[0]) + 1
    st.step.fill_(step)
    st.demand.zero_()
    if decode:
        st.decode_step.add_(1)
    now = 2 * step * cfg.positions - 1
    st.step_base.fill_(now)
    st.progress.fill_(now)
    _publish(t, cfg)
    for j, state in enumerate(t.e_state):
        if state == E_ACTIVE and t.e_deadline[j] <= now:
            _release_fill(t, cfg, j)
        elif state == E_DONE:
            t.e_state[j] = E_FREE
    if decode:
        stale = (int(st.decode_step[0]) + cfg.ring - 1) % cfg.ring
        st.pred[stale].zero_()
        t.fills_for[stale] = [0] * cfg.positions
    t.cursor = 0
    t.write_back()
    rank_victims(st, cfg, next_use)


def rank_victims(st: TableState, cfg: ResidencyConfig, next_use: torch.Tensor | None = None) -> None:
    """The step start's last part, shared by the reference and the kernel path (torch ops, capturable): fold the
    last step's uses into the routing history, then sort the eviction queue for the step."""
    age_frequencies(st, cfg)
    st.victims.copy_(victim_order(st, cfg, next_use))


def _release_fill(t: _Lists, cfg: ResidencyConfig, j: int) -> None:
    """An unfinished fill gives its slot back (free); unless its need was served late, it was a wasted prefetch."""
    key, slot = t.e_key[j], t.e_slot[j]
    t.slot_state[slot], t.key_of[slot] = FREE, -1
    t.last_use[slot] = t.protect[slot] = t.prefetched_at[slot] = -1
    t.inflight_of[key] = NO_ENTRY
    t.e_state[j] = E_FREE
    if t.e_made[j] >= 0:  # a fill whose need was served late (from host) is counted as late, not wasted
        t.bump(key // cfg.n_experts, "prefetch_wasted")
    t.bump(key // cfg.n_experts, "fill_chunks", t.e_done[j])


def age_frequencies(st: TableState, cfg: ResidencyConfig) -> None:
    """LRFU's ranks: fold the uses since the last step start into each key's frequency, after decaying it by one
    step (torch ops, capturable). Unlike LFU's counts, old popularity fades: on random routing counts that never age
    keep yesterday's experts and miss today's. Aged under every policy (two element-wise ops per step), so that a
    switch to LRFU between calls starts from the right history."""
    st.frequency.mul_(0.5 ** (1.0 / cfg.frequency_halflife)).add_(st.use_count - st.counted)
    st.counted.copy_(st.use_count)


def victim_order(st: TableState, cfg: ResidencyConfig, next_use: torch.Tensor | None = None) -> torch.Tensor:
    """Slots in eviction order (torch ops, so the same code runs captured on the GPU): free slots first, then LRU,
    LFU or LRFU order, or, when the future is known (`next_use` [steps, keys]: the decode step of each key's next
    need, from an oracle trace), Belady's order: the expert needed farthest in the future first. Filling slots and
    the static hot set come last (they are also skipped when popped)."""
    last = st.last_use.clamp(min=-1) + 1  # 0 .. < 2^40
    held = st.key_of.clamp(min=0).long()
    if next_use is not None:
        step = st.decode_step.clamp(min=0, max=next_use.shape[0] - 1)
        order_key = -next_use.index_select(0, step)[0][held]  # never needed again: farthest of all
    elif POLICY_CODES[cfg.policy] == 1:
        order_key = st.use_count[held].long() * (1 << 40) + last
    elif POLICY_CODES[cfg.policy] == 2:  # frequency in steps of 1/1024 up to 512 (< FAR), ties by recency
        order_key = (st.frequency[held] * 1024).long().clamp(max=(1 << 19) - 1) * (1 << 40) + last
    else:
        order_key = last
    if next_use is None and cfg.reuse_weight > 0:
        order_key = _blend_reuse(order_key, st.reuse[held], cfg.reuse_weight)
    order_key = torch.where(st.slot_state == FREE, torch.full_like(order_key, -FAR), order_key)
    blocked = (st.slot_state == FILLING) | ((st.key_of >= 0) & (st.pinned[held] > 0))
    order_key = torch.where(blocked, torch.full_like(order_key, FAR), order_key)
    return torch.sort(order_key, stable=True).indices.to(torch.int32)


REUSE_LEVELS = 1 << 20  # the blended key's resolution (integer keys keep the sort exact on every device)


def _blend_reuse(policy_key: torch.Tensor, reuse: torch.Tensor, weight: float) -> torch.Tensor:
    """Victim keys from a predictor's reuse probabilities and the policy's order: w x P(needed soon) + (1 - w) x the
    slot's rank in the policy's order (scaled to [0, 1]), lowest first. Ranks, not the policy's raw keys, so that one
    weight means the same under LRU, LFU and LRFU. Without predictions (reuse 0 everywhere) the policy's order is
    kept exactly. On the deep model's held-out text at 518 slots (experiments/learned_victims.py, 8,192 tokens in
    one warm cache) w = 0.9 cut LRFU's misses by 12.5 %, as far as protecting what the next token needs does; on the
    bench's 64-token generation after a 64-token prompt it did not (BENCHMARKS), hence off by default."""
    slots = policy_key.numel()
    rank = torch.empty_like(policy_key)
    rank[torch.sort(policy_key, stable=True).indices] = torch.arange(slots, device=policy_key.device,
                                                                     dtype=policy_key.dtype)
    score = weight * reuse.clamp(0, 1) + (1 - weight) * rank.float() / max(slots - 1, 1)
    # ties (equal scores) keep the policy's order
    return (score * REUSE_LEVELS).long() * slots + rank


def step_end(st: TableState, cfg: ResidencyConfig) -> None:
    """Close a step: fills stop claiming chunks (the next step's first plan will resume them)."""
    st.progress.copy_(st.step * (2 * cfg.positions) + (2 * cfg.positions - 1))


def next_use_table(trace: torch.Tensor, out: torch.Tensor) -> None:
    """trace [steps, P, E] (1 = needed) -> out [steps, P * E]: the first decode step at or after each step at which
    each key is needed (FAR when never again), for Belady's victims."""
    steps = trace.shape[0]
    flat = trace.reshape(steps, -1) > 0
    index = torch.arange(steps, device=trace.device, dtype=torch.int64)[:, None].expand_as(flat)
    when = torch.where(flat, index, torch.full_like(index, FAR))
    out.copy_(when.flip(0).cummin(0).values.flip(0))


def finish_call(st: TableState, cfg: ResidencyConfig) -> None:
    """End of a generate call (all streams idle): unfinished fills are released, prefetches never used count as
    wasted, and predictions and protections are forgotten so the next call starts clean."""
    t = _Lists(st)
    _publish(t, cfg)
    for j, state in enumerate(t.e_state):
        if state == E_ACTIVE:
            _release_fill(t, cfg, j)
        elif state == E_DONE:
            t.e_state[j] = E_FREE
    for slot, made in enumerate(t.prefetched_at):
        if made >= 0:
            t.bump(t.key_of[slot] // cfg.n_experts, "prefetch_wasted")
            t.prefetched_at[slot] = -1
    t.protect = [-1] * cfg.n_slots
    t.fills_for = [[0] * cfg.positions for _ in t.fills_for]
    t.write_back()
    st.pred.zero_()
    st.reuse.zero_()
    st.order.fill_(-1)
