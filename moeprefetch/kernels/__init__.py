"""Triton kernels of the device-driven decode, each next to the pure-torch reference that defines it.

- `experts.py`: routed experts read in place through the residency table (a VRAM slot, or the pinned host arena over
  PCIe), with admission of a missed expert into a victim slot as it streams;
- `grouped.py`, `attention.py`, `gqa_attention.py`, `norm.py`, `router.py`, `gather.py`, `clock.py`: prefill's grouped
  experts and the decode layer's fused pieces;
- `sampling.py`: the sampler's Gumbel noise and its arg-max in one pass;
- `tiles.py` and `tiles.json`: the expert kernels' tile choices as data, each with the measurement behind it.

The residency table's own kernels (the per-layer plan and the prefetch fills) live beside their torch reference in
`residency/` (`plan_kernel.py`, `fill.py`): they read and write the table, these kernels only the tensors they are
given.

These modules import nothing else of the project: the plain math that the model and the references share (one
expert's FFN, the rotary rotation) lives here in `definitions.py`, and a record format is read only through its
attributes.

Triton ships with torch's CUDA builds. Without it (or on the CPU) the engine runs the references, which are the
definitions the kernels are tested against. `TRITON_INTERPRET=1` runs the kernels on CPU tensors for tests.
"""

from __future__ import annotations

import os

try:  # Triton is optional on the CPU; the CUDA builds of torch ship it
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_usable(device_type: str) -> bool:
    """Whether the engine runs the Triton kernels on this device type: on CUDA. On the CPU the engine runs the
    references (the interpreter is for testing the kernels' logic, and far too slow to serve)."""
    return HAS_TRITON and device_type == "cuda" and not INTERPRET


class Launch:
    """One kernel launch: the jit function, its grid and its named arguments (also what compile checks use)."""

    def __init__(self, kernel, grid: tuple[int, ...], num_warps: int = 4, num_stages: int = 3, **args):
        self.kernel, self.grid, self.num_warps, self.num_stages, self.args = kernel, grid, num_warps, num_stages, args

    def __call__(self) -> None:
        self.kernel[self.grid](**self.args, num_warps=self.num_warps, num_stages=self.num_stages)
