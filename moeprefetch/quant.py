"""Block-scaled weight formats: FP8 e4m3 (DeepSeek-V3 checkpoints) and int8, with 2-D block scales.

Layout (DeepSeek-V3 README_WEIGHTS): a weight [M, N] carries `scale_inv` of shape [ceil(M/br), ceil(N/bc)] in fp32 and
W[m, n] = W8[m, n] * scale_inv[m // br, n // bc]. Ragged edge blocks (e.g. 576 rows with 128-row blocks) are scaled by
the last block's scale; the padding that produced it is simply not stored.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
INT8_MAX = 127.0


def scale_grid_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return (-(-rows // block[0]), -(-cols // block[1]))


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(M/br), ceil(N/bc)] scales -> [M, N], cropping the ragged edge."""
    return scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]


def dequantize_blocks(
    payload: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype
) -> torch.Tensor:
    """FP8 or int8 payload [M, N] with block scales -> out_dtype [M, N], computed in fp32."""
    rows, cols = payload.shape[-2:]
    expected = scale_grid_shape(rows, cols, block)
    if tuple(scale.shape[-2:]) != expected:
        raise ValueError(f"block scales have shape {tuple(scale.shape)}, expected {expected} for a [{rows}, {cols}] weight")
    full = expand_block_scales(scale.float(), rows, cols, block)
    return (payload.float() * full).to(out_dtype)


def _block_amax(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = weight.shape
    gr, gc = scale_grid_shape(rows, cols, block)
    padded = weight.new_zeros(gr * block[0], gc * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float().abs()
    return padded.view(gr, block[0], gc, block[1]).amax(dim=(1, 3))


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [M, N] -> (fp8 payload [M, N], fp32 scale_inv [ceil(M/br), ceil(N/bc)])."""
    amax = _block_amax(weight, block)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    full = expand_block_scales(scale, *weight.shape, block)
    payload = (weight.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return payload, scale


def quantize_int8_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per block: weight [M, N] -> (int8 [M, N], fp32 scales)."""
    amax = _block_amax(weight, block)
    scale = (amax / INT8_MAX).clamp(min=1e-12)
    full = expand_block_scales(scale, *weight.shape, block)
    payload = torch.round(weight.float() / full).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return payload, scale
