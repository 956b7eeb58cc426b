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


# ---- 4-bit groups ---------------------------------------------------------------------------------------------------
# Layout of a 4-bit weight [M, N] (N = the input features, the reduction dimension): codes 0..15 packed two to a byte
# along N (element 2j in the low nibble of byte j, 2j+1 in the high one), uint8 [M, N/2]; one fp32 scale per row and
# group of `group` consecutive inputs, [M, ceil(N/group)]; when asymmetric also one fp32 zero point per group (an
# integer value, as GPTQ and compressed-tensors store them), symmetric codes have zero point 8. (An expert record
# stores both in its `scale_dtype`, fp16 by default: integers 0..15 are exact there.) The weight is
#     W[m, n] = (code[m, n] - zero[m, n // group]) * scale[m, n // group]
# which is exact in fp32 for the (code - zero) part, so a kernel and this reference compute the same bits.

INT4_SYMMETRIC_ZERO = 8.0


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., N] in 0..15 (N even) -> uint8 [..., N/2], element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit rows need an even number of elements, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N/2] -> uint8 codes [..., N]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _group_view(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[M, N] fp32 -> [M, ceil(N/group), group], the ragged last group padded by repeating its last column (so the
    padding changes neither its min, its max nor its absolute maximum)."""
    rows, cols = weight.shape
    groups = -(-cols // group)
    pad = groups * group - cols
    if pad:
        weight = torch.cat((weight, weight[:, -1:].expand(rows, pad)), dim=1)
    return weight.view(rows, groups, group)


def stored_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """fp32 scales as they will be stored in `scale_dtype` (kept within its normal range, so none is zero or
    infinite there), back in fp32: the quantiser codes weights with the scale the kernels will read."""
    info = torch.finfo(scale_dtype)
    return scale.clamp(min=max(info.tiny, 1e-12), max=info.max).to(scale_dtype).float()


def quantize_int4_groups(weight: torch.Tensor, group: int = 128, symmetric: bool = False,
                         scale_dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest 4-bit groups: weight [M, N] -> (packed uint8 [M, N/2], fp32 scales [M, G], fp32 zero points
    [M, G] or None when symmetric). Asymmetric groups span [min, max] with 16 levels (an integer zero point);
    symmetric ones span [-amax, amax] with codes -7..7 around 8. The scales are exactly representable in
    `scale_dtype` (the dtype a record stores them in), and the codes are computed with those rounded scales."""
    rows, cols = weight.shape
    grouped = _group_view(weight.float(), group)
    if symmetric:
        scale = stored_scale(grouped.abs().amax(dim=2) / 7.0, scale_dtype)
        zero = None
        codes = torch.round(grouped / scale[..., None]).clamp(-8, 7) + INT4_SYMMETRIC_ZERO
    else:
        low = grouped.amin(dim=2).clamp(max=0.0)  # the range includes 0, so a zero weight stays exactly zero
        high = grouped.amax(dim=2).clamp(min=0.0)
        scale = stored_scale((high - low) / 15.0, scale_dtype)
        zero = torch.round(-low / scale).clamp(0, 15)
        codes = (torch.round(grouped / scale[..., None]) + zero[..., None]).clamp(0, 15)
    codes = codes.flatten(1)[:, :cols].to(torch.uint8)
    return pack_nibbles(codes), scale, zero


def dequantize_int4_groups(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [..., M, N/2] with scales (and zero points) [..., M, G] -> out_dtype [..., M, N], in fp32."""
    codes = unpack_nibbles(packed).float()
    cols = codes.shape[-1]
    full_scale = scale.float().repeat_interleave(group, dim=-1)[..., :cols]
    full_zero = INT4_SYMMETRIC_ZERO if zero is None else zero.float().repeat_interleave(group, dim=-1)[..., :cols]
    return ((codes - full_zero) * full_scale).to(out_dtype)
