"""Analysis of routing: record what a generation truly needs, and the least any cache of a given size must move.

The transfer floor of a workload is what Belady's optimal replacement (evict the expert needed farthest in the
future) must copy during decode, over the routing of the very same generation. The benchmark divides it by the
measured link bandwidth; sweeps can use it as the bound any predictor and policy are measured against.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import RequestError

if TYPE_CHECKING:
    from .engine import MoEPrefetchEngine

ExpertKey = tuple[int, int]


@dataclass
class RoutingTrace:
    """The (layer, expert) uses of one generation in execution order; decode uses start at `first_decode`."""

    uses: list[ExpertKey]
    first_decode: int
    decode_tokens: int


def record_routing(engine: "MoEPrefetchEngine", prompt: list[int], new_tokens: int, temperature: float = 0.0,
                   seed: int = 0) -> RoutingTrace:
    """A generation with reactive fetching (greedy, or sampled at `temperature` with `seed`, as `generate` samples),
    recording every layer's distinct experts (prefill on the host, decode on the device: one read of the trace at the
    end)."""
    from .session import Session

    res = engine.residency
    if res.group is not None:
        raise RequestError("routing traces read one process's table: record them without distributed=True")
    request = engine.new_request([prompt], new_tokens, temperature, 0, 1.0, seed, "none", 1, None, False, None)
    res.prefill_log = []
    run = engine.run_session(Session(engine, request, record=True))
    try:
        while True:
            next(run)
    except StopIteration as stop:
        result = stop.value
    finally:
        prefill, res.prefill_log = res.prefill_log or [], None
    uses = [(layer, expert) for layer, experts in prefill for expert in experts]
    first_decode = len(uses)
    trace = engine.trace_buffer()[: result.stats.decode_steps].cpu()
    for step in trace:
        for position, layer in enumerate(res.layers):
            uses += [(layer, int(e)) for e in step[position].nonzero().flatten().tolist()]
    return RoutingTrace(uses, first_decode, result.stats.decode_tokens)


def _next_uses(uses: list[ExpertKey]) -> list[float]:
    """For each use, the index of the same key's next use (inf: never again)."""
    next_use: list[float] = [0.0] * len(uses)
    last: dict[ExpertKey, float] = {}
    for index in range(len(uses) - 1, -1, -1):
        next_use[index] = last.get(uses[index], math.inf)
        last[uses[index]] = index
    return next_use


def belady_misses(uses: list[ExpertKey], slots: int, count_from: int = 0, bypass: bool = False) -> int:
    """Misses of Belady's optimal replacement over a sequence of uses, counting from index `count_from`. With
    `bypass`, a miss may also be read without admission (as the expert kernel reads it in place): it displaces the
    resident needed farthest ahead only if it is itself needed sooner."""
    next_use = _next_uses(uses)
    resident: dict[ExpertKey, float] = {}
    heap: list[tuple[float, ExpertKey]] = []  # (-next use, key), with stale entries dropped lazily
    misses = 0
    for index, key in enumerate(uses):
        upcoming = next_use[index]
        if key not in resident:
            misses += index >= count_from
            if len(resident) >= slots:
                while resident.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if bypass and -heap[0][0] <= upcoming:  # every resident is needed sooner: read in place
                    continue
                del resident[heapq.heappop(heap)[1]]
        resident[key] = upcoming
        heapq.heappush(heap, (-upcoming, key))
    return misses


def belady_bypass_misses(steps: list[list[ExpertKey]], slots: int) -> int:
    """The fewest misses any cache of `slots` can have over per-step uses when misses may bypass the cache: a floor
    for every policy and predictor of the residency."""
    return belady_misses([key for step in steps for key in step], slots, bypass=True)


def ahead_misses(steps: list[list[ExpertKey]], slots: int, ahead: int) -> int:
    """Misses of LRU that never evicts an expert used in the current step or needed in the next `ahead` steps (a
    perfect predictor of `ahead` steps protecting them; `ahead` 0 is plain LRU). A miss that finds no such victim
    is read without admission. The reference that `replay` checks the residency's own code against."""
    from collections import OrderedDict

    lru: OrderedDict[ExpertKey, None] = OrderedDict()  # least recently used first
    misses = 0
    for t, step in enumerate(steps):
        # protected: what the step used so far and, with a predictor, the rest of the step and the next steps
        keep = set(step).union(*steps[t + 1 : t + 1 + ahead]) if ahead else set()
        for key in step:
            keep.add(key)
            if key in lru:
                lru.move_to_end(key)
                continue
            misses += 1
            if len(lru) >= slots:
                victim = next((k for k in lru if k not in keep), None)
                if victim is None:
                    continue
                del lru[victim]
            lru[key] = None
    return misses


def belady_bytes_per_token(engine: "MoEPrefetchEngine", prompt: list[int], new_tokens: int, temperature: float = 0.0,
                           seed: int = 0) -> float:
    """Bytes Belady's replacement must move per decode token with this engine's cache size, on this generation."""
    trace = record_routing(engine, prompt, new_tokens, temperature, seed)
    misses = belady_misses(trace.uses, engine.residency.n_slots, trace.first_decode)
    return misses * engine.residency.expert_bytes / max(trace.decode_tokens, 1)
