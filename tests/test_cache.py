"""cache.py: slot table, eviction policies, locks and prefetch-deadline protection."""

from __future__ import annotations

import pytest

from moeprefetch.cache import ExpertCache


def fill(cache: ExpertCache, keys):
    for key in keys:
        assert cache.allocate(key) is not None
        cache.use(key)


def test_lru_evicts_the_least_recently_used():
    cache = ExpertCache(3, "lru")
    fill(cache, [(1, 0), (1, 1), (1, 2)])
    cache.use((1, 0))
    alloc = cache.allocate((1, 3))
    assert alloc.evicted == (1, 1)
    assert cache.lookup((1, 3)) == alloc.slot
    assert len(cache) == 3 and (1, 1) not in cache


def test_lfu_evicts_the_least_frequently_used_and_remembers_counts():
    cache = ExpertCache(2, "lfu")
    fill(cache, [(1, 0), (1, 1)])
    for _ in range(3):
        cache.use((1, 0))
    assert cache.allocate((1, 2)).evicted == (1, 1)
    cache.use((1, 2))
    # (1, 1) comes back with its old count (1) +1: still fewer uses than (1, 0)
    assert cache.allocate((1, 1)).evicted == (1, 2)


def test_static_keeps_the_hot_set_and_runs_lru_on_the_rest():
    cache = ExpertCache(3, "static", hot_set=[(1, 0)])
    fill(cache, [(1, 0), (1, 1), (1, 2)])
    for expert in range(3, 8):
        alloc = cache.allocate((1, expert))
        assert alloc.evicted != (1, 0)
        cache.use((1, expert))
    assert (1, 0) in cache


def test_locked_keys_are_never_evicted():
    cache = ExpertCache(2, "lru")
    fill(cache, [(1, 0), (1, 1)])
    cache.lock([(1, 0), (1, 1)])
    assert cache.allocate((1, 2)) is None
    cache.unlock([(1, 0)])
    assert cache.allocate((1, 2)).evicted == (1, 0)


def test_prefetch_never_evicts_what_is_needed_sooner():
    cache = ExpertCache(2, "lru")
    fill(cache, [(1, 0), (1, 1)])
    cache.protect((1, 0), (5, 1))
    cache.protect((1, 1), (5, 3))
    assert cache.allocate((1, 2), prefetch_deadline=(5, 4)) is None  # both are needed sooner than (5, 4)
    alloc = cache.allocate((1, 2), prefetch_deadline=(5, 2))
    assert alloc.evicted == (1, 1)  # needed at (5, 3), after the prefetch's (5, 2): Belady's choice


def test_demand_evicts_unprotected_first_then_the_farthest_need():
    cache = ExpertCache(3, "lru")
    fill(cache, [(1, 0), (1, 1), (1, 2)])
    cache.protect((1, 0), (9, 0))
    cache.protect((1, 2), (4, 0))
    assert cache.allocate((1, 3)).evicted == (1, 1)  # the only unprotected key
    cache.use((1, 3))
    cache.protect((1, 3), (6, 0))
    assert cache.allocate((1, 4)).evicted == (1, 0)  # all protected: the farthest need goes


def test_protection_follows_every_known_need_and_expires():
    cache = ExpertCache(2, "lru")
    fill(cache, [(1, 0), (1, 1)])
    cache.protect((1, 0), (2, 0))
    cache.protect((1, 0), (7, 0))
    cache.expire_protection((3, 0))
    assert cache.protected[(1, 0)] == (7, 0)  # the next known need
    cache.expire_protection((8, 0))
    assert (1, 0) not in cache.protected


def test_clear_and_slot_reuse():
    cache = ExpertCache(2, "lru")
    fill(cache, [(1, 0), (1, 1)])
    cache.clear()
    assert len(cache) == 0 and not cache.protected
    fill(cache, [(2, 0), (2, 1)])
    assert sorted(cache.slot_of.values()) == [0, 1]


def test_bad_arguments():
    with pytest.raises(ValueError):
        ExpertCache(0)
    with pytest.raises(ValueError, match="unknown cache policy"):
        ExpertCache(4, "fifo")
