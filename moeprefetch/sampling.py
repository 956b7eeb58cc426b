"""Token selection on the device: greedy, or temperature / top-k / top-p sampling with counter-based noise.

Each sampled token uses Gumbel noise computed from a hash of (seed, sequence index, position, vocabulary index) with
plain integer tensor ops, so it needs no generator state: it runs inside a CUDA graph, gives the same token on the
CPU and the GPU, and the token drawn at a position depends only on its logits. Batched and one-by-one generation, and
speculative and plain decoding, draw the same tokens.

The hash is PCG's output permutation on 32-bit values held in int64 tensors; every product stays below 2**62, so
nothing overflows on any device.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from .errors import RequestError

_MASK32 = 0xFFFFFFFF


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


def _pcg(x: torch.Tensor) -> torch.Tensor:
    """PCG-RXS-M-XS hash of 32-bit values (int64 tensor in, int64 tensor of 32-bit values out)."""
    state = (x * 747796405 + 2891336453) & _MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK32
    return (word >> 22) ^ word


def gumbel_noise(vocab_hash: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor, seed_hi: torch.Tensor,
                 seed_lo: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [B, V] fp32 hashed from (seed, stream, position, vocabulary index): streams and positions [B],
    the seed's two 31-bit halves [1] or [B]."""
    h = _pcg(positions & _MASK32)
    h = _pcg(streams ^ h)
    h = _pcg(seed_hi ^ h)
    h = _pcg(seed_lo ^ h)
    bits = _pcg(h[:, None] ^ vocab_hash[None, :])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), 24 bits
    return -torch.log(-torch.log(uniform))


