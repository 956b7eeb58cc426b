"""VRAM expert-cache bookkeeping: which (layer, expert) sits in which slot, and which slot to give up next.

Pure Python, no tensors and no I/O, so every rule here is testable on its own. The slot memory itself lives in
runtime.py; copies live in transfer.py.

Eviction rules:
- a *locked* key (read by the layer being computed) is never evicted;
- a *pinned* key (the `static` policy's hot set) is never evicted;
- a key *protected* by a pending prefetch deadline is not evicted by a prefetch with a later or equal deadline, so a
  prefetch never pushes out an expert that an earlier need still waits for; demand misses may evict protected keys,
  but only when nothing unprotected is left.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator

ExpertKey = tuple[int, int]  # (checkpoint layer index, expert id)
Deadline = tuple[int, int]  # (step, position of the layer in the MoE layer order)

POLICIES = ("lru", "lfu", "static")


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def inserted(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def used(self, key: ExpertKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def eviction_order(self) -> Iterator[ExpertKey]:
        return iter(list(self._order))


class LFUPolicy:
    """Least frequently used first (uses counted since the engine started, ties broken by recency).

    Counts survive eviction: MoE routing has a stable hot set, and forgetting an expert's history each time it leaves
    the cache would make LFU degrade to LRU under pressure."""

    def __init__(self) -> None:
        self.counts: dict[ExpertKey, int] = {}
        self._stamp: dict[ExpertKey, int] = {}
        self._heap: list[tuple[int, int, ExpertKey]] = []
        self._clock = itertools.count()
        self._present: set[ExpertKey] = set()

    def _push(self, key: ExpertKey) -> None:
        stamp = next(self._clock)
        self._stamp[key] = stamp
        heapq.heappush(self._heap, (self.counts.get(key, 0), stamp, key))

    def inserted(self, key: ExpertKey) -> None:
        self._present.add(key)
        self._push(key)

    def used(self, key: ExpertKey) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        if key in self._present:
            self._push(key)

    def removed(self, key: ExpertKey) -> None:
        self._present.discard(key)

    def eviction_order(self) -> Iterator[ExpertKey]:
        # Entries go stale when a key is used again (a fresher entry was pushed) or leaves the cache.
        live = [entry for entry in self._heap if entry[2] in self._present and self._stamp.get(entry[2]) == entry[1]]
        if len(live) < len(self._heap) // 2:
            heapq.heapify(live)
            self._heap = live
        return (key for _, _, key in sorted(live))


class StaticPolicy(LRUPolicy):
    """A hot set chosen from a routing profile is pinned; the remaining slots are managed as LRU."""

    def __init__(self, hot_set: Iterable[ExpertKey] = ()) -> None:
        super().__init__()
        self.hot_set = set(hot_set)


def make_policy(name: str, hot_set: Iterable[ExpertKey] = ()) -> LRUPolicy | LFUPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "static":
        return StaticPolicy(hot_set)
    raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")


@dataclass
class Allocation:
    slot: int
    evicted: ExpertKey | None


class ExpertCache:
    """(layer, expert) -> slot table over `n_slots` slots with a pluggable eviction policy."""

    def __init__(self, n_slots: int, policy: str = "lru", hot_set: Iterable[ExpertKey] = ()):
        if n_slots <= 0:
            raise ValueError("the expert cache needs at least one slot")
        self.n_slots = n_slots
        self.policy_name = policy
        self.policy = make_policy(policy, hot_set)
        self.slot_of: dict[ExpertKey, int] = {}
        self.key_of: list[ExpertKey | None] = [None] * n_slots
        self._free: list[int] = list(range(n_slots - 1, -1, -1))
        self.locked: set[ExpertKey] = set()
        # key -> its earliest known upcoming need; `_needs` keeps every known need so a key stays protected until
        # its last predicted use (eviction then picks the key needed farthest away: Belady within the horizon)
        self.protected: dict[ExpertKey, Deadline] = {}
        self._needs: dict[ExpertKey, list[Deadline]] = {}
        self._expiry: list[tuple[Deadline, ExpertKey]] = []  # every recorded need, so expiry touches only those due

    # ---- queries --------------------------------------------------------------------------------------------------
    def __contains__(self, key: ExpertKey) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def lookup(self, key: ExpertKey) -> int | None:
        return self.slot_of.get(key)

    @property
    def pinned(self) -> set[ExpertKey]:
        return self.policy.hot_set if isinstance(self.policy, StaticPolicy) else set()

    def resident_keys(self) -> list[ExpertKey]:
        return list(self.slot_of)

    # ---- updates --------------------------------------------------------------------------------------------------
    def use(self, key: ExpertKey) -> None:
        self.policy.used(key)

    def lock(self, keys: Iterable[ExpertKey]) -> None:
        self.locked.update(keys)

    def unlock(self, keys: Iterable[ExpertKey] | None = None) -> None:
        if keys is None:
            self.locked.clear()
        else:
            self.locked.difference_update(keys)

    def protect(self, key: ExpertKey, deadline: Deadline) -> None:
        needs = self._needs.setdefault(key, [])
        if deadline not in needs:
            heapq.heappush(needs, deadline)
            heapq.heappush(self._expiry, (deadline, key))
        self.protected[key] = needs[0]

    def clear_protection(self) -> None:
        self.protected.clear()
        self._needs.clear()
        self._expiry.clear()

    def expire_protection(self, now: Deadline) -> None:
        """Drop needs whose time has passed (they happened, or the prediction was wrong); a key stays protected by
        its next known need."""
        while self._expiry and self._expiry[0][0] < now:
            _, key = heapq.heappop(self._expiry)
            needs = self._needs.get(key)
            if not needs:
                continue
            while needs and needs[0] < now:
                heapq.heappop(needs)
            if needs:
                self.protected[key] = needs[0]
            else:
                self.protected.pop(key, None)
                del self._needs[key]

    def _victim(self, prefetch_deadline: Deadline | None) -> ExpertKey | None:
        pinned = self.pinned
        farthest: ExpertKey | None = None  # among protected keys, the one needed last (Belady's choice)
        for key in self.policy.eviction_order():
            if key in self.locked or key in pinned:
                continue
            guard = self.protected.get(key)
            if guard is None:
                return key
            if farthest is None or guard > self.protected[farthest]:
                farthest = key
        if farthest is None:
            return None
        if prefetch_deadline is not None and self.protected[farthest] <= prefetch_deadline:
            return None  # a prefetch never evicts what is needed sooner than what it brings in
        return farthest

    def allocate(self, key: ExpertKey, prefetch_deadline: Deadline | None = None) -> Allocation | None:
        """A slot for `key` (not yet present): a free one, or one freed by evicting a victim. None if every slot
        is locked, pinned or (for a prefetch) protected."""
        assert key not in self.slot_of, f"{key} is already cached"
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self._victim(prefetch_deadline)
            if evicted is None:
                return None
            slot = self.slot_of[evicted]
            self.remove(evicted)
            self._free.remove(slot)
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.policy.inserted(key)
        return Allocation(slot, evicted)

    def remove(self, key: ExpertKey) -> int:
        slot = self.slot_of.pop(key)
        self.key_of[slot] = None
        self._free.append(slot)
        self.policy.removed(key)
        self.protected.pop(key, None)
        self._needs.pop(key, None)
        return slot

    def clear(self) -> None:
        for key in list(self.slot_of):
            self.remove(key)
        self.locked.clear()
        self.clear_protection()
