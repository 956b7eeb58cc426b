"""Gumbel-max sampling in one pass: counter-based noise hashed per (seed, stream, position, vocabulary index), added
to the scaled logits, and the arg-max, per row.

The reference (`gumbel_noise`, then `argmax`) runs five PCG rounds over the whole vocabulary as separate int64
tensor ops, writing the [B, V] noise: 146 µs a step at V2-Lite's 102,400-token vocabulary on an H100
(BENCHMARKS.md "Serving"). The kernel computes the same hash and the same fp32 noise in registers, block by block,
keeping a running maximum over its span of the row; the spans' maxima are reduced after: one read of the logits. It draws the reference's token: the hash is integer
arithmetic, the noise the same fp32 operations, and ties go to the lowest index as `torch.argmax`'s do.

The hash is PCG's output permutation on 32-bit values held in int64; every product stays below 2**62.
"""

from __future__ import annotations

import torch

from . import HAS_TRITON, Launch

if HAS_TRITON:
    import triton
    import triton.language as tl

MASK32 = 0xFFFFFFFF
SAMPLE_BLOCK = 1024  # vocabulary entries per iteration of a program
SAMPLE_SPAN = 2048  # vocabulary entries per program: V2-Lite's 102,400 are 50 programs a row


# ---- references -----------------------------------------------------------------------------------------------------


def pcg(x: torch.Tensor) -> torch.Tensor:
    """PCG-RXS-M-XS hash of 32-bit values (int64 tensor in, int64 tensor of 32-bit values out)."""
    state = (x * 747796405 + 2891336453) & MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & MASK32
    return (word >> 22) ^ word


def gumbel_noise(vocab_hash: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor, seed_hi: torch.Tensor,
                 seed_lo: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [B, V] fp32 hashed from (seed, stream, position, vocabulary index): streams and positions [B],
    the seed's two 31-bit halves [1] or [B], `vocab_hash` = pcg(arange(V))."""
    h = pcg(positions & MASK32)
    h = pcg(streams ^ h)
    h = pcg(seed_hi ^ h)
    h = pcg(seed_lo ^ h)
    bits = pcg(h[:, None] ^ vocab_hash[None, :])
    # 23 bits, so that every value is below 1 in fp32: with 24 (bits >> 8), 2**24 - 0.5 rounded up to 2**24, the
    # noise was +inf once in 2**24 entries, and that entry won whatever its logit, bias or filter said
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # in [2**-24, 1 - 2**-24]
    return -torch.log(-torch.log(uniform))


def gumbel_argmax_reference(scaled: torch.Tensor, vocab_hash: torch.Tensor, streams: torch.Tensor,
                            positions: torch.Tensor, seed_hi: torch.Tensor, seed_lo: torch.Tensor) -> torch.Tensor:
    return (scaled + gumbel_noise(vocab_hash, streams, positions, seed_hi, seed_lo)).argmax(dim=-1)


# ---- kernel ---------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _pcg(x):
        state = (x * 747796405 + 2891336453) & 0xFFFFFFFF
        word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & 0xFFFFFFFF
        return (word >> 22) ^ word

    @triton.jit
    def _gumbel_argmax_kernel(scaled_ptr, stream_ptr, pos_ptr, hi_ptr, lo_ptr, best_ptr, at_ptr, V, seed_stride,
                              SPAN: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row r, part p): the maximum of scaled + noise over the row's entries [p * SPAN, (p + 1) * SPAN)
        and its lowest index."""
        r = tl.program_id(0)
        part = tl.program_id(1)
        pos = tl.load(pos_ptr + r).to(tl.int64)
        h = _pcg(pos & 0xFFFFFFFF)
        h = _pcg(tl.load(stream_ptr + r).to(tl.int64) ^ h)
        h = _pcg(tl.load(hi_ptr + r * seed_stride).to(tl.int64) ^ h)
        h = _pcg(tl.load(lo_ptr + r * seed_stride).to(tl.int64) ^ h)
        best = tl.full((), float("-inf"), tl.float32)
        best_at = tl.full((), 0, tl.int32)
        row = scaled_ptr + r.to(tl.int64) * V
        first = part * SPAN
        for start in range(0, SPAN, BLOCK):
            cols = first + start + tl.arange(0, BLOCK)
            on = (cols < V) & (cols < first + SPAN)
            bits = _pcg(h ^ _pcg(cols.to(tl.int64)))
            uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # below 1: see gumbel_noise
            noise = -tl.log(-tl.log(uniform))
            score = tl.load(row + cols, mask=on, other=float("-inf")) + noise
            score = tl.where(on, score, float("-inf"))
            top = tl.max(score, axis=0)
            at = tl.argmax(score, axis=0) + first + start
            better = top > best  # strictly: an equal maximum later in the row loses, as in torch.argmax
            best_at = tl.where(better, at, best_at)
            best = tl.where(better, top, best)
        n_parts = tl.num_programs(1)
        tl.store(best_ptr + r * n_parts + part, best)
        tl.store(at_ptr + r * n_parts + part, best_at.to(tl.int64))


def gumbel_argmax(scaled: torch.Tensor, vocab_hash: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor,
                  seed_hi: torch.Tensor, seed_lo: torch.Tensor, use_kernel: bool) -> torch.Tensor:
    """argmax(scaled + Gumbel noise) per row -> [B] int64. scaled [B, V] fp32 (filtered entries -inf); streams and
    positions [B] int64; the seed's halves [1] (every row's) or [B] (each row's own). On the kernel path each row's
    vocabulary is split over `parts` programs (one row fills the device, not one SM); the parts' maxima are then
    reduced in order, so the lowest index of an equal maximum wins, as in `torch.argmax`."""
    if not use_kernel:
        return gumbel_argmax_reference(scaled, vocab_hash, streams, positions, seed_hi, seed_lo)
    scaled = scaled.contiguous()
    parts = triton.cdiv(scaled.shape[1], SAMPLE_SPAN)
    best = torch.empty(scaled.shape[0], parts, dtype=torch.float32, device=scaled.device)
    at = torch.empty(scaled.shape[0], parts, dtype=torch.int64, device=scaled.device)
    gumbel_argmax_launch(scaled, streams, positions, seed_hi, seed_lo, best, at)()
    return at.gather(1, best.argmax(dim=1, keepdim=True))[:, 0]


def gumbel_argmax_launch(scaled: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor, seed_hi: torch.Tensor,
                         seed_lo: torch.Tensor, best: torch.Tensor, at: torch.Tensor) -> Launch:
    rows, vocab = scaled.shape
    # one seed for every row (a call's: 0-dim or [1]), or each row's own (a batch's, possibly a strided column)
    seed_stride = seed_hi.stride(0) if seed_hi.numel() > 1 else 0
    assert seed_lo.numel() == seed_hi.numel() and (seed_stride == 0 or seed_lo.stride(0) == seed_stride)
    return Launch(_gumbel_argmax_kernel, (rows, best.shape[1]), num_warps=4, num_stages=1, scaled_ptr=scaled,
                  stream_ptr=streams, pos_ptr=positions, hi_ptr=seed_hi, lo_ptr=seed_lo, best_ptr=best, at_ptr=at,
                  V=vocab, seed_stride=seed_stride, SPAN=SAMPLE_SPAN, BLOCK=SAMPLE_BLOCK)
