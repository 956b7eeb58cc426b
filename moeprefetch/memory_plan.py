"""VRAM planning: resident weights and KV cache first, a working-space reserve, the rest to expert slots.

If even the resident weights do not fit, whole non-expert layers are planned into host RAM and streamed a few layers
ahead of the compute (see `streaming.py`); the plan says which and why.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import RequestError
from .options import check_one_cache_size

GiB = 1024**3
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_bytes(value: str | int | float) -> int:
    """'12GiB', '12 GB', '512MiB', 1.5e9 -> bytes."""
    if isinstance(value, bool):
        raise RequestError(f"memory size must be a number of bytes or a string like '12GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise RequestError(f"memory size must be positive, got {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise RequestError(f"cannot read memory size {value!r}; write it like '12GiB', '12GB' or '512MiB'")
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if size <= 0:
        raise RequestError(f"memory size must be positive, got {value!r}")
    return int(size)


@dataclass
class MemoryPlan:
    budget_bytes: int | None
    resident_bytes: int  # non-expert weights kept in VRAM
    kv_bytes: int  # KV cache reserved for max_batch_size x max_seq_len
    workspace_bytes: int  # activations and gathered expert weights during a step
    expert_record_bytes: int
    total_experts: int
    expert_slots: int
    all_resident: bool  # every expert preloaded, no host store
    host_embedding: bool = False  # the embedding table stays in host RAM, its rows read over PCIe
    streamed_layers: list[int] = field(default_factory=list)  # layers whose weights stream from host RAM
    streamed_bytes: int = 0
    stream_ahead: int = 0
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what differs from what was asked for

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_slots * self.expert_record_bytes

    @property
    def planned_vram_bytes(self) -> int:
        return self.resident_bytes + self.kv_bytes + self.workspace_bytes + self.expert_cache_bytes

    def describe(self) -> str:
        parts = [
            f"resident weights {self.resident_bytes / GiB:.2f} GiB",
            f"KV cache {self.kv_bytes / GiB:.2f} GiB",
            f"workspace {self.workspace_bytes / GiB:.2f} GiB",
            f"expert cache {self.expert_slots}/{self.total_experts} slots = {self.expert_cache_bytes / GiB:.2f} GiB",
        ]
        if self.host_embedding:
            parts.append("embedding table in host RAM")
        if self.streamed_layers:
            parts.append(
                f"{len(self.streamed_layers)} layers ({self.streamed_bytes / GiB:.2f} GiB) streamed from host RAM, "
                f"{self.stream_ahead} ahead"
            )
        budget = f" of a {self.budget_bytes / GiB:.2f} GiB budget" if self.budget_bytes else ""
        return f"memory plan{budget}: " + ", ".join(parts)


@dataclass(frozen=True)
class PlanInputs:
    resident_bytes: int  # non-expert weights, all of them
    layer_bytes: dict[int, int]  # the streamable part of resident_bytes, per main decoder layer
    kv_bytes: int
    workspace_bytes: int
    expert_record_bytes: int
    total_experts: int
    top_k: int
    budget_bytes: int | None
    expert_cache_slots: int | None
    stream_ahead: int = 2
    stream_layers: int | None = None  # stream the N largest layers whatever the budget
    embed_bytes: int = 0  # the embedding table, if it may stay in host RAM (0: it may not, e.g. tied to the LM head)


def plan_memory(**inputs: Any) -> MemoryPlan:
    """Decide the expert-slot count (and layer streaming) for a VRAM budget or an explicit slot count
    (keyword arguments: the fields of `PlanInputs`)."""
    request = PlanInputs(**inputs)
    plan = _plan_slots(request)
    if request.stream_layers and not plan.streamed_layers:
        layer_bytes = request.layer_bytes
        chosen = _requested_layers(layer_bytes, request.stream_layers, request.stream_ahead)
        streamed = sum(layer_bytes[layer] for layer in chosen)
        plan.streamed_layers = sorted(chosen)
        plan.streamed_bytes = streamed
        plan.stream_ahead = request.stream_ahead
        plan.resident_bytes += ring_bytes([layer_bytes[layer] for layer in chosen], request.stream_ahead) - streamed
        plan.notes.append(
            f"{len(chosen)} layer(s) stream from host RAM as requested (stream_layers={request.stream_layers})"
        )
        if plan.budget_bytes is not None and plan.planned_vram_bytes > plan.budget_bytes:
            # the ring can hold more than the layers it replaced (few, unequal layers): fewer expert slots
            free = plan.budget_bytes - plan.kv_bytes - plan.workspace_bytes - plan.resident_bytes
            if free // plan.expert_record_bytes < request.top_k:
                raise RequestError(f"stream_layers={request.stream_layers} needs a ring larger than the layers it "
                                   f"streams, and the budget then cannot hold {request.top_k} expert slots")
            plan.expert_slots = int(free // plan.expert_record_bytes)
            plan.all_resident = False
    return plan


def ring_bytes(sizes: list[int], ahead: int) -> int:
    """VRAM of the streaming ring for streamed layers of these sizes: `ahead + 1` buffers (at most one per layer),
    each as large as the largest layer."""
    return min(ahead + 1, len(sizes)) * max(sizes, default=0)


def _plan_slots(request: PlanInputs) -> MemoryPlan:
    resident_bytes, layer_bytes, kv_bytes = request.resident_bytes, request.layer_bytes, request.kv_bytes
    workspace_bytes, expert_record_bytes = request.workspace_bytes, request.expert_record_bytes
    total_experts, top_k, budget_bytes = request.total_experts, request.top_k, request.budget_bytes
    expert_cache_slots, stream_ahead = request.expert_cache_slots, request.stream_ahead
    check_one_cache_size([name for name, value in (("expert_cache_slots", expert_cache_slots),
                                                   ("vram_budget", budget_bytes)) if value is not None])
    if expert_cache_slots is not None:
        if not isinstance(expert_cache_slots, int) or isinstance(expert_cache_slots, bool):
            raise RequestError(f"expert_cache_slots must be an integer, got {expert_cache_slots!r}")
        if expert_cache_slots < top_k:
            raise RequestError(
                f"expert_cache_slots={expert_cache_slots} cannot hold one layer's working set: a token needs "
                f"{top_k} experts per layer at once"
            )
        slots = min(expert_cache_slots, total_experts)
        plan = MemoryPlan(None, resident_bytes, kv_bytes, workspace_bytes, expert_record_bytes, total_experts, slots,
                          False)
        if expert_cache_slots > total_experts:
            plan.warnings.append(f"expert_cache_slots={expert_cache_slots} is more than the model's {total_experts} "
                              f"routed experts: {total_experts} slots, filled from host RAM as experts are first "
                              f"used (without a cache size every expert is loaded into VRAM up front)")
        return plan
    if budget_bytes is None:
        return MemoryPlan(
            None, resident_bytes, kv_bytes, workspace_bytes, expert_record_bytes, total_experts, total_experts, True
        )
    fixed = kv_bytes + workspace_bytes
    minimum_cache = top_k * expert_record_bytes
    plan = MemoryPlan(budget_bytes, resident_bytes, kv_bytes, workspace_bytes, expert_record_bytes, total_experts, 0, False)
    free = budget_bytes - fixed - resident_bytes
    if free < minimum_cache and request.embed_bytes:
        # first the embedding: a token reads one row of it, a few KiB over the link, where a streamed layer costs
        # its whole size every token
        resident_bytes -= request.embed_bytes
        free += request.embed_bytes
        plan.host_embedding = True
        plan.resident_bytes = resident_bytes
        plan.notes.append(f"the embedding table ({request.embed_bytes / GiB:.2f} GiB) stays in host RAM: each token "
                          "reads its row over PCIe")
    if free < minimum_cache:
        chosen, ring = _choose_streamed_layers(layer_bytes, budget_bytes - fixed - resident_bytes - minimum_cache,
                                               stream_ahead)
        streamed = sum(layer_bytes[layer] for layer in chosen)
        free = budget_bytes - fixed - (resident_bytes - streamed) - ring
        if free < minimum_cache:
            raise RequestError(
                f"vram_budget of {budget_bytes / GiB:.2f} GiB cannot hold one layer's working set: the KV cache "
                f"({kv_bytes / GiB:.2f} GiB), working space ({workspace_bytes / GiB:.2f} GiB), the unstreamable "
                f"weights and {top_k} expert slots ({minimum_cache / GiB:.3f} GiB) need more"
            )
        plan.streamed_layers = sorted(chosen)
        plan.streamed_bytes = streamed
        plan.stream_ahead = stream_ahead
        plan.resident_bytes = resident_bytes - streamed + ring
        plan.notes.append(
            f"the non-expert weights ({resident_bytes / GiB:.2f} GiB) do not fit next to the KV cache and a minimal "
            f"expert cache, so {len(chosen)} layer(s) ({streamed / GiB:.2f} GiB) stream from host RAM through a ring "
            f"of {min(stream_ahead + 1, len(chosen))} x {ring // max(min(stream_ahead + 1, len(chosen)), 1) / 2**20:.0f} MiB"
        )
    slots = int(free // expert_record_bytes)
    if slots >= total_experts:
        plan.expert_slots = total_experts
        plan.all_resident = not plan.streamed_layers
    else:
        plan.expert_slots = slots
    return plan


def _choose_streamed_layers(layer_bytes: dict[int, int], short: int, ahead: int) -> tuple[list[int], int]:
    """Layers to stream so that `short` bytes (negative: missing) are found, and the ring's bytes: the fewest streamed
    bytes (each costs link time every token) over every cap on the largest streamed layer, since the ring holds
    `ahead + 1` buffers of the largest one (one outsized layer, a dense MLP say, would make every buffer as large).
    Within a cap the largest layers go first. If nothing fits, the plan that comes closest."""
    best: tuple[int, int, list[int], int] | None = None  # (still missing, streamed bytes, layers, ring bytes)
    for cap in sorted(set(layer_bytes.values()), reverse=True):
        candidates = sorted((layer for layer in layer_bytes if layer_bytes[layer] <= cap),
                            key=lambda layer: -layer_bytes[layer])
        chosen: list[int] = []
        streamed = ring = 0
        for layer in candidates:
            if streamed - ring + short >= 0:
                break
            chosen.append(layer)
            streamed += layer_bytes[layer]
            ring = ring_bytes([layer_bytes[c] for c in chosen], ahead)
        missing = max(-(streamed - ring + short), 0)
        key = (missing, streamed, chosen, ring)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return [], 0
    return best[2], best[3]


def _requested_layers(layer_bytes: dict[int, int], count: int, ahead: int) -> list[int]:
    """`count` layers to stream that free the most VRAM: the largest under a cap on their size, over every cap (the
    ring holds `ahead + 1` buffers of the largest streamed layer, so an outsized one can cost more than it frees)."""
    best: tuple[int, list[int]] | None = None
    for cap in sorted(set(layer_bytes.values()), reverse=True):
        candidates = sorted((layer for layer in layer_bytes if layer_bytes[layer] <= cap),
                            key=lambda layer: -layer_bytes[layer])[:count]
        if len(candidates) < min(count, len(layer_bytes)):
            break  # fewer layers fit under smaller caps
        freed = sum(layer_bytes[layer] for layer in candidates) - ring_bytes([layer_bytes[c] for c in candidates],
                                                                              ahead)
        if best is None or freed > best[0]:
            best = (freed, candidates)
    return best[1] if best is not None else []
