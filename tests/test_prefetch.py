"""prefetch.py: deadline order, per-target budget, duplicates and stale items."""

from __future__ import annotations

from moeprefetch.prefetch import PrefetchQueue


def test_deadline_order_budget_and_dedup():
    queue = PrefetchQueue(budget_per_target=3)
    assert queue.add((5, 2), 7, (1, 2, 3, 4), made_at=(4, 0)) == [1, 2, 3]  # budget of 3
    assert queue.add((5, 2), 7, (3, 9), made_at=(4, 1)) == []  # budget used up
    assert queue.add((5, 0), 3, (8, 8), made_at=(4, 1)) == [8]  # duplicates dropped
    popped = [queue.pop((4, 5)).key for _ in range(4)]
    assert popped == [(3, 8), (7, 1), (7, 2), (7, 3)]  # earliest deadline first, then rank


def test_stale_items_are_dropped():
    queue = PrefetchQueue(4)
    queue.add((2, 0), 1, (5,), made_at=(1, 0))
    queue.add((3, 1), 1, (6,), made_at=(1, 0))
    assert queue.pop((2, 0)).key == (1, 6)  # deadline (2, 0) is not ahead of now=(2, 0): stale
    assert queue.pop((2, 0)) is None


def test_budgets_are_forgotten_once_their_time_has_passed():
    queue = PrefetchQueue(1)
    queue.add((1, 0), 1, (5,), made_at=(0, 0))
    queue.forget_before((1, 0))
    queue.clear_items()
    assert len(queue) == 0
    assert queue.add((1, 0), 1, (6,), made_at=(0, 0)) == [6]
