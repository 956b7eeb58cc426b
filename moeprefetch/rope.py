"""Rotary position embeddings: default RoPE and YaRN (as DeepSeek-V2/V3 configure it in Hugging Face format)."""

from __future__ import annotations

import math

import torch

from .config import RopeArgs, yarn_mscale
from .kernels.definitions import rotate


def _yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original: int, truncate: bool):
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inverse_frequencies(rope: RopeArgs, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention_factor) — the factor multiplies cos and sin."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = rope.theta**exponents
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp in between.
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    low, high = _yarn_correction_range(
        rope.beta_fast, rope.beta_slow, dim, rope.theta, rope.original_max_position_embeddings, rope.truncate
    )
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # share of the extrapolated (unscaled) frequency
    inv_freq = interpolation * (1.0 - keep) + extrapolation * keep
    if rope.attention_factor is not None:
        factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        factor = yarn_mscale(rope.factor)
    return inv_freq, factor


class RotaryEmbedding:
    """Precomputed per-position cos/sin; `apply` rotates the last dim of q_rope / k_rope."""

    def __init__(self, rope: RopeArgs, dim: int, device: torch.device):
        inv_freq, self.attention_factor = inverse_frequencies(rope, dim)
        self.inv_freq = inv_freq.to(device)
        self.interleave = rope.interleave
        self.dim = dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int -> cos, sin [..., dim/2] fp32 (already scaled by the attention factor)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., dim]; cos/sin broadcastable to [..., dim/2]. Computed in fp32, returned in x.dtype.

        For interleaved checkpoints the pairs (x0, x1), (x2, x3)... are rotated and the result is laid out
        de-interleaved ([all first halves, all second halves]); q and k get the same layout, so their dot products
        are those of the interleaved rotation.
        """
        return rotate(x, cos, sin, self.interleave)


