"""The residency plan as one single-program Triton kernel per MoE layer (and one per step start).

`residency/plan.py` defines what a plan does, in plain Python; this kernel does the same with vector phases, so a
whole layer's bookkeeping costs one launch inside the step's CUDA graph and no host decision:

- publish: landed fills and the previous plan's admissions become resident;
- the exact rows' distinct experts in first-use order (pairwise comparison of the k-entries): hit / late / miss,
  recency, prefetch usefulness, and victims for the misses, popped in windows from the step's eviction queue;
- the shadow rows' experts (published ones only);
- counters and the recall of this target's predictions;
- prefetch reservation over the prediction window (rank within a target, then across targets in deadline order);
- the deadline-sorted list of unfinished fills for the next fill launch.

Phases communicate through global memory, separated by block-wide barriers.
"""

from __future__ import annotations

import torch

from .state import (ADMITTING, C, COUNTERS, E_ACTIVE, E_DONE, E_FREE, FILLING, NO_ENTRY, RESIDENT,
                               ResidencyConfig, TableState)
from ..kernels import HAS_TRITON, Launch
from .plan import plan_layer, rank_victims, step_start as reference_step_start

if HAS_TRITON:
    import triton
    import triton.language as tl

VICTIM_WINDOW = 128
# cells of the prediction window one block of the reservation holds (a power of two, so blocks hold whole expert
# rows). Compiled for sm_90 (ptxas, SASS counts; before compile_check marked pointers aligned): the whole window of a
# 48-layer, 128-expert model over 2 steps in one block spilled (870 local loads, 626 stores; 11,463 and 7,573 over 3
# steps); blocks of 4,096 cells 54 and 29; blocks of 2,048 none, at 48 layers and on V2-Lite's shape (and none with
# the aligned compile: `python scripts/compile_check.py --plan-spills`)
WINDOW_CELLS = 2048
# the plan kernel's runtime integer arguments (see the note at `_plan_kernel`)
PLAN_RUNTIME_INTS = ("nx", "ns", "position", "S", "CHUNKS", "BUDGET", "MAX_INFLIGHT", "SPARE", "LEAD", "R", "SHADOW",
                     "RESERVE", "FILLS", "RECALL", "TRACE")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


