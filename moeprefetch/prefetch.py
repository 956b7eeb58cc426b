"""The prefetch queue shared by all predictors: ordered by deadline, deduplicated, capped per target.

Pure bookkeeping; `runtime.py` pops items and issues the copies (within its cap on bytes in flight). A target is a
(step, layer); its deadline is (step, position of the layer in the MoE order), so the copy stream always serves the
earliest need first. Items whose deadline has arrived are stale (the layer runs now, a reactive fetch covers it) and
are dropped.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from .cache import Deadline, ExpertKey


@dataclass(frozen=True, order=True)
class QueueItem:
    deadline: Deadline
    rank: int
    seq: int
    key: ExpertKey
    made_at: Deadline


class PrefetchQueue:
    def __init__(self, budget_per_target: int):
        self.budget_per_target = max(int(budget_per_target), 0)
        self._heap: list[QueueItem] = []
        self._accepted: dict[Deadline, set[int]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, deadline: Deadline, layer: int, experts: tuple[int, ...], made_at: Deadline) -> list[int]:
        """Queue up to the target's remaining budget of `experts` (ranked); returns the experts accepted."""
        accepted = self._accepted.setdefault(deadline, set())
        taken = []
        for rank, expert in enumerate(experts):
            if len(accepted) >= self.budget_per_target:
                break
            if expert in accepted:
                continue
            accepted.add(expert)
            taken.append(expert)
            heapq.heappush(self._heap, QueueItem(deadline, rank, next(self._seq), (layer, expert), made_at))
        return taken

    def pop(self, now: Deadline) -> QueueItem | None:
        """The most urgent item whose deadline is still ahead of `now`; stale items are discarded."""
        while self._heap:
            item = heapq.heappop(self._heap)
            if item.deadline > now:
                return item
        return None

    def push_back(self, item: QueueItem) -> None:
        heapq.heappush(self._heap, item)

    def forget_before(self, now: Deadline) -> None:
        for deadline in [d for d in self._accepted if d <= now]:
            del self._accepted[deadline]

    def clear_items(self) -> None:
        """Drop queued items but keep the per-target budgets already used."""
        self._heap.clear()

    def clear(self) -> None:
        self._heap.clear()
        self._accepted.clear()
