"""Layer streaming: non-expert layer weights kept in host RAM and copied into a small VRAM ring ahead of compute.

When even attention, dense layers and shared experts exceed the budget (DeepSeek-V3's are ~20 GB in bf16), the planner
picks layers to stream. Each such layer's tensors are packed into one page-locked host record (one DMA per layer). A
ring of `ahead + 1` VRAM buffers holds the layer being computed and the next `ahead` streamed layers; layer i of the
streamed list always lives in ring slot i mod (ahead + 1), so its weight views never move. Copies and their ordering
go through a `TransferEngine` (ready / free events per ring slot), like expert copies.

A decode step with streamed layers is captured into its CUDA graph like any other: the copies become graph nodes on
the copy streams, ordered by the ready / free events, so layer i + k streams while layer i computes, and the last
streamed layers of a step copy the next step's first ones into the slots they free (which hides those copies behind
the step's tail: the remaining layers, the LM head and sampling). The host's view of the ring (`occupant`) must
match what a replay assumes: a capture records the ring's state at entry and exit (`RingStep`); before a replay the
ring is brought to the entry state if anything else used it meanwhile (prefill, an interrupted call), and after it
the host's view becomes the exit state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Callable

import torch

from .store import check_host_ram, register_pinned, unpin_when_freed
from .transfer import TransferEngine
from .weights import LayerWeights, iter_tensors, projection_groups

logger = logging.getLogger(__name__)

ALIGN = 512  # as the caching allocator aligns: a tensor's alignment, which can steer cuBLAS, matches a resident one's


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of a weights dataclass (recursively) with every tensor replaced by fn(tensor)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_tensors(item, fn) for item in obj]
    if obj is not None and is_dataclass(obj):
        return replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn) for f in fields(obj)})
    return obj


@dataclass(frozen=True)
class RingStep:
    """What one captured step does to the ring: the occupants it starts from and ends with, and the bytes it
    copies per replay."""

    entry: tuple[int | None, ...]
    exit: tuple[int | None, ...]
    bytes_copied: int


class LayerStreamer:
    def __init__(self, layers: list[LayerWeights], device: torch.device, ahead: int, pin: bool):
        """`layers`: the streamed layers' weights on the CPU, in execution order."""
        self.order = [lw.index for lw in layers]
        self.position = {index: i for i, index in enumerate(self.order)}
        self.ring_size = min(ahead + 1, len(layers))
        self.device = device
        layouts = [self._layout(lw) for lw in layers]
        self.layer_bytes = [size for _, size in layouts]  # each layer's own record (a copy moves only these)
        self.kept_bytes = sum(t.numel() * t.element_size() for lw in layers for t in iter_tensors(lw)
                              if id(t) in self._kept_resident(lw))  # routers and their norms, in VRAM
        self.record_bytes = max(self.layer_bytes)  # a host row and a ring buffer hold the largest
        check_host_ram(self.record_bytes * len(layers), f"{len(layers)} streamed layers")
        self.host = torch.empty((len(layers), self.record_bytes), dtype=torch.uint8)
        for row, (lw, (offsets, _)) in enumerate(zip(layers, layouts)):
            for tensor in iter_tensors(lw):
                if id(tensor) in offsets:
                    offset, n = offsets[id(tensor)], tensor.numel() * tensor.element_size()
                    self.host[row, offset : offset + n].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        self.pinned = pin and register_pinned(self.host).pinned
        self._unpin = unpin_when_freed(self.host) if self.pinned else None
        self.ring = torch.empty((self.ring_size, self.record_bytes), dtype=torch.uint8, device=device)
        self.transfer = TransferEngine(device, self.ring_size)
        self.occupant: list[int | None] = [None] * self.ring_size
        self.in_use: list[bool] = [False] * self.ring_size  # between begin() and end() of its occupant
        self.bytes_copied = 0
        self.layers = [self._views(lw, offsets, i % self.ring_size) for i, (lw, (offsets, _)) in
                       enumerate(zip(layers, layouts))]
        logger.info("streaming %d layers (%.2f GiB) through a ring of %d x %.1f MiB", len(layers),
                    self.host.numel() / 1024**3, self.ring_size, self.record_bytes / 1024**2)

    @staticmethod
    def _layout(lw: LayerWeights) -> tuple[dict[int, int], int]:
        """Byte offset of each tensor (by id) in the layer's record, and the record's size. Each group of
        projections that decode fuses (`projection_groups`) comes first, its weights back to back, so the fused
        GEMV reads them through one view as it reads a resident layer's concatenated weight; every group and other
        tensor starts on an ALIGN boundary."""
        offsets: dict[int, int] = {}
        offset = 0

        def align(n: int) -> int:
            return -(-n // ALIGN) * ALIGN

        for _, group in projection_groups(lw):
            if any(p.bias is not None for p in group):
                continue
            for part in group:
                offsets[id(part.weight)] = offset
                offset += part.weight.numel() * part.weight.element_size()
            offset = align(offset)
        kept = LayerStreamer._kept_resident(lw)
        for tensor in iter_tensors(lw):
            if id(tensor) not in offsets and id(tensor) not in kept:
                offsets[id(tensor)] = offset
                offset = align(offset + tensor.numel() * tensor.element_size())
        return offsets, offset

    def _views(self, lw: LayerWeights, offsets: dict[int, int], slot: int) -> LayerWeights:
        def view(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in offsets:  # kept in VRAM (`_kept_resident`)
                return tensor.to(self.device)
            offset, n = offsets[id(tensor)], tensor.numel() * tensor.element_size()
            return self.ring[slot, offset : offset + n].view(tensor.dtype).view(tensor.shape)

        return _map_tensors(lw, view)

    @staticmethod
    def _kept_resident(lw: LayerWeights) -> set[int]:
        """Tensors of a streamed layer that stay in VRAM: its router and the norm before it. Predictors route with
        layers ahead of the one computing (next_layer_gate) or with every layer (mtp_router), at times when the
        layer's ring slot may hold another layer or be mid-copy; they are a few hundred KiB per layer."""
        kept = {id(t) for t in iter_tensors(lw.router)} if lw.router is not None else set()
        return kept | {id(lw.post_attention_norm)}

    def streams(self, layer: int) -> bool:
        return layer in self.position

    def _load(self, i: int, demand: bool) -> None:
        slot = i % self.ring_size
        if self.occupant[slot] == self.order[i] or self.in_use[slot]:
            return  # already there, or its slot still serves a layer being computed
        size = self.layer_bytes[i]
        self.transfer.copy(self.host[i, :size], self.ring[slot, :size], slot, demand=demand)
        self.occupant[slot] = self.order[i]
        self.bytes_copied += size

    def begin(self, layer: int) -> None:
        """Before computing `layer`: its weights are (or are made) resident; the next layers start streaming."""
        i = self.position[layer]
        self._load(i, demand=True)
        self.in_use[i % self.ring_size] = True
        self.transfer.wait_for([i % self.ring_size])
        n = len(self.order)
        for k in range(1, self.ring_size):  # the next layers, into slots whose layers are done
            target = (i + k) % n
            occupant = self.occupant[target % self.ring_size]
            if occupant is not None and occupant != self.order[target] \
                    and 0 < (self.position[occupant] - i) % n < k:
                break  # the slot holds a layer needed sooner (the order wraps past a slot's turn): leave it
            self._load(target, demand=False)

    def end(self, layer: int) -> None:
        """After the kernels that read `layer`'s weights are enqueued: its ring slot may be refilled after them."""
        slot = self.position[layer] % self.ring_size
        self.transfer.release([slot])
        self.in_use[slot] = False

    def abort(self) -> None:
        """After an interrupted step: nothing is being computed any more, and a copy may have been cut short, so
        every ring slot is reloaded on its next use."""
        self.transfer.synchronize()
        self.transfer.forget()  # a failed capture may have left events that belong to no graph
        self.in_use = [False] * self.ring_size
        self.occupant = [None] * self.ring_size

    @property
    def ring_bytes(self) -> int:
        return self.ring.numel()

    # ---- steps as CUDA graphs --------------------------------------------------------------------------------------
    def enter_step(self, captured: RingStep | None = None) -> None:
        """Host side, before a decode step runs (eagerly, captured or replayed): for a replay, the ring is brought to
        the state its capture started from; every copy issued earlier is ordered before the step."""
        if captured is not None:
            for slot, layer in enumerate(captured.entry):
                if layer is not None and self.occupant[slot] != layer:
                    self._load(self.position[layer], demand=True)
        self.transfer.join()

    def fork(self) -> None:
        """The step's first device work: the copy streams join it (inside a capture, the graph)."""
        self.transfer.fork()

    def join(self) -> None:
        """The step's last device work: it ends after its copies (a capture must join every stream it forked)."""
        self.transfer.join()

    def begin_capture(self) -> tuple[tuple[int | None, ...], int]:
        return tuple(self.occupant), self.bytes_copied

    def end_capture(self, start: tuple[tuple[int | None, ...], int]) -> RingStep:
        """The capture ran the step's host logic once without copying anything: the bytes it counted are each
        replay's."""
        entry, bytes_before = start
        step = RingStep(entry, tuple(self.occupant), self.bytes_copied - bytes_before)
        self.bytes_copied = bytes_before
        self.transfer.forget()  # the events it recorded belong to the graph: outside it they cannot be waited on
        return step

    def replayed(self, step: RingStep) -> None:
        """After a replay was launched: the host's view follows it, and later copies (a prefill's, say) come after
        it, since no event of the graph is visible outside it."""
        self.occupant = list(step.exit)
        self.bytes_copied += step.bytes_copied
        self.transfer.fork()

    def close(self) -> None:
        """Wait for every copy, unpin the host records and drop the VRAM ring (the layers' views go with the
        engine's weights)."""
        self.transfer.synchronize()
        if self._unpin is not None:
            self._unpin()
            self.pinned = False
        self.ring = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.layers = []
