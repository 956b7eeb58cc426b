"""Token selection: greedy, or temperature / top-k / top-p sampling with per-token seeded noise.

Each sampled token uses noise seeded by (seed, sequence index, position), so the token drawn at a position depends only
on its logits: batched and one-by-one generation, and speculative and plain decoding, draw the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise RequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if (
            not isinstance(self.top_p, (int, float))
            or isinstance(self.top_p, bool)
            or not math.isfinite(self.top_p)
            or not 0 < self.top_p <= 1
        ):
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise RequestError(f"seed must be an integer, got {self.seed!r}")


def _mix(seed: int, row: int, position: int) -> int:
    # splitmix-style mixing so neighbouring (row, position) pairs get unrelated streams
    z = (seed * 0x9E3779B97F4A7C15 + row * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 -> temperature-scaled logits with tokens outside top-k / top-p set to -inf."""
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample(logits: torch.Tensor, params: SamplingParams, rows: list[int], positions: list[int]) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64, on logits' device). `rows`/`positions` seed each row's noise."""
    if params.greedy:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for i, (row, position) in enumerate(zip(rows, positions)):
        scaled = filter_logits(logits[i].float(), params)
        generator = torch.Generator(device=logits.device).manual_seed(_mix(params.seed, row, position))
        uniform = torch.rand(scaled.shape, generator=generator, device=logits.device).clamp_(1e-20, 1.0 - 1e-7)
        gumbel = -torch.log(-torch.log(uniform))  # argmax(logits + Gumbel) samples from softmax(logits)
        out[i] = (scaled + gumbel).argmax()
    return out
