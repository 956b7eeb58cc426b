"""A stall clock on the device: how long the compute stream waited, measurable inside a CUDA graph.

CUDA events with timing cannot be recorded in a graph capture, so a replayed decode step cannot time its waits with
them. Instead, one single-thread kernel stamps the device's global timer just before a wait, and another adds the
time since that stamp to a running total just after it; the host reads the total once per call. The pair brackets
exactly the time the compute stream spent waiting (plus one tiny launch).

The definition is the host's clock around a synchronous wait (the CPU path, `StallTimer.cpu_seconds`); the GPU test
checks the kernels against a wait of known length.
"""

from __future__ import annotations

import torch

from . import HAS_TRITON, Launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _stamp_kernel(clock_ptr, ADD: tl.constexpr):
        """clock[0] = now (ADD False), or clock[1] += now - clock[0] (ADD True); nanoseconds of %globaltimer."""
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)
        if ADD:
            start = tl.load(clock_ptr)
            tl.store(clock_ptr + 1, tl.load(clock_ptr + 1) + (now - start))
        else:
            tl.store(clock_ptr, now)


class StallClock:
    """[last stamp, total waited] in nanoseconds, on one CUDA device; `start()` and `stop()` bracket a wait on the
    current stream (eagerly or captured)."""

    def __init__(self, device: torch.device):
        self.clock = torch.zeros(2, dtype=torch.int64, device=device)
        # compiled and loaded now, not at its first launch, which may be inside a graph capture
        self.start()
        self.stop()
        self.clock.zero_()
        self.used = False

    def start(self) -> None:
        stamp_launch(self.clock, add=False)()
        self.used = True

    def stop(self) -> None:
        stamp_launch(self.clock, add=True)()

    def take_seconds(self) -> float:
        """Seconds waited since the last take (reads the device: call it once per generate call, not per step)."""
        if not self.used:
            return 0.0
        total = int(self.clock[1])
        self.clock[1] = 0
        return total / 1e9


def stamp_launch(clock: torch.Tensor, add: bool) -> Launch:
    return Launch(_stamp_kernel, (1,), num_warps=1, num_stages=1, clock_ptr=clock, ADD=add)
