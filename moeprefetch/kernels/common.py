"""Small Triton helpers shared by the kernels (only imported where Triton is available)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """a [M, K] @ b [K, N] in fp32. IEEE keeps fp32 operands exact (no TF32); DOT_F32 upcasts first, because the
    interpreter's dot reads bf16 bits wrongly."""
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def activate(g, ACT: tl.constexpr):
    """The MLP activation in fp32: 0 silu, 1 relu, 2 tanh-approximated GELU."""
    if ACT == 0:
        out = g * tl.sigmoid(g)
    elif ACT == 1:
        out = tl.maximum(g, 0.0)
    else:  # tanh(y) = 2 sigmoid(2y) - 1
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        out = 0.5 * g * (2.0 * tl.sigmoid(2.0 * y))
    return out


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())
