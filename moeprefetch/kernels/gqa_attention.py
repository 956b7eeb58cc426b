"""Grouped-query decode attention over each row's real context length, in Triton (Qwen3-MoE, Mixtral, GLM-4.5).

The queries (already projected, normed and rotated) attend to the cache entries of their row up to their own slot
(and, with a sliding window, not before slot - window + 1). As in `attention.py`, a row's visible keys are cut into at
most `SPLITS` splits whose size is computed on the device from the row's length; one program per (row, split, key-value
head) computes a partial softmax for the query heads that share that key-value head, and a merge program per (row,
head) combines the splits in order. Work and bytes grow with the real length, never with the cache's capacity, and
the launches are graph-safe (lengths are read on the device).

Layouts (R rows = batch x new tokens per row, h query heads, g key-value heads, d head dim):
    q      [R, h, d]          rotated queries
    key    [B, cap, g, d]     the layer's cache (`model.GQAKV`), rotated keys; value alike
    out    [R, h, d]
"""

from __future__ import annotations

import torch

from . import HAS_TRITON, INTERPRET, Launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .attention import _split_size, merge_splits
    from .common import dot, next_pow2

SPLITS = 128  # splits per row at most (as MLA's): enough programs at batch 1, scratch independent of capacity
BLOCK_KEYS = 32  # keys per step inside a split


