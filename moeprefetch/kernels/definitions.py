"""The plain torch definitions that both the model and the kernels' references compute: one expert's FFN and the
rotary rotation. They live here, below everything, so that `kernels/` imports nothing else of the project (the
model's modules import these from here, not the other way round)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Callable) -> torch.Tensor:
    """One expert on the tokens routed to it: x [M, H], gate_up [2I, H], down [H, I] -> [M, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The rotary rotation of `rope.RotaryEmbedding.apply` (also the definition the fused decode kernels are tested
    against): x [..., d], cos/sin broadcastable to [..., d/2]; fp32 inside, x's dtype out. Interleaved pairs
    (x0, x1), (x2, x3)... come out de-interleaved ([all first halves, all second halves])."""
    xf = x.float()
    half = x.shape[-1] // 2
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleave else (xf[..., :half], xf[..., half:])
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