if HAS_TRITON:

    @triton.jit
    def _count(mask):
        return tl.sum(mask.to(tl.int32), axis=0)

    @triton.jit
    def _count2(mask):
        return tl.sum(tl.sum(mask.to(tl.int32), axis=1), axis=0)

    @triton.jit
    def _exclusive_cumsum(mask):
        m = mask.to(tl.int32)
        return tl.cumsum(m, axis=0) - m

    @triton.jit
    def _bump(counters_ptr, position, COLUMN: tl.constexpr, amount, NC: tl.constexpr):
        tl.store(counters_ptr + position * NC + COLUMN, tl.load(counters_ptr + position * NC + COLUMN) + amount)

    @triton.jit
    def _publish(slot_of, slot_state, prefetched_at, inflight_of, e_state, e_key, e_slot, e_made, e_ready,
                 adm_key, adm_slot, counters, E: tl.constexpr, M: tl.constexpr, A: tl.constexpr,
                 A_PAD: tl.constexpr, NC: tl.constexpr, C_FILLS: tl.constexpr, C_CHUNKS: tl.constexpr, CHUNKS):
        jm = tl.arange(0, M)
        ready = tl.atomic_add(e_ready + jm, 0, sem="acquire")
        pub = (tl.load(e_state + jm) == 1) & (ready == 1)  # E_ACTIVE
        key = tl.load(e_key + jm, mask=pub, other=0)
        slot = tl.load(e_slot + jm, mask=pub, other=0)
        tl.store(slot_of + key, slot, mask=pub)
        tl.store(slot_state + slot, 1, mask=pub)  # RESIDENT
        tl.store(prefetched_at + slot, tl.load(e_made + jm, mask=pub, other=-1), mask=pub)
        tl.store(inflight_of + key, -1, mask=pub)  # NO_ENTRY
        tl.store(e_state + jm, 2, mask=pub)  # E_DONE
        tl.atomic_add(counters + (key // E) * NC + C_FILLS, 1, mask=pub)
        tl.atomic_add(counters + (key // E) * NC + C_CHUNKS, CHUNKS, mask=pub)
        a = tl.arange(0, A_PAD)
        akey = tl.load(adm_key + a, mask=a < A, other=-1)
        on = akey >= 0
        aslot = tl.load(adm_slot + a, mask=on, other=0)
        tl.store(slot_of + akey, aslot, mask=on)
        tl.store(slot_state + aslot, 1, mask=on)
        tl.store(inflight_of + akey, -1, mask=on)
        tl.store(adm_key + a, -1, mask=on)

    @triton.jit
    def _pop_victims(count, now, step_base, warm_from, victims, cursor_ptr, key_of, slot_state, protect, last_use,
                     pinned, scratch, S, WIN: tl.constexpr):
        """Up to `count` eligible victims from the eviction queue, written to scratch[0:taken]; returns taken. The
        pop stops at the first held slot used at or after `warm_from` (see residency/plan.py `_pop_victims`)."""
        cursor = tl.load(cursor_ptr)
        taken = count * 0
        blocked = count * 0
        lanes = tl.arange(0, WIN)
        while (taken < count) & (cursor < S) & (blocked == 0):
            w = cursor + lanes
            inside = w < S
            v = tl.load(victims + w, mask=inside, other=0)
            held = tl.load(key_of + v, mask=inside, other=-1)
            pin = tl.load(pinned + tl.maximum(held, 0), mask=inside & (held >= 0), other=0)
            state = tl.load(slot_state + v, mask=inside, other=2)
            used = tl.load(last_use + v, mask=inside, other=0)
            stop = tl.min(tl.where(inside & (state != 0) & (used >= warm_from), lanes, WIN), axis=0)
            ok = inside & (lanes < stop) & (state != 2) & (pin == 0)
            ok = ok & (tl.load(protect + v, mask=inside, other=0) < now)
            ok = ok & (used < step_base)
            rank = taken + _exclusive_cumsum(ok)
            take = ok & (rank < count)
            tl.store(scratch + rank, v, mask=take)
            got = _count(take)
            last = tl.max(tl.where(take, w, -1), axis=0)
            taken += got
            blocked = (stop < WIN).to(tl.int32)
            cursor = tl.where((taken == count) & (got > 0), last + 1, cursor + stop)
        tl.store(cursor_ptr, tl.minimum(cursor, S))
        return taken

    @triton.jit
    def _evict(v, on, slot_of, key_of, prefetched_at, counters, E: tl.constexpr, NC: tl.constexpr,
               C_EVICT: tl.constexpr, C_WASTED: tl.constexpr):
        old = tl.load(key_of + v, mask=on, other=-1)
        had = on & (old >= 0)
        tl.store(slot_of + old, -1, mask=had)
        tl.atomic_add(counters + (old // E) * NC + C_EVICT, 1, mask=had)
        unused = had & (tl.load(prefetched_at + v, mask=had, other=-1) >= 0)
        tl.atomic_add(counters + (old // E) * NC + C_WASTED, 1, mask=unused)
        tl.store(prefetched_at + v, -1, mask=on)

    @triton.jit
    def _window_cells(start, position, step, dstep, pred, slot_of, P: tl.constexpr, P_MAIN: tl.constexpr,
                      E: tl.constexpr, E_PAD: tl.constexpr, R, RB: tl.constexpr, MIN_CONF):
        """Rows start .. start + RB - 1 of the prediction window after `position` as a [rows, experts] block: rows
        (rest of this step, then the next R - 1 steps) in deadline order. The window goes through in blocks of RB
        rows: one block of every row spills registers on long models (48 layers x 128 experts x 2 steps)."""
        rows = start + tl.arange(0, RB)
        off = rows // P_MAIN
        q = rows % P_MAIN
        row_ok = (rows < R * P_MAIN) & ((off > 0) | (q > position))
        ring_row = (dstep + off) % R
        deadline = 2 * ((step + off) * P + q)
        e2 = tl.arange(0, E_PAD)
        cell_ok = row_ok[:, None] & (e2[None, :] < E)
        conf = tl.load(pred + (ring_row[:, None] * P + q[:, None]) * E + e2[None, :], mask=cell_ok, other=0.0)
        cand = cell_ok & (conf > 0) & (conf >= MIN_CONF)
        rkey = q[:, None] * E + e2[None, :]
        rslot = tl.load(slot_of + rkey, mask=cand, other=-1)
        return rows, off, q, row_ok, ring_row, deadline, e2, cell_ok, cand, rkey, rslot, conf

    @triton.jit
    def _protect_window(position, step, dstep, pred, slot_of, protect, P: tl.constexpr, P_MAIN: tl.constexpr,
                        E: tl.constexpr, E_PAD: tl.constexpr, R, ROWS_PAD: tl.constexpr, RB: tl.constexpr, MIN_CONF):
        for start in range(0, ROWS_PAD, RB):
            rows, off, q, row_ok, ring_row, deadline, e2, cell_ok, cand, rkey, rslot, conf = _window_cells(
                start, position, step, dstep, pred, slot_of, P, P_MAIN, E, E_PAD, R, RB, MIN_CONF)
            tl.atomic_max(protect + rslot, deadline[:, None] + e2[None, :] * 0, mask=cand & (rslot >= 0))

    @triton.jit
    def _distinct(e, valid, idx, PAD: tl.constexpr):
        """Entries e (with `valid`) -> (first use of each distinct value, each entry's rank among the distinct
        values in first-use order)."""
        same = (e[:, None] == e[None, :]) & valid[:, None] & valid[None, :]
        first = valid & ~(tl.max((same & (idx[None, :] < idx[:, None])).to(tl.int32), axis=1) > 0)
        first_at = tl.min(tl.where(same, idx[None, :], PAD), axis=1)  # index of each entry's first use
        rank = tl.sum((first[None, :] & (idx[None, :] < first_at[:, None])).to(tl.int32), axis=1)
        return first, rank

    @triton.jit
    def _exact_rows(ids_x, act_x, nx, position, now, assign, u_key, u_slot, u_dst, u_wait, slot_of, last_use,
                    prefetched_at, use_count, inflight_of, e_made, e_slot, e_deadline, counters, E: tl.constexpr,
                    K: tl.constexpr, XK_PAD: tl.constexpr, NC: tl.constexpr, WAIT: tl.constexpr):
        """The exact rows' distinct experts: hit / late / miss, recency, prefetch usefulness, counters. With WAIT,
        a late expert gets its fill's slot and entry (the await launch decides) and its fill stays first in line."""
        ix = tl.arange(0, XK_PAD)
        inside = ix < nx * K
        ex = tl.load(ids_x + ix, mask=inside, other=0).to(tl.int32)
        # an entry < 0 is another rank's expert (expert parallelism): not planned here
        on_x = inside & (tl.load(act_x + ix // K, mask=inside, other=0) != 0) & (ex >= 0)
        first, u_of = _distinct(ex, on_x, ix, XK_PAD)
        u_first = _exclusive_cumsum(first)
        tl.store(assign + ix, tl.where(on_x, u_of, -1), mask=inside)
        key = position * E + ex
        slot = tl.load(slot_of + key, mask=first, other=-1)
        infl = tl.load(inflight_of + key, mask=first, other=-1)
        hit = first & (slot >= 0)
        made = tl.load(prefetched_at + slot, mask=hit, other=-1)
        was_prefetch = hit & (made >= 0)
        late = first & (slot < 0) & (infl >= 0)
        miss = first & (slot < 0) & (infl < 0)
        tl.store(u_key + u_first, key, mask=first)
        if WAIT:
            fill_slot = tl.load(e_slot + infl, mask=late, other=-1)
            tl.store(u_slot + u_first, tl.where(late, fill_slot, slot), mask=first)
            tl.store(u_wait + u_first, tl.where(late, infl, -1), mask=first)
            need = tl.load(e_deadline + infl, mask=late, other=0)  # a fill for a later step keeps its own clock
            tl.store(e_deadline + infl, tl.maximum(need, now + 1), mask=late)
            tl.store(last_use + fill_slot, now, mask=late)
        else:
            tl.store(u_slot + u_first, slot, mask=first)
        tl.store(u_dst + u_first, -1, mask=first)
        tl.store(last_use + slot, now, mask=hit)
        tl.store(prefetched_at + slot, -1, mask=was_prefetch)
        tl.store(use_count + key, tl.load(use_count + key, mask=first, other=0) + 1, mask=first)
        tl.store(e_made + infl, -1, mask=late)  # served late: on landing it is no unused prefetch
        _bump(counters, position, 0, _count(first), NC)  # uses
        _bump(counters, position, 1, _count(hit & ~was_prefetch), NC)  # hit
        _bump(counters, position, 2, _count(was_prefetch), NC)  # prefetched
        _bump(counters, position, 3, _count(late), NC)  # late
        _bump(counters, position, 4, _count(miss), NC)  # miss
        if WAIT:
            _bump(counters, position, 5, _count(miss), NC)  # zero_copy (a late one is counted if its wait fails)
        else:
            _bump(counters, position, 5, _count(late | miss), NC)  # zero_copy
        _bump(counters, position, 9, tl.sum(tl.where(was_prefetch, now - made, 0), axis=0), NC)  # lead_sum
        if WAIT:  # the experts this layer reads from host memory (a waited-for late one is a fill's)
            reads = _count(miss)
        else:
            reads = _count(late | miss)
        return ex, first, u_first, key, miss, reads

    @triton.jit
    def _admit(key, miss, u_first, position, now, step_base, u_dst, adm_key, adm_slot, slot_of, key_of,
               slot_state, last_use, protect, prefetched_at, pinned, inflight_of, victims, cursor_ptr, scratch,
               counters, reuse, S, E: tl.constexpr, WIN: tl.constexpr, NC: tl.constexpr, BYPASS: tl.constexpr):
        """Victims for the misses: each admitted miss is written into its victim slot by the expert kernel. With
        BYPASS, a miss less likely to be needed soon than its victim's expert (`reuse`) is only read: the victim
        stays."""
        taken = _pop_victims(_count(miss), now, step_base, now + 1, victims, cursor_ptr, key_of, slot_state,
                             protect, last_use, pinned, scratch, S, WIN)
        tl.debug_barrier()
        miss_rank = _exclusive_cumsum(miss)
        admit = miss & (miss_rank < taken)
        v = tl.load(scratch + miss_rank, mask=admit, other=0)
        if BYPASS:
            old = tl.load(key_of + v, mask=admit, other=-1)
            kept = admit & (old >= 0)
            r_old = tl.load(reuse + tl.maximum(old, 0), mask=kept, other=0.0)
            r_miss = tl.load(reuse + key, mask=kept, other=0.0)
            admit = admit & ~(kept & (r_miss < r_old))
        _evict(v, admit, slot_of, key_of, prefetched_at, counters, E, NC, 6, 8)
        tl.store(key_of + v, key, mask=admit)
        tl.store(slot_state + v, 2, mask=admit)  # FILLING
        tl.store(last_use + v, now, mask=admit)
        tl.store(inflight_of + key, -2, mask=admit)  # ADMITTING
        tl.store(u_dst + u_first, v, mask=admit)
        tl.store(adm_key + u_first, key, mask=admit)
        tl.store(adm_slot + u_first, v, mask=admit)
        _bump(counters, position, 15, _count(admit), NC)  # admitted

    @triton.jit
    def _score(ex, first, position, dstep, pred, counters, R, MIN_CONF, P: tl.constexpr, P_MAIN: tl.constexpr,
               E: tl.constexpr, E_PAD: tl.constexpr, NC: tl.constexpr):
        """Recall and precision of the predictions made for this (step, layer)."""
        if position < P_MAIN:
            row = pred + ((dstep % R) * P + position) * E
            e_all = tl.arange(0, E_PAD)
            conf = tl.load(row + e_all, mask=e_all < E, other=0.0)
            conf_x = tl.load(row + ex, mask=first, other=0.0)
            _bump(counters, position, 10, _count((conf > 0) & (conf >= MIN_CONF)), NC)  # predicted
            _bump(counters, position, 11, _count(first), NC)  # truth
            _bump(counters, position, 12, _count(first & (conf_x > 0) & (conf_x >= MIN_CONF)), NC)  # correct

    @triton.jit
    def _shadow_rows(ids_s, act_s, ns, nx, position, now, ex, first, u_first, assign, u_key, u_slot, u_dst,
                     slot_of, last_use, E: tl.constexpr, K: tl.constexpr, SK_PAD: tl.constexpr):
        """Shadow rows share the exact rows' experts and use other experts only where they are published; a slot
        they read counts as used this step, so no fill of this step can overwrite it while it is read."""
        js = tl.arange(0, SK_PAD)
        inside_s = js < ns * K
        es = tl.load(ids_s + js, mask=inside_s, other=0).to(tl.int32)
        on_s = inside_s & (tl.load(act_s + js // K, mask=inside_s, other=0) != 0) & (es >= 0)
        match = (es[:, None] == ex[None, :]) & first[None, :] & on_s[:, None]
        in_exact = tl.max(match.to(tl.int32), axis=1) > 0
        u_exact = tl.sum(tl.where(match, u_first[None, :], 0), axis=1)
        skey = position * E + es
        sslot = tl.load(slot_of + skey, mask=on_s & ~in_exact, other=-1)
        avail = on_s & ~in_exact & (sslot >= 0)
        first_s, rank_s = _distinct(es, avail, js, SK_PAD)
        u_s = _count(first) + rank_s
        tl.store(assign + nx * K + js, tl.where(in_exact, u_exact, tl.where(avail, u_s, -1)), mask=inside_s)
        tl.store(u_key + u_s, skey, mask=first_s)
        tl.store(u_slot + u_s, sslot, mask=first_s)
        tl.store(u_dst + u_s, -1, mask=first_s)
        tl.store(last_use + sslot, now, mask=first_s)

    @triton.jit
    def _wanted(start, position, step, dstep, now, pred, slot_of, inflight_of, fills_for, BUDGET, MIN_CONF, FILL_CONF,
                LEAD, R, P: tl.constexpr, P_MAIN: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
                RB: tl.constexpr):
        """A block of the window: the missing predicted experts within the lead (`LEAD`, a clock span) and at the
        fill cut (`FILL_CONF`) that each target's budget allows (`within`, each key at its earliest need only), their
        rank within their row, and the cells' addresses."""
        rows, off, q, row_ok, ring_row, deadline, e2, cell_ok, cand, rkey, rslot, conf = _window_cells(
            start, position, step, dstep, pred, slot_of, P, P_MAIN, E, E_PAD, R, RB, MIN_CONF)
        rinfl = tl.load(inflight_of + rkey, mask=cand, other=0)
        need = cand & (rslot < 0) & (rinfl == -1)
        # a key is fetched for its earliest need in the window only (not again for a later step)
        for back in range(1, R):
            earlier = tl.maximum(off - back, 0)
            inside = row_ok & (off >= back) & ((earlier > 0) | (q > position))
            conf_e = tl.load(pred + ((((dstep + earlier) % R) * P + q) * E)[:, None] + e2[None, :],
                             mask=cell_ok & inside[:, None], other=0.0)
            need = need & ~(inside[:, None] & (conf_e > 0) & (conf_e >= MIN_CONF))
        need = need & ((deadline - now) <= LEAD)[:, None] & (conf >= FILL_CONF)
        used = tl.load(fills_for + ring_row * P + q, mask=row_ok, other=0)
        in_row = tl.cumsum(need.to(tl.int32), axis=1) - need.to(tl.int32)
        within = need & ((used[:, None] + in_row) < BUDGET)
        return within, q, row_ok, ring_row, deadline, e2, rkey, rslot, cand

    @triton.jit
    def _reserve(position, step, dstep, now, step_base, pred, slot_of, key_of, slot_state, last_use, protect,
                 prefetched_at, pinned, inflight_of, e_state, e_key, e_slot, e_deadline, e_made, e_next, e_done,
                 e_ready, victims, cursor_ptr, fills_for, counters, scratch, scratch_e, S, BUDGET, MAX_INFLIGHT,
                 MIN_CONF, FILL_CONF, SPARE, LEAD, R, P: tl.constexpr, P_MAIN: tl.constexpr, E: tl.constexpr,
                 E_PAD: tl.constexpr, M: tl.constexpr, ROWS_PAD: tl.constexpr, RB: tl.constexpr, WIN: tl.constexpr,
                 NC: tl.constexpr):
        """Fills for the window's missing predicted experts: rank within a target (its budget), then across targets
        in deadline order (the cap in flight, free entries, victims). Two passes over the window's blocks: count
        the wanted fills, pop that many victims (at most), then hand them out in deadline order. A block's wants do
        not change between the passes: the victims are never experts the window protects.

        The window was protected before the misses' victims were chosen (`_protect_window`), and nothing since has
        given a key a slot (admissions publish at the next plan), so the passes only count and hand out. Each stops
        as soon as the rest cannot matter: the count once it reaches the room in flight, the hand-out once every
        victim is given (a plan whose fills are all in flight scans nothing). The window scans were the plan's
        largest cost with fills (H200 timeline, BENCHMARKS issue 36: 1.39 ms a token against 0.27 without)."""
        jm = tl.arange(0, M)
        states = tl.load(e_state + jm)
        free = states == 0  # E_FREE
        tl.store(scratch_e + _exclusive_cumsum(free), jm, mask=free)
        room = tl.maximum(tl.minimum(MAX_INFLIGHT - _count(states == 1), _count(free)), 0)
        total = room * 0
        start = 0
        while (start < ROWS_PAD) & (total < room):
            within, q, row_ok, ring_row, deadline, e2, rkey, rslot, cand = _wanted(
                start, position, step, dstep, now, pred, slot_of, inflight_of, fills_for, BUDGET, MIN_CONF,
                FILL_CONF, LEAD, R, P, P_MAIN, E, E_PAD, RB)
            total += _count2(within)
            start += RB
        tl.debug_barrier()
        warm_from = tl.where(SPARE > 0, step_base - 2 * P * SPARE, now + 1)
        got = _pop_victims(tl.minimum(total, room), now, step_base, warm_from, victims, cursor_ptr,
                           key_of, slot_state, protect, last_use, pinned, scratch, S, WIN)
        tl.debug_barrier()
        base = got * 0
        start = 0
        while (start < ROWS_PAD) & (base < got):
            within, q, row_ok, ring_row, deadline, e2, rkey, rslot, cand = _wanted(
                start, position, step, dstep, now, pred, slot_of, inflight_of, fills_for, BUDGET, MIN_CONF,
                FILL_CONF, LEAD, R, P, P_MAIN, E, E_PAD, RB)
            row_total = tl.sum(within.to(tl.int32), axis=1)
            in_rows = tl.cumsum(within.to(tl.int32), axis=1) - within.to(tl.int32)
            grank = base + (tl.cumsum(row_total, axis=0) - row_total)[:, None] + in_rows
            base += tl.sum(row_total, axis=0)
            go = within & (grank < got)
            rv = tl.load(scratch + grank, mask=go, other=0)
            rj = tl.load(scratch_e + grank, mask=go, other=0)
            _evict(rv, go, slot_of, key_of, prefetched_at, counters, E, NC, 6, 8)
            zero = e2[None, :] * 0
            tl.store(key_of + rv, rkey, mask=go)
            tl.store(slot_state + rv, 2, mask=go)  # FILLING
            tl.store(protect + rv, deadline[:, None] + zero, mask=go)
            tl.store(last_use + rv, now + zero, mask=go)
            tl.store(inflight_of + rkey, rj, mask=go)
            tl.store(e_key + rj, rkey, mask=go)
            tl.store(e_slot + rj, rv, mask=go)
            tl.store(e_deadline + rj, deadline[:, None] + zero, mask=go)
            tl.store(e_made + rj, now + zero, mask=go)
            tl.store(e_next + rj, 0, mask=go)
            tl.store(e_done + rj, 0, mask=go)  # a reused entry's counts restart: no early 'ready'
            tl.store(e_ready + rj, 0, mask=go)
            tl.store(e_state + rj, 1, mask=go)  # E_ACTIVE
            issued = tl.sum(go.to(tl.int32), axis=1)
            tl.atomic_add(fills_for + ring_row * P + q, issued, mask=row_ok)
            tl.atomic_add(counters + q * NC + 7, issued, mask=row_ok)  # prefetch_issued
            start += RB
            tl.debug_barrier()  # the next block reads fills_for and inflight_of after these writes

    @triton.jit
    def _write_order(order, e_state, e_next, e_deadline, position, CHUNKS, M: tl.constexpr):
        """Unfinished fills by deadline, for the fill launch that follows this plan."""
        jl = tl.arange(0, M)
        live = (tl.load(e_state + jl) == 1) & (tl.load(e_next + jl) < CHUNKS)
        sort_key = tl.where(live, tl.load(e_deadline + jl) * M + jl, 9223372036854775807)
        ordered = tl.sort(sort_key)
        tl.store(order + (position + 1) * M + jl, tl.where(ordered < 9223372036854775807, ordered % M, -1))

    @triton.jit
    def _words(words, S, P: tl.constexpr, E: tl.constexpr, M: tl.constexpr, A: tl.constexpr):
        """The int32 fields in `words`, in `state.PACKED`'s order (`counted` is skipped: no kernel reads it)."""
        slot_of = words
        use_count = slot_of + P * E
        pinned = use_count + 2 * P * E
        inflight_of = pinned + P * E
        e_state = inflight_of + P * E
        e_key = e_state + M
        e_slot = e_key + M
        e_next = e_slot + M
        e_done = e_next + M
        e_ready = e_done + M
        order = e_ready + M
        adm_key = order + (P + 1) * M
        adm_slot = adm_key + A
        cursor = adm_slot + A
        demand = cursor + 1
        key_of = demand + 1
        slot_state = key_of + S
        victims = slot_state + S
        fills_for = victims + S
        return (slot_of, use_count, pinned, inflight_of, e_state, e_key, e_slot, e_next, e_done, e_ready, order,
                adm_key, adm_slot, cursor, demand, key_of, slot_state, victims, fills_for)

    @triton.jit
    def _clocks(clocks, S, P: tl.constexpr, M: tl.constexpr, NC: tl.constexpr):
        """The int64 fields in `clocks`, in `state.PACKED`'s order."""
        e_deadline = clocks
        e_made = e_deadline + M
        counters = e_made + M
        step = counters + P * NC
        step_base = step + 1
        progress = step_base + 1
        decode_step = progress + 1
        last_use = decode_step + 1
        protect = last_use + S
        prefetched_at = protect + S
        return e_deadline, e_made, counters, step, step_base, progress, decode_step, last_use, protect, prefetched_at

    @triton.jit
    def _floats(floats, P: tl.constexpr, E: tl.constexpr):
        """`reuse` and `pred` in `floats` (after `frequency`, which only the step start's torch ops read)."""
        reuse = floats + P * E
        pred = reuse + P * E
        return reuse, pred

    # Runtime integers are not specialised: Triton would otherwise compile a variant for each flag and count that
    # equals 1 or is a multiple of 16 (layer positions, row counts, budgets), ~90 variants of this large kernel per
    # engine configuration, seconds each, on a user's first call and every device session's tests.
    @triton.jit(do_not_specialize=PLAN_RUNTIME_INTS)
    def _plan_kernel(
        # inputs of the layer
        ids_x, act_x, ids_s, act_s, nx, ns, position,
        # outputs for the expert kernel
        assign, u_key, u_slot, u_dst, u_wait,
        # the table's three buffers (`TableState.allocate`), then working memory
        words, clocks, floats, trace, scratch, scratch_e,
        # shapes and policy
        S, CHUNKS, BUDGET, MAX_INFLIGHT, MIN_CONF, FILL_CONF, SPARE, LEAD, R, SHADOW, RESERVE, FILLS, RECALL, TRACE,
        WAIT: tl.constexpr, IDLE: tl.constexpr, BYPASS: tl.constexpr,
        P: tl.constexpr, P_MAIN: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
        M: tl.constexpr, A: tl.constexpr, A_PAD: tl.constexpr, K: tl.constexpr, XK_PAD: tl.constexpr,
        SK_PAD: tl.constexpr, ROWS_PAD: tl.constexpr, RB: tl.constexpr, WIN: tl.constexpr, NC: tl.constexpr,
    ):
        (slot_of, use_count, pinned, inflight_of, e_state, e_key, e_slot, e_next, e_done, e_ready, order, adm_key,
         adm_slot, cursor_ptr, demand_ptr, key_of, slot_state, victims, fills_for) = _words(words, S, P, E, M, A)
        (e_deadline, e_made, counters, step_ptr, step_base_ptr, progress_ptr, dstep_ptr, last_use, protect,
         prefetched_at) = _clocks(clocks, S, P, M, NC)
        reuse, pred = _floats(floats, P, E)
        step = tl.load(step_ptr)
        dstep = tl.load(dstep_ptr)
        step_base = tl.load(step_base_ptr)
        now = tl.where(position < 0, 2 * step * P - 1, 2 * (step * P + position))  # -1: the step start
        tl.store(progress_ptr, now)
        ua = tl.arange(0, A_PAD)
        tl.store(u_key + ua, -1, mask=ua < A)
        tl.store(u_slot + ua, -1, mask=ua < A)
        tl.store(u_dst + ua, -1, mask=ua < A)
        if WAIT:
            tl.store(u_wait + ua, -1, mask=ua < A)
        _publish(slot_of, slot_state, prefetched_at, inflight_of, e_state, e_key, e_slot, e_made, e_ready, adm_key,
                 adm_slot, counters, E, M, A, A_PAD, NC, 13, 14, CHUNKS)
        tl.debug_barrier()
        ex, first, u_first, key, miss, reads = _exact_rows(ids_x, act_x, nx, position, now, assign, u_key, u_slot,
                                                           u_dst, u_wait, slot_of, last_use, prefetched_at,
                                                           use_count, inflight_of, e_made, e_slot, e_deadline,
                                                           counters, E, K, XK_PAD, NC, WAIT)
        if IDLE:  # fills for later layers give the link to this layer's host reads (cleared after its experts)
            tl.store(demand_ptr, reads)
        tl.debug_barrier()
        if RESERVE != 0:  # live predictions protect their resident experts before any victim is chosen
            _protect_window(position, step, dstep, pred, slot_of, protect, P, P_MAIN, E, E_PAD, R, ROWS_PAD, RB,
                            MIN_CONF)
            tl.debug_barrier()
        _admit(key, miss, u_first, position, now, step_base, u_dst, adm_key, adm_slot, slot_of, key_of, slot_state,
               last_use, protect, prefetched_at, pinned, inflight_of, victims, cursor_ptr, scratch, counters, reuse, S,
               E, WIN, NC, BYPASS)
        if RECALL != 0:
            _score(ex, first, position, dstep, pred, counters, R, MIN_CONF, P, P_MAIN, E, E_PAD, NC)
        if TRACE != 0:
            tl.store(trace + (dstep * P + position) * E + ex, 1, mask=first)
        tl.debug_barrier()
        if SHADOW != 0:
            _shadow_rows(ids_s, act_s, ns, nx, position, now, ex, first, u_first, assign, u_key, u_slot, u_dst,
                         slot_of, last_use, E, K, SK_PAD)
            tl.debug_barrier()
        if (RESERVE != 0) & (FILLS != 0):  # without fills (no budget) the window protected above is all it does
            _reserve(position, step, dstep, now, step_base, pred, slot_of, key_of, slot_state, last_use, protect,
                     prefetched_at, pinned, inflight_of, e_state, e_key, e_slot, e_deadline, e_made, e_next, e_done,
                     e_ready, victims, cursor_ptr, fills_for, counters, scratch, scratch_e, S, BUDGET, MAX_INFLIGHT,
                     MIN_CONF, FILL_CONF, SPARE, LEAD, R, P, P_MAIN, E, E_PAD, M, ROWS_PAD, RB, WIN, NC)
            tl.debug_barrier()
        _write_order(order, e_state, e_next, e_deadline, position, CHUNKS, M)

    @triton.jit(do_not_specialize=("S", "R", "CHUNKS"))
    def _step_start_kernel(words, clocks, floats, S, P: tl.constexpr, E: tl.constexpr, M: tl.constexpr,
                           A: tl.constexpr, A_PAD: tl.constexpr, R, NC: tl.constexpr, CHUNKS, BLOCK: tl.constexpr,
                           DECODE: tl.constexpr):
        (slot_of, _u0, _p0, inflight_of, e_state, e_key, e_slot, _n0, e_done, e_ready, _o0, adm_key, adm_slot,
         cursor_ptr, demand_ptr, key_of, slot_state, _v0, fills_for) = _words(words, S, P, E, M, A)
        (e_deadline, e_made, counters, step_ptr, step_base_ptr, progress_ptr, dstep_ptr, last_use, protect,
         prefetched_at) = _clocks(clocks, S, P, M, NC)
        _r0, pred = _floats(floats, P, E)
        step = tl.load(step_ptr) + 1
        tl.store(step_ptr, step)
        dstep = tl.load(dstep_ptr)
        if DECODE:
            dstep += 1
            tl.store(dstep_ptr, dstep)
        now = 2 * step * P - 1
        tl.store(step_base_ptr, now)
        tl.store(progress_ptr, now)
        tl.store(cursor_ptr, 0)
        tl.store(demand_ptr, 0)
        _publish(slot_of, slot_state, prefetched_at, inflight_of, e_state, e_key, e_slot, e_made, e_ready, adm_key,
                 adm_slot, counters, E, M, A, A_PAD, NC, 13, 14, CHUNKS)
        tl.debug_barrier()
        jm = tl.arange(0, M)
        states = tl.load(e_state + jm)
        stale = (states == 1) & (tl.load(e_deadline + jm) <= now)
        key = tl.load(e_key + jm, mask=stale, other=0)
        slot = tl.load(e_slot + jm, mask=stale, other=0)
        tl.store(slot_state + slot, 0, mask=stale)  # FREE
        tl.store(key_of + slot, -1, mask=stale)
        tl.store(last_use + slot, -1, mask=stale)
        tl.store(protect + slot, -1, mask=stale)
        tl.store(prefetched_at + slot, -1, mask=stale)
        tl.store(inflight_of + key, -1, mask=stale)
        unused = stale & (tl.load(e_made + jm, mask=stale, other=-1) >= 0)  # late ones were counted as late
        tl.atomic_add(counters + (key // E) * NC + 8, 1, mask=unused)  # wasted
        tl.atomic_add(counters + (key // E) * NC + 14, tl.load(e_done + jm, mask=stale, other=0).to(tl.int64),
                      mask=stale)
        tl.store(e_state + jm, 0, mask=stale | (states == 2))  # E_FREE
        if DECODE:
            row = (dstep + R - 1) % R
            for start in range(0, P * E, BLOCK):
                cells = start + tl.arange(0, BLOCK)
                tl.store(pred + row * P * E + cells, 0.0, mask=cells < P * E)
            for start in range(0, P, BLOCK):
                cells = start + tl.arange(0, BLOCK)
                tl.store(fills_for + row * P + cells, 0, mask=cells < P)


class LayerPlanner:
    """Layer plans over one table: the kernel where it runs, the reference (residency/plan.py) elsewhere."""

    def __init__(self, st: TableState, cfg: ResidencyConfig, top_k: int, max_exact_rows: int, max_shadow_rows: int,
                 use_kernel: bool):
        self.st, self.cfg, self.top_k = st, cfg, top_k
        self.use_kernel = use_kernel
        self.max_experts = st.adm_key.shape[0]
        # the kernels find the table's fields from these sizes (`_words`, `_clocks`): the table must have them
        assert (st.slot_of.shape[0], st.key_of.shape[0], st.e_state.shape[0], st.pred.shape[1:]) == (
            cfg.keys, cfg.n_slots, cfg.entries, (cfg.positions, cfg.n_experts)), "a table of another configuration"
        assert st.pred.shape[0] >= cfg.ring, "the table's prediction ring is shorter than the configuration's"
        device = st.slot_of.device
        self._scratch = torch.zeros(_pow2(max(self.max_experts, cfg.entries, VICTIM_WINDOW)), dtype=torch.int32,
                                    device=device)
        self._scratch_e = torch.zeros(cfg.entries, dtype=torch.int32, device=device)
        self._xk = _pow2(max(max_exact_rows * top_k, 2))
        self._sk = _pow2(max(max_shadow_rows * top_k, 2))
        self._dummy = torch.zeros(1, dtype=torch.uint8, device=device)
        self._dummy_ids = torch.zeros(1, 1, dtype=torch.int64, device=device)
        self._dummy_act = torch.zeros(1, dtype=torch.bool, device=device)

    def step_start(self, decode: bool, next_use: torch.Tensor | None = None) -> None:
        """Open a step (no fill may be running): then sort the eviction queue (torch ops, capturable)."""
        st, cfg = self.st, self.cfg
        if not self.use_kernel:
            reference_step_start(st, cfg, decode, next_use)
            return
        self.start_launch(decode)()
        rank_victims(st, cfg, next_use)

    def start_launch(self, decode: bool) -> Launch:
        st, cfg = self.st, self.cfg
        return Launch(
            _step_start_kernel, (1,), words=st.words, clocks=st.clocks, floats=st.floats, S=cfg.n_slots,
            P=cfg.positions, E=cfg.n_experts, M=cfg.entries, A=self.max_experts, A_PAD=_pow2(self.max_experts),
            R=cfg.ring, NC=len(COUNTERS), CHUNKS=cfg.chunks, BLOCK=1024, DECODE=decode)

    def __call__(self, position: int, ids_x: torch.Tensor, act_x: torch.Tensor, ids_s: torch.Tensor | None,
                 act_s: torch.Tensor | None, assign: torch.Tensor, u_key: torch.Tensor, u_slot: torch.Tensor,
                 u_dst: torch.Tensor, reserve: bool, count_recall: bool, trace: torch.Tensor | None = None,
                 u_wait: torch.Tensor | None = None) -> None:
        """`u_wait` (with `cfg.wait_late`): each late expert's fill entry, -1 elsewhere."""
        assert u_wait is not None or not self.cfg.wait_late, "wait_late plans need u_wait"
        if not self.use_kernel:
            plan_layer(self.st, self.cfg, position, ids_x, act_x, ids_s, act_s, assign, u_key, u_slot, u_dst,
                       reserve, count_recall, trace, u_wait)
            return
        self.launch(position, ids_x, act_x, ids_s, act_s, assign, u_key, u_slot, u_dst, reserve, count_recall,
                    trace, u_wait)()

    def launch(self, position: int, ids_x: torch.Tensor, act_x: torch.Tensor, ids_s: torch.Tensor | None,
               act_s: torch.Tensor | None, assign: torch.Tensor, u_key: torch.Tensor, u_slot: torch.Tensor,
               u_dst: torch.Tensor, reserve: bool, count_recall: bool, trace: torch.Tensor | None = None,
               u_wait: torch.Tensor | None = None) -> Launch:
        st, cfg = self.st, self.cfg
        assert u_wait is not None or not cfg.wait_late
        shadow = ids_s is not None and ids_s.shape[0] > 0
        assert ids_x.shape[0] * self.top_k <= self._xk
        rows_pad = _pow2(cfg.ring * max(cfg.main_positions, 1))
        return Launch(
            _plan_kernel, (1,), num_warps=8,
            ids_x=ids_x, act_x=act_x, ids_s=ids_s if shadow else self._dummy_ids,
            act_s=act_s if shadow else self._dummy_act, nx=ids_x.shape[0], ns=ids_s.shape[0] if shadow else 0,
            position=position, assign=assign, u_key=u_key, u_slot=u_slot, u_dst=u_dst,
            u_wait=u_wait if u_wait is not None else u_dst,
            words=st.words, clocks=st.clocks, floats=st.floats,
            trace=trace if trace is not None else self._dummy, scratch=self._scratch, scratch_e=self._scratch_e,
            P=cfg.positions, P_MAIN=max(cfg.main_positions, 1), E=cfg.n_experts, E_PAD=_pow2(cfg.n_experts),
            S=cfg.n_slots, M=cfg.entries, A=self.max_experts, A_PAD=_pow2(self.max_experts), K=self.top_k,
            XK_PAD=_pow2(max(ids_x.shape[0] * self.top_k, 2)),
            SK_PAD=_pow2(max(ids_s.shape[0] * self.top_k, 2)) if shadow else 2,
            R=cfg.ring, ROWS_PAD=rows_pad, RB=min(rows_pad, max(WINDOW_CELLS // _pow2(cfg.n_experts), 1)),
            CHUNKS=cfg.chunks, BUDGET=cfg.budget_per_target, MAX_INFLIGHT=cfg.max_inflight,
            MIN_CONF=float(cfg.min_confidence), FILL_CONF=float(cfg.fill_cut), SPARE=cfg.spare_recent,
            LEAD=cfg.lead_clock, WIN=VICTIM_WINDOW, NC=len(COUNTERS),
            SHADOW=int(shadow), RESERVE=int(reserve), FILLS=int(cfg.fills),
            RECALL=int(count_recall), TRACE=int(trace is not None),
            WAIT=bool(cfg.wait_late), IDLE=bool(cfg.fill_idle_link), BYPASS=bool(cfg.bypass))


# the kernel writes counter columns by number; keep them tied to the names
assert (C["uses"], C["hit"], C["prefetched"], C["late"], C["miss"], C["zero_copy"], C["evictions"],
        C["prefetch_issued"], C["prefetch_wasted"], C["lead_sum"], C["predicted"], C["truth"],
        C["predicted_correct"], C["fills_done"], C["fill_chunks"], C["admitted"]) == tuple(range(16))
assert (FILLING, RESIDENT, E_ACTIVE, E_DONE, E_FREE, NO_ENTRY, ADMITTING) == (2, 1, 1, 2, 0, -1, -2)
