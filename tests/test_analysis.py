"""analysis.py: the floors (Belady with and without bypass) and the k-steps-ahead references, on small traces whose
answers are worked out by hand or by brute force."""

from __future__ import annotations

import random

import pytest

from moeprefetch.analysis import ahead_misses, belady_bypass_misses, belady_misses


def brute_force_floor(uses: list, slots: int) -> int:
    """The fewest misses over every admit / evict choice (exponential: tiny inputs only)."""
    best = {frozenset(): 0}
    for key in uses:
        nxt: dict[frozenset, int] = {}
        for cache, misses in best.items():
            options = []
            if key in cache:
                options.append((cache, misses))
            else:
                options.append((cache, misses + 1))  # read in place, not admitted
                if len(cache) < slots:
                    options.append((cache | {key}, misses + 1))
                else:
                    options += [((cache - {v}) | {key}, misses + 1) for v in cache]
            for c, m in options:
                if m < nxt.get(c, 1 << 30):
                    nxt[c] = m
        best = nxt
    return min(best.values())


@pytest.mark.parametrize("seed", range(6))
def test_belady_with_bypass_is_the_true_floor(seed):
    rng = random.Random(seed)
    uses = [rng.randrange(6) for _ in range(14)]
    for slots in (1, 2, 3):
        floor = brute_force_floor(uses, slots)
        assert belady_bypass_misses([uses], slots) == floor
        assert belady_misses(uses, slots) >= floor


def test_bypass_beats_demand_admission_when_the_missed_expert_is_not_needed_again():
    uses = ["a", "b", "x", "a", "b"]  # x is never used again: admitting it evicts a or b
    assert belady_misses(uses, 2) == 4 and belady_bypass_misses([uses], 2) == 3


def lru_brute(steps: list[list], slots: int) -> int:
    """LRU by timestamps: evict the oldest key not used in the current step; no victim: read in place."""
    last: dict = {}
    clock, misses = 0, 0
    for step in steps:
        used_now = set()
        for key in step:
            clock += 1
            used_now.add(key)
            if key not in last:
                misses += 1
                if len(last) >= slots:
                    candidates = [k for k in last if k not in used_now]
                    if not candidates:
                        continue
                    del last[min(candidates, key=last.get)]
            last[key] = clock
    return misses


@pytest.mark.parametrize("seed", range(4))
def test_ahead_zero_is_plain_lru_and_the_protected_lines_lie_above_the_floor(seed):
    """(That they also lie below plain LRU is not a theorem; it holds on these seeded traces.)"""
    rng = random.Random(seed)
    steps = [[(p, rng.randrange(5)) for p in range(3)] for _ in range(40)]
    for slots in (3, 5, 8):
        lru = ahead_misses(steps, slots, 0)
        assert lru == lru_brute(steps, slots)
        floor = belady_bypass_misses(steps, slots)
        one, four = ahead_misses(steps, slots, 1), ahead_misses(steps, slots, 4)
        assert floor <= four <= lru and floor <= one <= lru


def test_routing_is_recorded_from_the_sampled_generation_when_asked(checkpoint_factory):
    """`record_routing` (and the Belady floor built on it) follows a seeded sampled generation: the same seed gives
    the same uses, another seed or greedy decoding other ones (a random checkpoint's tokens fork at once)."""
    from moeprefetch import MoEPrefetchEngine
    from moeprefetch.analysis import belady_bytes_per_token, record_routing

    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, max_seq_len=64,
                                               expert_cache_slots=5)
    prompt = [3, 4, 5, 6]
    sampled = record_routing(engine, prompt, 12, temperature=1.0, seed=5)
    assert sampled.decode_tokens == 11 and sampled.uses[: sampled.first_decode]
    assert record_routing(engine, prompt, 12, temperature=1.0, seed=5).uses == sampled.uses
    assert record_routing(engine, prompt, 12, temperature=1.0, seed=6).uses != sampled.uses
    assert record_routing(engine, prompt, 12).uses != sampled.uses
    assert belady_bytes_per_token(engine, prompt, 12, temperature=1.0, seed=5) > 0
    engine.close()