def gqa_attend_reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache_rows: torch.Tensor,
                         slots: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q [R, h, d] -> [R, h, d]: each row's softmax (fp32) over its cache keys lo..slot, lo = slot - window + 1."""
    heads, groups = q.shape[1], key.shape[2]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        n = int(slots[i]) + 1
        lo = max(n - window, 0) if window else 0
        k = key[int(cache_rows[i]), lo:n].float().repeat_interleave(heads // groups, dim=1)  # [S, h, d]
        v = value[int(cache_rows[i]), lo:n].float().repeat_interleave(heads // groups, dim=1)
        scores = torch.einsum("hd,shd->hs", q[i].float(), k) * scale
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v).to(out.dtype)
    return out


if HAS_TRITON:

    @triton.jit
    def _visible_range(slot_ptr, r, WINDOW: tl.constexpr):
        """(first visible key, keys visible) of row r."""
        n_keys = tl.load(slot_ptr + r).to(tl.int32) + 1
        lo = tl.maximum(n_keys - WINDOW, 0) if WINDOW > 0 else n_keys * 0
        return lo, n_keys - lo

    @triton.jit
    def _gqa_split_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, part_o_ptr, part_lse_ptr, scale, rows_per_seq, cap,
                          n_splits, NH: tl.constexpr, NKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                          DP: tl.constexpr, HB: tl.constexpr, NS: tl.constexpr, BS: tl.constexpr,
                          WINDOW: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        """A partial softmax over one split of one row's keys, for the G query heads of one key-value head."""
        r = tl.program_id(0)
        split = tl.program_id(1)
        g = tl.program_id(2)
        lo, n_vis = _visible_range(slot_ptr, r, WINDOW)
        size = _split_size(n_vis, NS, BS)
        if split * size >= n_vis:  # the merge reads only the splits that hold keys
            return
        start = lo + split * size
        end = tl.minimum(start + size, lo + n_vis)
        b = (r // rows_per_seq).to(tl.int64)
        hb = tl.arange(0, HB)
        h_on = hb < G
        heads = g * G + hb
        ds = tl.arange(0, DP)
        d_on = ds < D
        q = tl.load(q_ptr + (r.to(tl.int64) * NH + heads)[:, None] * D + ds[None, :],
                    mask=h_on[:, None] & d_on[None, :], other=0.0)
        m = tl.full([HB], float("-inf"), dtype=tl.float32)
        den = tl.zeros([HB], dtype=tl.float32)
        acc = tl.zeros([HB, DP], dtype=tl.float32)
        for s0 in range(start, end, BS):
            keys = s0 + tl.arange(0, BS)
            k_on = keys < end
            entry = ((b * cap + keys) * NKV + g) * D
            k = tl.load(k_ptr + entry[:, None] + ds[None, :], mask=k_on[:, None] & d_on[None, :], other=0.0)
            s = dot(q, tl.trans(k), IEEE, DOT_F32)
            s = tl.where(k_on[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + entry[:, None] + ds[None, :], mask=k_on[:, None] & d_on[None, :], other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE, DOT_F32)
            m = m_new
        part = (r.to(tl.int64) * n_splits + split) * NH + heads  # int64: the scratch can exceed 2**31 elements
        tl.store(part_o_ptr + part[:, None] * DP + ds[None, :], acc / den[:, None], mask=h_on[:, None])
        tl.store(part_lse_ptr + part, m + tl.log(den), mask=h_on)

    @triton.jit
    def _gqa_merge_kernel(part_o_ptr, part_lse_ptr, slot_ptr, out_ptr, n_splits, NH: tl.constexpr, D: tl.constexpr,
                          DP: tl.constexpr, NS: tl.constexpr, BS: tl.constexpr, WINDOW: tl.constexpr):
        """out[r, head] = the splits' partial results weighted by their softmax mass, in split order."""
        r = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        _, n_vis = _visible_range(slot_ptr, r, WINDOW)
        ds = tl.arange(0, DP)
        merged = merge_splits(part_o_ptr, part_lse_ptr, r, head, n_vis, n_splits, NH, DP, NS, BS)
        tl.store(out_ptr + (r * NH + head) * D + ds, merged.to(out_ptr.dtype.element_ty), mask=ds < D)


class GQADecode:
    """Grouped-query decode attention for one engine: fixed scratch (rows x SPLITS partial results), so the launches
    can be captured in a CUDA graph. `use_kernels=False` runs the reference."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, capacity: int, max_rows: int, window: int | None,
                 device: torch.device, use_kernels: bool):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.window, self.max_rows, self.use_kernels = window, max_rows, use_kernels
        self.n_splits = min(SPLITS, -(-capacity // BLOCK_KEYS))
        if use_kernels:
            self.d_pad = next_pow2(head_dim, 16)
            self._part_o = torch.empty(max_rows * self.n_splits * heads * self.d_pad, dtype=torch.float32,
                                       device=device)
            self._part_lse = torch.empty(max_rows * self.n_splits * heads, dtype=torch.float32, device=device)

    @staticmethod
    def scratch_bytes(heads: int, head_dim: int, capacity: int, max_rows: int) -> int:
        splits = min(SPLITS, -(-capacity // BLOCK_KEYS))
        return max_rows * splits * heads * (max(16, 1 << (head_dim - 1).bit_length()) + 1) * 4

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, rows_per_seq: int,
               scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [R, h, d] (contiguous), the cache's key/value [B, cap, g, d], slots [R] -> [R, h, d]."""
        out = torch.empty_like(q) if out is None else out
        if not self.use_kernels:
            rows = torch.arange(q.shape[0], device=q.device) // rows_per_seq
            return out.copy_(gqa_attend_reference(q, key, value, rows, slots, scale, self.window))
        assert q.shape[0] <= self.max_rows and q.is_contiguous() and key.is_contiguous() and value.is_contiguous()
        for launch in self.launches(q, key, value, slots, rows_per_seq, scale, out):
            launch()
        return out

    def launches(self, q, key, value, slots, rows_per_seq, scale, out) -> list[Launch]:
        n_rows, group = q.shape[0], self.heads // self.kv_heads
        common = dict(NH=self.heads, D=self.head_dim, DP=self.d_pad, NS=self.n_splits, BS=BLOCK_KEYS,
                      WINDOW=self.window or 0, n_splits=self.n_splits)
        ieee = q.dtype == torch.float32
        return [
            Launch(_gqa_split_kernel, (n_rows, self.n_splits, self.kv_heads), num_warps=4, num_stages=2, q_ptr=q,
                   k_ptr=key, v_ptr=value, slot_ptr=slots, part_o_ptr=self._part_o, part_lse_ptr=self._part_lse,
                   scale=scale, rows_per_seq=rows_per_seq, cap=key.shape[1], NKV=self.kv_heads, G=group,
                   HB=max(16, next_pow2(group)), IEEE=ieee, DOT_F32=INTERPRET and not ieee, **common),
            Launch(_gqa_merge_kernel, (n_rows, self.heads), num_warps=4, num_stages=1, part_o_ptr=self._part_o,
                   part_lse_ptr=self._part_lse, slot_ptr=slots, out_ptr=out, **common),
        ]
