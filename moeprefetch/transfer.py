"""CUDA streams and events: the only module that creates or waits on them.

- `TransferEngine`: host->device copies into a ring of slots on two copy streams (`demand`, high priority, and
  `prefetch`), used by layer streaming and prefill's staging. Per slot, `ready` is recorded after the copy into it
  and `free` after the last compute that read it; a copy into a slot first waits for both, so a slot is never
  overwritten while a kernel may still read it. The same calls work inside a CUDA graph capture (between `fork()`
  and `join()`): the events become the graph's edges, and waits are timed by a device clock instead of events.
- `SideStream`: the branch of a decode step on which prefetch fills run beside the layers (residency/).

On the CPU the same interfaces run synchronously, so everything above them runs unchanged in CI.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .kernels import kernels_usable
from .kernels.clock import StallClock


@dataclass
class StallTimer:
    """Compute-stream time spent waiting for copies, measured with CUDA events (or wall time on the CPU)."""

    pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    cpu_seconds: float = 0.0

    clock: StallClock | None = None  # waits inside CUDA graphs (replays record no events)

    def collect(self) -> float:
        """Seconds stalled since the last collect (synchronises on the recorded events)."""
        total = self.cpu_seconds + (self.clock.take_seconds() if self.clock is not None else 0.0)
        for start, end in self.pairs:
            end.synchronize()
            total += start.elapsed_time(end) / 1000.0
        self.pairs.clear()
        self.cpu_seconds = 0.0
        return total


class TransferEngine:
    """Copies packed expert records from the host store into device slots and orders compute after them."""

    def __init__(self, device: torch.device, n_slots: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stall = StallTimer()
        if self.cuda:
            low, high = torch.cuda.Stream.priority_range()
            self.demand_stream = torch.cuda.Stream(device=device, priority=high)
            self.prefetch_stream = torch.cuda.Stream(device=device, priority=low)
            self._ready: list[torch.cuda.Event | None] = [None] * n_slots
            self._free: list[torch.cuda.Event | None] = [None] * n_slots
            if kernels_usable(device.type):
                self.stall.clock = StallClock(device)

    def _capturing(self) -> bool:
        return self.cuda and torch.cuda.is_current_stream_capturing()

    # ---- copies ---------------------------------------------------------------------------------------------------
    def copy(self, src: torch.Tensor, dst: torch.Tensor, slot: int, demand: bool) -> None:
        """Copy one record into `slot`. Asynchronous on CUDA; timed as stall on the CPU when it is a demand."""
        if not self.cuda:
            start = time.perf_counter()
            dst.copy_(src)
            if demand:
                self.stall.cpu_seconds += time.perf_counter() - start
            return
        stream = self.demand_stream if demand else self.prefetch_stream
        for event in (self._free[slot], self._ready[slot]):
            if event is not None:
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        self._ready[slot] = ready

    def follow_compute(self) -> None:
        """Later copies start after the work enqueued so far on the compute stream (copies out of VRAM that it
        may still be writing)."""
        if self.cuda:
            self.demand_stream.wait_stream(torch.cuda.current_stream(self.device))

    def is_ready(self, slot: int) -> bool:
        """Host-side, non-blocking: has the last copy into `slot` landed?"""
        if not self.cuda:
            return True
        event = self._ready[slot]
        return event is None or event.query()

    def wait_for(self, slots: list[int]) -> None:
        """Make the compute stream wait until every listed slot's copy has landed; time the wait."""
        if not self.cuda:
            return
        if self._capturing():  # a replay cannot ask whether a copy has landed: always wait, timed on the device
            events = [self._ready[s] for s in slots if self._ready[s] is not None]
            if not events:
                return
            compute = torch.cuda.current_stream(self.device)
            clock = self.stall.clock
            if clock is not None:
                clock.start()
            for event in events:
                compute.wait_event(event)
            if clock is not None:
                clock.stop()
            return
        pending = [self._ready[s] for s in slots if self._ready[s] is not None and not self._ready[s].query()]
        if not pending:
            return
        compute = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        for event in pending:
            compute.wait_event(event)
        end.record(compute)
        self.stall.pairs.append((start, end))

    def release(self, slots: list[int]) -> None:
        """Record, after the kernels just enqueued on the compute stream, that these slots may be overwritten."""
        if not self.cuda or not slots:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        for slot in slots:
            self._free[slot] = done

    def fork(self) -> None:
        """The start of a captured step: both copy streams continue after the compute stream's work so far (which
        joins them to the capture), and events of earlier steps are forgotten (a capture may only wait on its own
        events; `join()` before the step ordered everything earlier ahead of it)."""
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        for stream in (self.demand_stream, self.prefetch_stream):
            stream.wait_stream(compute)
        if self._capturing():
            self.forget()

    def forget(self) -> None:
        """Drop the slots' events (after `synchronize()`, or at the start of a capture): no later copy or wait
        refers to them."""
        if self.cuda:
            self._ready = [None] * len(self._ready)
            self._free = [None] * len(self._free)

    def join(self) -> None:
        """The compute stream waits for every copy issued so far (the end of a captured step, or before one)."""
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        for stream in (self.demand_stream, self.prefetch_stream):
            compute.wait_stream(stream)

    def synchronize(self) -> None:
        if self.cuda:
            self.demand_stream.synchronize()
            self.prefetch_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def collect_stall_seconds(self) -> float:
        return self.stall.collect()


class SideStream:
    """Work that runs beside the compute stream inside one decode step: launched after an event of the compute
    stream, joined at the end of the step. Captured into the step's CUDA graph as a parallel branch with event edges.
    On the CPU the work simply runs inline, in order."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._forked = False

    def launch(self, work) -> None:
        """Run `work()` on the side stream after everything enqueued so far on the compute stream."""
        if not self.cuda:
            work()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._forked = True
        with torch.cuda.stream(self.stream):
            work()

    def join(self) -> None:
        """The compute stream waits for every side launch so far (the end of a step)."""
        if self.cuda and self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._forked = False
