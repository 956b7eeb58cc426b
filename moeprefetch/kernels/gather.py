"""Embedding rows read straight from page-locked host memory (zero-copy), for budgets too small for the table.

An embedding table is the largest non-expert tensor of most models (0.4 GB for V2-Lite, 1.9 GB for DeepSeek-V3), yet
a decode step reads one row of it per token. When the planner leaves the table in pinned host memory, this kernel
reads the step's rows over PCIe (through unified addressing, the host pointer is valid on the device): a few KiB per
token, inside the step's CUDA graph, with no host decision. The definition is `F.embedding` on the host table.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import HAS_TRITON, Launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_kernel(ids_ptr, anchor_ptr, delta_ptr, out_ptr, H: tl.constexpr, BLOCK: tl.constexpr):
        """out[t] = table[ids[t]], the table at anchor_ptr + delta (elements): one program per (token, block of H)."""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        row = tl.load(ids_ptr + t).to(tl.int64)
        delta = tl.load(delta_ptr)
        values = tl.load(anchor_ptr + delta + row * H + cols, mask=mask)
        tl.store(out_ptr + t.to(tl.int64) * H + cols, values, mask=mask)


GATHER_BLOCK = 1024


def embedding_reference(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The definition: the rows, looked up where the table lives, on the tokens' device."""
    return F.embedding(tokens.to(table.device), table).to(tokens.device)


class HostRows:
    """An embedding table [V, H] in pinned host memory, read row by row from `device` (token ids there -> rows
    there). The kernel reads through a fixed device anchor and the table's distance from it, so a launch captured in
    a CUDA graph stays valid."""

    def __init__(self, table: torch.Tensor, device: torch.device, use_kernel: bool,
                 unpin: Callable[[], None] | None = None):
        """`unpin`: the table's page-lock undone (given when the caller pinned it: a GPU reads only pinned memory);
        `close` calls it."""
        self.table = table
        self.device = device
        self.pinned = unpin is not None
        self._unpin = unpin
        self.use_kernel = use_kernel and (self.pinned or device.type == "cpu")  # the CPU (interpreter) reads it too
        if self.use_kernel:
            self._anchor = torch.zeros(1, dtype=table.dtype, device=device)
            distance = table.data_ptr() - self._anchor.data_ptr()
            assert distance % table.element_size() == 0
            self._delta = torch.tensor([distance // table.element_size()], dtype=torch.int64, device=device)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.use_kernel:
            return embedding_reference(self.table, tokens)
        h = self.table.shape[1]
        flat = tokens.reshape(-1).contiguous()
        out = torch.empty(flat.shape[0], h, dtype=self.table.dtype, device=tokens.device)
        if flat.shape[0]:
            gather_launch(flat, self._anchor, self._delta, out)()
        return out.view(*tokens.shape, h)

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self.pinned = False


def gather_launch(ids: torch.Tensor, anchor: torch.Tensor, delta: torch.Tensor, out: torch.Tensor) -> Launch:
    h = out.shape[1]
    return Launch(_gather_kernel, (ids.shape[0], -(-h // GATHER_BLOCK)), num_warps=4, num_stages=1, ids_ptr=ids,
                  anchor_ptr=anchor, delta_ptr=delta, out_ptr=out, H=h, BLOCK=GATHER_BLOCK)
