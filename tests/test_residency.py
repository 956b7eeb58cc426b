"""residency/: the table's rules, on the reference plans (which the kernels are tested against in test_kernels.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeprefetch.residency.plan import finish_call, plan_layer, step_start
from moeprefetch.residency.state import C, E_ACTIVE, FILLING, RESIDENT, ResidencyConfig, TableState


class Table:
    """A small table driven plan by plan: P positions (the last is the MTP layer), E experts, S slots, top-k 2."""

    def __init__(self, slots: int = 4, experts: int = 8, positions: int = 3, policy: str = "lru", **cfg):
        cfg.setdefault("wait_late", False)  # these rules are the reference plans' own; a late expert is reread
        self.cfg = ResidencyConfig(positions=positions, main_positions=positions - 1, n_experts=experts,
                                   n_slots=slots, record_bytes=64, chunk_bytes=64, entries=16, policy=policy, **cfg)
        self.st = TableState.allocate(self.cfg, 16, torch.device("cpu"))
        self.k = 2

    def start(self, decode: bool = True) -> None:
        step_start(self.st, self.cfg, decode)

    def plan(self, position: int, rows: list[list[int]], shadow: list[list[int]] | None = None,
             reserve: bool = True) -> dict:
        ids = torch.tensor(rows, dtype=torch.int64).view(-1, self.k)
        sh = torch.tensor(shadow, dtype=torch.int64).view(-1, self.k) if shadow else None
        n = ids.shape[0] + (sh.shape[0] if sh is not None else 0)
        assign = torch.zeros(n, self.k, dtype=torch.int32)
        u_key, u_slot, u_dst = (torch.zeros(16, dtype=torch.int32) for _ in range(3))
        plan_layer(self.st, self.cfg, position, ids, torch.ones(ids.shape[0], dtype=torch.bool), sh,
                   torch.ones(sh.shape[0], dtype=torch.bool) if sh is not None else None, assign, u_key, u_slot,
                   u_dst, reserve=reserve, count_recall=True)
        return dict(assign=assign.tolist(), key=u_key.tolist(), slot=u_slot.tolist(), dst=u_dst.tolist())

    def predict(self, steps_ahead: int, position: int, experts: list[int], conf: float = 1.0) -> None:
        row = (int(self.st.decode_step[0]) + steps_ahead) % self.cfg.ring
        self.st.pred[row, position, experts] = conf

    def land_fills(self) -> None:
        """What the side stream does: copy every reserved fill (here: mark it ready)."""
        active = self.st.e_state == E_ACTIVE
        self.st.e_ready[active] = 1

    def key(self, position: int, expert: int) -> int:
        return position * self.cfg.n_experts + expert

    def resident(self) -> set[int]:
        return {k for k, s in enumerate(self.st.slot_of.tolist()) if s >= 0}

    def count(self, name: str) -> int:
        return int(self.st.counters[:, C[name]].sum())


def test_a_miss_is_read_from_host_admitted_and_published_by_the_next_plan():
    t = Table()
    t.start()
    out = t.plan(0, [[3, 5]])
    assert out["slot"][:2] == [-1, -1] and out["key"][:2] == [3, 5] and out["assign"] == [[0, 1]]
    assert sorted(out["dst"][:2]) == [0, 1]  # free slots first
    assert t.resident() == set() and t.st.slot_state[out["dst"][0]] == FILLING
    t.plan(1, [[1, 2]])  # publishes position 0's admissions before planning its own
    assert {3, 5} <= t.resident()
    assert t.count("miss") == 4 and t.count("admitted") == 4 and t.count("zero_copy") == 4


def test_lru_evicts_the_least_recently_used_and_never_what_this_step_used():
    t = Table(slots=4)
    t.start()
    t.plan(0, [[0, 1]])
    t.start()
    t.plan(0, [[2, 3]])
    t.start()
    t.plan(0, [[0, 1]])  # 0, 1 used again: 2, 3 are now least recent
    t.plan(1, [[4, 5]])  # needs 2 victims: slots of 2 and 3, never 0 and 1 (used this step)
    t.plan(1, [[6, 7]])  # publishes; no victim left this step: 6 and 7 are read from host, not admitted
    assert t.resident() == {0, 1, t.key(1, 4), t.key(1, 5)}
    assert t.count("evictions") == 2 and t.count("admitted") == 6


def test_lfu_evicts_the_least_frequently_used():
    t = Table(slots=3, policy="lfu")
    for rows in ([[0, 1]], [[0, 1]], [[0, 2]]):
        t.start()
        t.plan(0, rows)
    t.start()
    t.plan(0, [[3, 4]])  # victims: 2 (one use) and 1 (two uses) before 0 (three uses)
    t.start()
    assert t.resident() == {0, 3, 4}


def test_lrfu_frequencies_decay_by_half_every_halflife_steps():
    """After each step start a key's frequency is sum over its uses in earlier steps j of d^(n-1-j) at start n, with
    d = 2^(-1/halflife) (float64 reference on random routing); victims are ranked by it, ties by recency."""
    halflife, steps = 3.0, 14
    t = Table(slots=6, experts=8, positions=3, policy="lrfu", frequency_halflife=halflife)
    generator = torch.Generator().manual_seed(5)
    used: list[list[int]] = []  # keys used in each step
    for _ in range(steps):
        t.start()
        keys = []
        for position in (0, 1):
            experts = torch.randperm(8, generator=generator)[:2].tolist()
            t.plan(position, [experts])
            keys += [t.key(position, e) for e in experts]
        used.append(keys)
    t.start()  # start n = steps + 1 folds in the last step's uses
    d = 2.0 ** (-1.0 / halflife)
    expected = torch.zeros(t.cfg.keys, dtype=torch.float64)
    for j, keys in enumerate(used):
        expected[keys] += d ** (steps - 1 - j)
    assert torch.allclose(t.st.frequency.double(), expected, rtol=1e-5, atol=1e-6)
    held = [s for s in t.st.victims.tolist() if t.st.key_of[s] >= 0]
    ranked = sorted(held, key=lambda s: (int(expected[t.st.key_of[s]] * 1024), int(t.st.last_use[s])))
    assert held == ranked


def test_lrfu_ranks_stay_in_order_for_huge_frequencies():
    """A long half-life lets a hot expert's frequency grow past 8192, where (frequency x 1024) << 40 would overflow
    int64 and sort it before free slots; the rank is capped instead (free slots first, the cold expert next)."""
    t = Table(slots=4, policy="lrfu", frequency_halflife=1e6)
    t.start()
    t.plan(0, [[0, 1]])
    t.start()
    t.st.frequency[0], t.st.frequency[1] = 9000.0, 0.5  # 9000 x 2^10 x 2^40 > 2^63: past the int64 sign bit
    t.start()
    order = t.st.victims.tolist()
    assert [int(t.st.key_of[s]) for s in order] == [-1, -1, 1, 0]


@pytest.mark.parametrize("policy,first_victim", [("lfu", 1), ("lrfu", 0)])
def test_lrfu_forgets_old_popularity_that_lfu_keeps(policy, first_victim):
    """Expert 0 was used in steps 1-6, expert 1 in steps 9-10 (expert 2 throughout): LFU evicts the recent expert 1
    first (fewer uses), LRFU with a half-life of one step the long-unused expert 0."""
    t = Table(slots=3, policy=policy, frequency_halflife=1.0)
    for step in range(1, 11):
        t.start()
        if step <= 6 or step >= 9:
            t.plan(0, [[0 if step <= 6 else 1, 2]])
    t.start()
    assert t.resident() == {0, 1, 2}
    assert int(t.st.key_of[int(t.st.victims[0])]) == first_victim


def test_static_hot_set_is_never_evicted():
    t = Table(slots=3, policy="static")
    t.st.pinned[1] = 1
    t.start()
    t.plan(0, [[1, 2]])
    for step in range(4):
        t.start()
        t.plan(0, [[3 + step, 0]])
    t.start()
    assert 1 in t.resident()


@pytest.mark.parametrize("lead", [0, 1])
def test_a_prediction_protects_a_resident_expert_until_its_need(lead):
    """Also beyond the prefetch lead: the need below is 3 MoE positions ahead of the plan that protects it."""
    t = Table(slots=2, prefetch_lead=lead)
    t.start()
    t.plan(0, [[0, 1]])
    t.start()
    t.predict(0, 1, [])  # nothing for this step
    t.predict(1, 0, [0])  # expert 0 of position 0 is predicted for the next step
    t.plan(0, [[4, 5]], reserve=True)  # protects expert 0; only expert 1's slot may be taken
    assert t.count("admitted") == 3
    t.start()
    assert 0 in t.resident() and 1 not in t.resident()


def test_predicted_experts_are_fetched_within_budget_and_used_in_time():
    t = Table(slots=6, budget_per_target=2)
    t.start()
    t.plan(0, [[0, 1]])
    t.start()
    t.predict(0, 1, [2, 3, 4], conf=0.9)  # three guesses for position 1 this step, budget 2
    t.plan(0, [[0, 1]])
    assert t.count("prefetch_issued") == 2
    t.land_fills()
    t.plan(1, [[2, 3]])  # the fills are published, then used: prefetched (useful)
    assert t.count("prefetched") == 2 and t.count("fills_done") == 2
    assert t.count("predicted") == 3 and t.count("predicted_correct") == 2



@pytest.mark.parametrize("miss_reuse,admitted", [(0.2, False), (0.8, True)])
def test_a_miss_less_likely_needed_soon_than_its_victim_bypasses_the_cache(miss_reuse, admitted):
    """bypass: the misses are read in place and their victims stay resident, unless the misses are the likelier
    ones to be needed soon (`TableState.reuse`, a predictor's)."""
    t = Table(slots=2, bypass=True)
    t.start()
    t.plan(0, [[0, 1]])  # experts 0 and 1 of position 0 fill both slots
    t.start()
    t.st.reuse[[t.key(0, 0), t.key(0, 1)]] = 0.5
    t.st.reuse[[t.key(1, 4), t.key(1, 5)]] = miss_reuse
    plan = t.plan(1, [[4, 5]])  # two misses; their victims would be the two slots
    assert (plan["dst"][:2] != [-1, -1]) == admitted
    t.start()  # publishes what was admitted
    expected = {t.key(1, 4), t.key(1, 5)} if admitted else {t.key(0, 0), t.key(0, 1)}
    assert t.resident() == expected
    assert t.count("miss") == 4 and t.count("admitted") == (4 if admitted else 2)


def test_without_a_fill_budget_the_reservation_changes_nothing_the_window_has_not():
    """Why the plans may skip their reservation passes when no fill can be issued: run on the table right after a
    plan's protection, the reservation leaves every tensor as it was."""
    from moeprefetch.residency.plan import _Lists, _reserve, _window

    t = Table(slots=6, budget_per_target=0)
    t.start()
    t.plan(0, [[0, 1]])
    t.start()
    t.predict(0, 1, [0, 2, 3], conf=0.9)
    t.predict(1, 0, [1, 4], conf=0.95)
    lists = _Lists(t.st)
    step, dstep = int(t.st.step[0]), int(t.st.decode_step[0])
    now = 2 * step * t.cfg.positions
    _window(lists, t.cfg, 0, step, dstep)
    lists.write_back()
    before = {name: value.clone() for name, value in t.st.tensors().items()}
    lists = _Lists(t.st)
    _reserve(lists, t.cfg, 0, now, int(t.st.step_base[0]), step, dstep)
    lists.write_back()
    for name, value in t.st.tensors().items():
        assert torch.equal(value, before[name]), name
    assert int(t.st.protect.max()) > now  # the window did protect something


def test_a_fill_waits_until_its_need_is_within_the_lead():
    """With a lead of one MoE position, a prediction for two positions ahead protects but fetches nothing until the
    plan before its need; the whole window (lead 0) fetches at once."""
    def run(lead: int) -> list[int]:
        t = Table(slots=12, positions=4, prefetch_lead=lead)
        issued = []
        t.start()
        t.predict(0, 1, [2])  # position 1 of this step: one position after the step-start plan's next
        t.predict(0, 2, [3])  # position 2
        t.predict(1, 0, [4])  # the next step's position 0
        t.plan(-1, [], reserve=True)
        issued.append(t.count("prefetch_issued"))
        for position in range(3):
            t.plan(position, [[0, 1]])
            issued.append(t.count("prefetch_issued"))
        return issued

    # at the step start (just before position 0) position 1 is 2 ahead; position p plans for p + 1
    assert run(1) == [0, 1, 2, 2]  # next step's position 0 is 2 ahead of position 2 (the MTP position is between)
    assert run(2) == [1, 2, 2, 3]
    assert run(0) == [3, 3, 3, 3]


@pytest.mark.parametrize("spare_recent", [0, 1])
def test_prefetches_spare_last_steps_experts_and_misses_do_not(spare_recent):
    t = Table(slots=4, spare_recent=spare_recent)
    t.start()
    t.plan(0, [[0, 1]])
    t.start()
    t.plan(0, [[2, 3]])  # the cache is full: 0 and 1 from two steps ago, 2 and 3 from the last step
    t.start()
    t.predict(0, 1, [4, 5])
    t.plan(0, [[6, 7]])  # the misses take 0's and 1's slots; only last step's 2 and 3 are left
    assert t.count("prefetch_issued") == (2 if spare_recent == 0 else 0)
    if spare_recent:
        t.plan(1, [[4, 5]])  # a miss may evict last step's experts
        assert t.count("admitted") == 8 and {2, 3}.isdisjoint(t.resident() | set(t.st.key_of.tolist()))


def test_a_slot_hit_this_step_ends_the_prefetches_victims_but_not_the_misses():
    """Prefetches take only the untouched head of the queue (sorted at the step's start): once an old expert at its
    head is hit, it is recent, and the prefetches of the rest of the step take no victim; a miss still finds one."""
    t = Table(slots=6, spare_recent=1)
    for rows in ([[0, 1]], [[2, 3]], [[4, 5]]):
        t.start()
        t.plan(0, rows)
    t.start()
    t.predict(1, 1, [6, 7])
    t.plan(0, [[0, 1]])  # hits 0 and 1, the oldest, at the head of the queue
    assert t.count("prefetch_issued") == 0
    t.plan(1, [[6, 7]])  # misses: they evict the cold 2 and 3 behind the hit slots
    t.start()  # publishes
    assert {t.key(1, 6), t.key(1, 7), 0, 1, 4, 5} == t.resident()
    fresh = Table(slots=6, spare_recent=0)  # without sparing, the prefetches take 2 and 3
    for rows in ([[0, 1]], [[2, 3]], [[4, 5]]):
        fresh.start()
        fresh.plan(0, rows)
    fresh.start()
    fresh.predict(1, 1, [6, 7])
    fresh.plan(0, [[0, 1]])
    assert fresh.count("prefetch_issued") == 2


def test_low_confidence_predictions_are_neither_fetched_nor_counted():
    t = Table(slots=6, min_confidence=0.5)
    t.start()
    t.predict(0, 1, [2], conf=0.9)
    t.predict(0, 1, [3], conf=0.2)
    t.plan(0, [[0, 1]])
    t.plan(1, [[2, 3]])
    assert t.count("prefetch_issued") == 1 and t.count("predicted") == 1


@pytest.mark.parametrize("fill_confidence,fetched", [(0.0, 2), (0.5, 3)])
def test_a_prediction_below_the_fill_cut_protects_but_is_not_fetched(fill_confidence, fetched):
    """Protection moves no bytes, so it takes every prediction at `min_confidence`; a fill needs `fill_confidence`.
    Expert 0 (weakly predicted for the next step) keeps its slot; the one victim left goes to the first wanted fill
    in deadline order that is confident enough (expert 2 at 0.3, else expert 3 at 0.8)."""
    t = Table(slots=4, min_confidence=0.1, fill_confidence=fill_confidence, spare_recent=0)
    t.start()
    t.plan(0, [[0, 1]])
    t.start()
    t.predict(1, 0, [0], conf=0.2)
    t.predict(0, 1, [2], conf=0.3)
    t.predict(0, 1, [3], conf=0.8)
    t.plan(0, [[4, 5]])  # the misses take the two free slots; the fill takes expert 1's
    held = set(t.st.key_of.tolist())
    assert t.count("prefetch_issued") == 1 and t.key(1, fetched) in held and t.key(1, 5 - fetched) not in held
    assert 0 in held and 1 not in held
    t.land_fills()
    t.plan(1, [[2, 3]])
    assert t.count("predicted") == 2  # both count as predictions (recall), whatever the fill cut
    assert t.count("prefetched") == 1


def test_a_fill_still_in_flight_is_late_not_wasted():
    t = Table(slots=6)
    t.start()
    t.predict(0, 1, [2])
    t.plan(0, [[0, 1]])  # reserves the fill of (1, 2)
    out = t.plan(1, [[2, 3]])  # the fill has not landed: read from host, counted late, and it is not admitted
    assert out["slot"][0] == -1 and out["dst"][0] == -1
    assert t.count("late") == 1
    t.land_fills()
    t.start()  # lands late: resident, but no unused prefetch
    finish_call(t.st, t.cfg)
    assert t.count("prefetch_wasted") == 0 and t.key(1, 2) in t.resident()


def test_a_fill_whose_need_passed_is_released_and_wasted():
    t = Table(slots=6)
    t.start()
    t.predict(0, 1, [2])
    t.plan(0, [[0, 1]])
    t.plan(1, [[4, 5]])  # the predicted expert was not needed; its fill never landed
    t.start()
    assert t.count("prefetch_wasted") == 1
    assert all(s != FILLING for s in t.st.slot_state.tolist()) and int((t.st.e_state == E_ACTIVE).sum()) == 0


def test_unused_prefetches_are_wasted_at_the_end_of_a_call():
    t = Table(slots=6)
    t.start()
    t.predict(1, 1, [6])  # for the next step
    t.plan(0, [[0, 1]])
    t.land_fills()
    t.plan(1, [[2, 3]])  # publishes the fill
    finish_call(t.st, t.cfg)
    assert t.count("prefetch_issued") == 1 and t.count("prefetch_wasted") == 1
    assert int(t.st.slot_state.eq(RESIDENT).sum()) == len(t.resident())


def test_shadow_rows_use_exact_experts_and_published_ones_only():
    t = Table(slots=6)
    t.start()
    t.plan(0, [[6, 7]])
    t.start()
    out = t.plan(0, [[0, 1]], shadow=[[1, 6]])  # 1 is computed for the exact row; 6 is published
    assert out["assign"][1] == [1, 2] and out["key"][2] == 6 and out["slot"][2] >= 0
    shadow_slot = out["slot"][2]
    assert t.st.last_use[shadow_slot] == 2 * (int(t.st.step) * 3 + 0)  # read now: no fill may take it this step
    out = t.plan(1, [[0, 1]], shadow=[[5, 4]])  # neither is available: the shadow row skips both
    assert out["assign"][1] == [-1, -1]
    assert t.count("uses") == 6  # shadow rows are never counted


def test_a_known_future_makes_the_victims_beladys():
    """With an oracle's trace the eviction queue puts the expert needed farthest in the future first."""
    from moeprefetch.residency.plan import next_use_table, victim_order

    t = Table(slots=3, positions=2, experts=4)
    t.start()
    t.plan(0, [[0, 1]])
    t.plan(1, [[0, 1]])
    t.start()  # publishes: slots hold keys 0, 1 (position 0) and 4 (position 1)
    trace = torch.zeros(6, 2, 4, dtype=torch.uint8)
    trace[2, 0, 1] = 1  # key 1 is needed at step 2, key 0 at step 4, key 4 never again
    trace[4, 0, 0] = 1
    future = torch.zeros(6, 8, dtype=torch.int64)
    next_use_table(trace, future)
    assert future[0, 1] == 2 and future[3, 1] > 5 and future[0, 0] == 4
    held = t.st.key_of.tolist()
    order = [held[s] for s in victim_order(t.st, t.cfg, future).tolist()]
    assert order[:2] == [4, 0] or order[:3] == [5, 4, 0]  # never-needed first, then the farthest need
    assert order.index(1) > order.index(0)


@pytest.mark.parametrize("policy", ["lru", "lrfu", "lfu"])
def test_predicted_reuse_reorders_the_victims_and_no_prediction_keeps_the_policys(policy):
    """reuse_weight w: victims by w x P(needed soon) + (1 - w) x the policy's rank, lowest first, checked against the
    formula on random tables; with no predictions (reuse 0) the order is exactly the policy's."""
    from moeprefetch.residency.plan import victim_order

    g = torch.Generator().manual_seed(7)
    slots = 9
    for trial in range(30):
        t = Table(slots=slots, positions=3, experts=8, policy=policy)
        for _ in range(1 + trial % 4):  # a few steps of random uses fill some slots and the routing history
            t.start()
            for p in range(2):
                t.plan(p, [torch.randperm(8, generator=g)[:2].tolist()])
        t.start()
        held = t.st.key_of.tolist()
        filled = [s for s in range(slots) if held[s] >= 0]
        if trial % 3 == 1 and len(filled) > 2:  # a slot being filled and a pinned key: never victims, last
            t.st.slot_state[filled[0]] = FILLING
            t.st.pinned[held[filled[1]]] = 1
        plain = victim_order(t.st, t.cfg).tolist()
        weighted = dataclasses.replace(t.cfg, reuse_weight=0.7)
        assert victim_order(t.st, weighted).tolist() == plain  # no predictions yet
        t.st.reuse.copy_(torch.rand(t.cfg.keys, generator=g))
        order = victim_order(t.st, weighted).tolist()
        # the policy's own order of every slot, before free slots go first and blocked ones last
        raw = dataclasses.replace(t.st, slot_state=torch.full_like(t.st.slot_state, RESIDENT),
                                  pinned=torch.zeros_like(t.st.pinned))
        rank = {slot: i for i, slot in enumerate(victim_order(raw, t.cfg).tolist())}
        free = [s for s in range(slots) if int(t.st.slot_state[s]) == 0]
        blocked = [s for s in range(slots) if int(t.st.slot_state[s]) == FILLING
                   or (held[s] >= 0 and int(t.st.pinned[held[s]]))]
        rest = [s for s in range(slots) if s not in free and s not in blocked]
        score = {s: 0.7 * float(t.st.reuse[held[s]]) + 0.3 * rank[s] / (slots - 1) for s in rest}
        expected = free + sorted(rest, key=lambda s: (score[s], rank[s])) + blocked
        assert order == expected, trial


def test_prefill_staging_rows_fit_their_share_of_the_room():
    from moeprefetch.residency import PREFILL_STAGING_BYTES, PREFILL_STAGING_SHARE, prefill_staging_rows

    record = 17 << 20
    assert prefill_staging_rows(record, 64) == (PREFILL_STAGING_BYTES // record) // 2 * 2  # no budget: the cap
    for room in (0, 100 << 20, 2 << 30, 8 << 30, 1 << 40):
        rows = prefill_staging_rows(record, 64, room)
        assert rows % 2 == 0 and 2 <= rows <= 128
        assert rows == 2 or rows * record <= min(PREFILL_STAGING_BYTES, PREFILL_STAGING_SHARE * room)
    assert prefill_staging_rows(record, 64, 100 << 20) == 2 < prefill_staging_rows(record, 64, 8 << 30)
    assert prefill_staging_rows(1000, 3) == 6  # at most two layers' worth