class DeviceSampler:
    """Sampling with fixed tensors (captured once, replayed every step): the call's parameters live on the device."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        self.vocab_hash = _pcg(torch.arange(vocab, dtype=torch.int64, device=device))
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(1, dtype=torch.int64, device=device)
        self.top_p = torch.ones(1, dtype=torch.float32, device=device)
        self.seed = torch.zeros(2, dtype=torch.int64, device=device)  # high and low 31 bits

    def set_params(self, params: SamplingParams) -> None:
        """Before a call: write its parameters into the device tensors (the graphs read them there)."""
        self.temperature.fill_(max(params.temperature, 1e-6))
        self.top_k.fill_(params.top_k if 0 < params.top_k < self.vocab else 0)
        self.top_p.fill_(params.top_p)
        seed = params.seed & ((1 << 62) - 1)
        self.seed.copy_(torch.tensor([seed >> 31, seed & ((1 << 31) - 1)]))

    def gumbel(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows, positions [B] int64 -> Gumbel noise [B, V] fp32."""
        return gumbel_noise(self.vocab_hash, rows, positions, self.seed[0], self.seed[1])

    def filter(self, logits: torch.Tensor, use_top_k: bool, use_top_p: bool) -> torch.Tensor:
        """logits [B, V] fp32 -> temperature-scaled, with tokens outside top-k / top-p set to -inf."""
        scaled = logits / self.temperature
        if use_top_k or use_top_p:
            ordered, order = scaled.sort(dim=-1, descending=True)
            if use_top_k:
                kth = ordered.gather(-1, (self.top_k - 1).clamp(min=0).expand(scaled.shape[0], 1))
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                ordered = ordered.masked_fill(ordered < kth, float("-inf"))
            if use_top_p:
                probs = ordered.softmax(-1)
                before = probs.cumsum(-1) - probs  # mass strictly before each token
                drop_sorted = before >= self.top_p  # keep the smallest prefix whose mass reaches top_p
                drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
                scaled = scaled.masked_fill(drop, float("-inf"))
        return scaled

    def __call__(self, logits: torch.Tensor, params: SamplingParams, rows: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] (int64). `params` decides the graph's shape (greedy, top-k, top-p on or
        off); the values come from the device tensors set by `set_params`."""
        if params.greedy:
            return logits.argmax(dim=-1)
        scaled = self.filter(logits.float(), 0 < params.top_k < self.vocab, params.top_p < 1.0)
        return (scaled + self.gumbel(rows, positions)).argmax(dim=-1)


class RowSampler(DeviceSampler):
    """Each row with its own parameters (a continuous batch: requests with their own temperature, top-k, top-p and
    seed share a step). A row draws exactly what the same request draws alone through `DeviceSampler` (as row 0 of
    its own call): the same scaled and filtered logits, and noise from (its seed, stream 0, position); greedy rows
    take the argmax."""

    ROW_TENSORS = ("temperature", "greedy", "top_k", "use_top_k", "top_p", "use_top_p", "row_seed")

    def __init__(self, vocab: int, device: torch.device, rows: int):
        super().__init__(vocab, device)
        self.temperature = torch.ones(rows, 1, dtype=torch.float32, device=device)
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)
        self.top_k = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.use_top_k = torch.zeros(rows, 1, dtype=torch.bool, device=device)
        self.top_p = torch.ones(rows, 1, dtype=torch.float32, device=device)
        self.use_top_p = torch.zeros(rows, 1, dtype=torch.bool, device=device)
        self.row_seed = torch.zeros(rows, 2, dtype=torch.int64, device=device)

    def set_row(self, row: int, params: SamplingParams) -> None:
        """Before a request's first step in `row` (a few small copies)."""
        self.temperature[row] = max(params.temperature, 1e-6)
        self.greedy[row] = params.greedy
        use_k = 0 < params.top_k < self.vocab
        self.top_k[row] = params.top_k if use_k else 1
        self.use_top_k[row] = use_k
        self.top_p[row] = params.top_p
        self.use_top_p[row] = params.top_p < 1.0
        seed = params.seed & ((1 << 62) - 1)
        self.row_seed[row] = torch.tensor([seed >> 31, seed & ((1 << 31) - 1)])

    def first_rows(self, rows: int) -> "RowSampler":
        """A sampler of the first `rows` rows whose parameters are views of these (`set_row` here reaches it)."""
        view = copy.copy(self)
        for name in self.ROW_TENSORS:
            setattr(view, name, getattr(self, name)[:rows])
        return view

    def gumbel(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # stream 0 and each row's own seed: what the request draws alone
        return gumbel_noise(self.vocab_hash, torch.zeros_like(rows), positions, self.row_seed[:, 0],
                            self.row_seed[:, 1])

    def filter(self, logits: torch.Tensor, use_top_k: bool = True, use_top_p: bool = True) -> torch.Tensor:
        scaled = logits / self.temperature
        ordered, order = scaled.sort(dim=-1, descending=True)
        kth = ordered.gather(-1, (self.top_k - 1).clamp(min=0))
        cut_k = self.use_top_k & (scaled < kth)
        scaled = scaled.masked_fill(cut_k, float("-inf"))
        ordered = ordered.masked_fill(self.use_top_k & (ordered < kth), float("-inf"))
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs
        drop_sorted = self.use_top_p & (before >= self.top_p)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return scaled.masked_fill(drop, float("-inf"))

    def __call__(self, logits: torch.Tensor, params: SamplingParams, rows: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B]; `params` is unused (every row has its own, set by `set_row`)."""
        sampled = (self.filter(logits.float()) + self.gumbel(rows, positions)).argmax(dim=-1)
        return torch.where(self.greedy, logits.argmax(dim=-1), sampled)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 -> temperature-scaled logits with tokens outside top-k / top-p set to -inf."""
    sampler = DeviceSampler(logits.shape[-1], logits.device)
    sampler.set_params(params)
    return sampler.filter(logits.float()[None], 0 < params.top_k < logits.shape[-1], params.top_p < 1.0)[0]


def sample(logits: torch.Tensor, params: SamplingParams, rows: list[int], positions: list[int]) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64, on logits' device). `rows`/`positions` seed each row's noise."""
    sampler = DeviceSampler(logits.shape[-1], logits.device)
    sampler.set_params(params)
    dev = logits.device
    return sampler(logits, params, torch.tensor(rows, device=dev), torch.tensor(positions, device=dev))
