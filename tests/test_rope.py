"""rope: inverse frequencies against transformers' own RoPE and YaRN functions (the checkpoints' reference), and the
rotation against a float64 rotation of pairs, on randomized inputs and settings."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moeprefetch.config import RopeArgs
from moeprefetch.rope import RotaryEmbedding, inverse_frequencies


def transformers_frequencies(rope: RopeArgs, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and attention factor for the same settings (its YaRN function reads a
    config; this one carries only what it reads)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type == "yarn":
        params.update(factor=rope.factor, original_max_position_embeddings=rope.original_max_position_embeddings,
                      beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, mscale=rope.mscale,
                      mscale_all_dim=rope.mscale_all_dim, attention_factor=rope.attention_factor,
                      truncate=rope.truncate)
        config = SimpleNamespace(rope_parameters=params, head_dim=dim, hidden_size=dim, num_attention_heads=1,
                                 max_position_embeddings=max_positions, standardize_rope_params=lambda: None)
        return ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    base = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    return (1.0 / rope.theta**base).float(), 1.0


@pytest.mark.parametrize("seed", range(6))
def test_inverse_frequencies_match_transformers(seed):
    """DeepSeek-V2/V3-like YaRN settings (with and without mscale pairs, truncation, a given attention factor) and
    default RoPE, drawn at random."""
    pytest.importorskip("transformers")
    generator = torch.Generator().manual_seed(seed)
    draw = lambda options: options[int(torch.randint(len(options), (1,), generator=generator))]  # noqa: E731
    dim = draw([16, 32, 64, 128])
    if seed == 0:
        rope = RopeArgs(theta=draw([10000.0, 500000.0]))
    else:
        mscale = draw([None, 0.707, 1.0])
        rope = RopeArgs(theta=draw([10000.0, 50000.0]), rope_type="yarn", factor=draw([4.0, 16.0, 40.0]),
                        original_max_position_embeddings=draw([2048, 4096]), beta_fast=draw([32.0, 16.0]),
                        beta_slow=draw([1.0, 2.0]), mscale=mscale, mscale_all_dim=mscale,
                        attention_factor=draw([None, None, 1.25]), truncate=draw([True, False]))
    ours, factor = inverse_frequencies(rope, dim)
    theirs, their_factor = transformers_frequencies(rope, dim, 163840)
    assert ours.shape == (dim // 2,)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(their_factor, rel=1e-12)


def float64_rotation(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, factor: float,
                     interleave: bool) -> torch.Tensor:
    """Each pair (x_2i, x_2i+1) (interleaved) or (x_i, x_i+d/2) rotated by position x frequency i, in float64, laid out
    as [first halves, second halves]."""
    x = x.double()
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    angle = positions.double()[..., None] * inv_freq.double()
    cos, sin = angle.cos() * factor, angle.sin() * factor
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_the_rotation_matches_float64_pairs_and_keeps_relative_positions(interleave, rope_type):
    generator = torch.Generator().manual_seed(3)
    rope = RopeArgs(rope_type=rope_type, factor=40.0, mscale=0.707, mscale_all_dim=0.707, interleave=interleave)
    dim = 64
    emb = RotaryEmbedding(rope, dim, torch.device("cpu"))
    x = torch.randn(5, 7, dim, generator=generator)
    positions = torch.randint(0, 100_000, (5, 7), generator=generator)
    cos, sin = emb.cos_sin(positions)
    got = emb.apply(x, cos, sin)
    expected = float64_rotation(x, positions, emb.inv_freq, emb.attention_factor, interleave)
    # fp32 angles at positions up to 1e5 carry ~1e-2 rad of rounding: compare at a tolerance that still fails on a
    # wrong pair layout, sign or frequency
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-2 * emb.attention_factor * x.abs().max())
    # q and k rotated to positions m and n: their dot product depends on m - n alone (what attention sees)
    q, k = torch.randn(dim, generator=generator), torch.randn(dim, generator=generator)

    def dot(m: int, n: int) -> float:
        cq, sq = emb.cos_sin(torch.tensor([m]))
        ck, sk = emb.cos_sin(torch.tensor([n]))
        return float(emb.apply(q[None], cq, sq)[0].double() @ emb.apply(k[None], ck, sk)[0].double())

    for shift in (1, 17, 300):
        assert dot(40 + shift, 40) == pytest.approx(dot(900 + shift, 900), rel=1e-4, abs=1e-4)
    assert not math.isclose(dot(41, 40), dot(57, 40), rel_tol=1e-3)  # and it does depend on m - n
