"""MLA decode attention (the absorbed form) over each row's real context length, in Triton.

Two steps per layer, both graph-safe because every length is read on the device:

- `prepare`: from the projections' outputs, normalise the new latent (kv_a_norm), rotate the new rope key and the
  queries' rope parts, and write the key into the compressed cache at its slot;
- `attend`: queries already multiplied into the latent space (q_nope . W_uk, a batched matmul outside) attend to the
  cache entries 0..slot of their row. A row's keys are cut into at most `SPLITS` splits of equal size (a multiple
  of `BLOCK_KEYS`, computed on the device from the row's length); one program per (row, split, head block)
  computes a partial softmax over its split, and a merge program per (row, head) combines the splits that hold
  keys, in split order. Work and bytes grow with the real length, not the cache's capacity; the scratch does not
  grow at all; and a row's result depends only on its own keys (never on the batch or the capacity).

Layouts (R rows = batch x new tokens per row, h heads, c latent, r rope dims):
    q          [R, h, n + r]  the query projection's output; its rope part is rotated in place
    kv         [R, c + r]     kv_a_proj's output
    q_latent   [h, R, c]      q_nope . W_uk per head (what the batched matmul produces)
    out        [h, R, c]      attention output in the latent space (then . W_uv per head)
"""

from __future__ import annotations

import torch

from .definitions import rotate
from . import HAS_TRITON, INTERPRET, Launch
from .norm import rms_norm_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .common import dot, next_pow2

SPLITS = 128  # splits per row at most: enough programs for the device at batch 1, scratch independent of capacity
BLOCK_KEYS = 32  # keys per step inside a split (a split holds a multiple of it)
HEAD_BLOCK = 16  # heads per program (tl.dot needs at least 16 rows)


# ---- references -----------------------------------------------------------------------------------------------------


def prepare_reference(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      cache_rows: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, factor: float,
                      interleave: bool, nope: int) -> None:
    """q [R, h, n+r] (rope part rotated in place), kv [R, c+r] -> cache[row, slot] = (norm(latent), rotated key)."""
    c = latent_cache.shape[-1]
    freqs = positions.float()[:, None] * inv_freq
    cos, sin = freqs.cos() * factor, freqs.sin() * factor
    q[..., nope:] = rotate(q[..., nope:], cos[:, None], sin[:, None], interleave)
    latent_cache[cache_rows, slots] = rms_norm_reference(kv[:, :c], norm_weight, eps)
    rope_cache[cache_rows, slots] = rotate(kv[:, c:], cos, sin, interleave)


def attend_reference(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                     rope_cache: torch.Tensor, cache_rows: torch.Tensor, slots: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q_latent [h, R, c], q_rope [R, h, r] -> out [h, R, c]: softmax over the keys 0..slot of each row's cache."""
    out = torch.empty_like(q_latent)
    for i in range(q_latent.shape[1]):
        n = int(slots[i]) + 1
        lat = latent_cache[int(cache_rows[i]), :n].float()  # [S, c]
        rope = rope_cache[int(cache_rows[i]), :n].float()
        scores = (q_latent[:, i].float() @ lat.T + q_rope[i].float() @ rope.T) * scale  # [h, S]
        out[:, i] = (scores.softmax(-1) @ lat).to(out.dtype)
    return out


# ---- kernels --------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _rotate_pairs(x_ptr, offs_half, HALF: tl.constexpr, INTERLEAVE: tl.constexpr, mask):
        """The two halves of each rotated pair, in fp32."""
        if INTERLEAVE:
            x1 = tl.load(x_ptr + 2 * offs_half, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + 2 * offs_half + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(x_ptr + offs_half, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + HALF + offs_half, mask=mask, other=0.0).to(tl.float32)
        return x1, x2

    @triton.jit
    def _prepare_kernel(q_ptr, kv_ptr, pos_ptr, slot_ptr, latent_ptr, rope_ptr, norm_ptr, inv_freq_ptr, eps, factor,
                        rows_per_seq, cap, q_stride, kv_stride, NH: tl.constexpr, NOPE: tl.constexpr, C: tl.constexpr,
                        HALF: tl.constexpr, INTERLEAVE: tl.constexpr, HP: tl.constexpr, CP: tl.constexpr,
                        HALFP: tl.constexpr):
        r = tl.program_id(0)
        qk = NOPE + 2 * HALF
        pos = tl.load(pos_ptr + r).to(tl.float32)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        b = r // rows_per_seq
        j = tl.arange(0, HALFP)
        j_on = j < HALF
        freq = pos * tl.load(inv_freq_ptr + j, mask=j_on, other=0.0)
        cos = tl.cos(freq) * factor
        sin = tl.sin(freq) * factor
        # the queries' rope parts, every head at once: [HP, HALFP]
        heads = tl.arange(0, HP)
        q_base = q_ptr + r * q_stride + heads[:, None] * qk + NOPE
        q_on = (heads[:, None] < NH) & j_on[None, :]
        x1, x2 = _rotate_pairs(q_base, j[None, :], HALF, INTERLEAVE, q_on)
        out_ty = q_ptr.dtype.element_ty
        # every element is loaded before any is stored (the rotation is in place)
        tl.debug_barrier()
        tl.store(q_base + j[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=q_on)
        tl.store(q_base + HALF + j[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=q_on)
        # the new key: normalised latent and rotated rope key, into the cache at (b, slot)
        cs = tl.arange(0, CP)
        c_on = cs < C
        lat = tl.load(kv_ptr + r * kv_stride + cs, mask=c_on, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(lat * lat, axis=0) / C + eps)
        normed = (lat * inv).to(out_ty).to(tl.float32)
        w = tl.load(norm_ptr + cs, mask=c_on, other=0.0).to(tl.float32)
        entry = b * cap + slot
        tl.store(latent_ptr + entry * C + cs, (w * normed).to(out_ty), mask=c_on)
        k1, k2 = _rotate_pairs(kv_ptr + r * kv_stride + C, j, HALF, INTERLEAVE, j_on)
        tl.store(rope_ptr + entry * 2 * HALF + j, (k1 * cos - k2 * sin).to(out_ty), mask=j_on)
        tl.store(rope_ptr + entry * 2 * HALF + HALF + j, (k2 * cos + k1 * sin).to(out_ty), mask=j_on)

    @triton.jit
    def _split_size(n_keys, NS: tl.constexpr, BS: tl.constexpr):
        """Keys per split of a row with n_keys keys: at most NS splits, each a multiple of BS keys."""
        return ((n_keys + NS * BS - 1) // (NS * BS)) * BS

    @triton.jit
    def _split_kernel(ql_ptr, q_ptr, latent_ptr, rope_ptr, slot_ptr, part_o_ptr, part_lse_ptr, scale, rows_per_seq,
                      n_rows, cap, n_splits, q_stride, NH: tl.constexpr, NOPE: tl.constexpr, C: tl.constexpr,
                      RD: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr, HB: tl.constexpr,
                      NS: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        """A partial softmax over one split of one row's keys, for one block of heads."""
        r = tl.program_id(0)
        split = tl.program_id(1)
        heads = tl.program_id(2) * HB + tl.arange(0, HB)
        n_keys = tl.load(slot_ptr + r).to(tl.int32) + 1
        size = _split_size(n_keys, NS, BS)
        start = split * size
        if start >= n_keys:  # the merge reads only the splits that hold keys
            return
        end = tl.minimum(start + size, n_keys)
        b = (r // rows_per_seq).to(tl.int64)
        cs = tl.arange(0, CP)
        rs = tl.arange(0, RP)
        h_on = heads < NH
        q = tl.load(ql_ptr + (heads[:, None] * n_rows + r) * C + cs[None, :], mask=h_on[:, None] & (cs[None, :] < C),
                    other=0.0)
        qr = tl.load(q_ptr + r * q_stride + heads[:, None] * (NOPE + RD) + NOPE + rs[None, :],
                     mask=h_on[:, None] & (rs[None, :] < RD), other=0.0)
        m = tl.full([HB], float("-inf"), dtype=tl.float32)
        den = tl.zeros([HB], dtype=tl.float32)
        acc = tl.zeros([HB, CP], dtype=tl.float32)
        for s0 in range(start, end, BS):
            keys = s0 + tl.arange(0, BS)
            k_on = keys < end
            entry = b * cap + keys
            lat = tl.load(latent_ptr + entry[:, None] * C + cs[None, :], mask=k_on[:, None] & (cs[None, :] < C),
                          other=0.0)
            kr = tl.load(rope_ptr + entry[:, None] * RD + rs[None, :], mask=k_on[:, None] & (rs[None, :] < RD),
                         other=0.0)
            s = dot(q, tl.trans(lat), IEEE, DOT_F32) + dot(qr, tl.trans(kr), IEEE, DOT_F32)
            s = tl.where(k_on[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot(p.to(lat.dtype), lat, IEEE, DOT_F32)
            m = m_new
        part = (r.to(tl.int64) * n_splits + split) * NH + heads  # int64: the scratch can exceed 2**31 elements
        tl.store(part_o_ptr + part[:, None] * CP + cs[None, :], acc / den[:, None], mask=h_on[:, None])
        tl.store(part_lse_ptr + part, m + tl.log(den), mask=h_on)

    @triton.jit
    def merge_splits(part_o_ptr, part_lse_ptr, r, head, n_keys, n_splits, NH: tl.constexpr, CP: tl.constexpr,
                     NS: tl.constexpr, BS: tl.constexpr):
        """Row r's partial results of one head over the splits that hold its n_keys keys, weighted by their softmax
        mass, in split order -> [CP] fp32 (shared with the grouped-query kernel)."""
        size = _split_size(n_keys, NS, BS)
        used = (n_keys + size - 1) // size
        cs = tl.arange(0, CP)
        top = tl.load(part_lse_ptr + r * n_splits * NH + head)
        for split in range(1, used):
            top = tl.maximum(top, tl.load(part_lse_ptr + (r * n_splits + split) * NH + head))
        den = top * 0.0
        acc = tl.zeros([CP], dtype=tl.float32)
        for split in range(0, used):
            part = (r * n_splits + split) * NH + head
            w = tl.exp(tl.load(part_lse_ptr + part) - top)
            den += w
            acc += w * tl.load(part_o_ptr + part * CP + cs)
        return acc / den

    @triton.jit
    def _merge_kernel(part_o_ptr, part_lse_ptr, slot_ptr, out_ptr, n_rows, n_splits, NH: tl.constexpr,
                      C: tl.constexpr, CP: tl.constexpr, NS: tl.constexpr, BS: tl.constexpr):
        """out[head, r] = the splits' partial results weighted by their softmax mass, in split order."""
        r = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        n_keys = tl.load(slot_ptr + r).to(tl.int32) + 1
        cs = tl.arange(0, CP)
        merged = merge_splits(part_o_ptr, part_lse_ptr, r, head, n_keys, n_splits, NH, CP, NS, BS)
        tl.store(out_ptr + (head * n_rows + r) * C + cs, merged.to(out_ptr.dtype.element_ty), mask=cs < C)


class MLADecode:
    """The two MLA decode steps for one engine: fixed scratch (rows x SPLITS partial results), so the launches
    can be captured in a CUDA graph. `use_kernels=False` runs the references."""

    def __init__(self, heads: int, nope: int, latent: int, rope_dim: int, capacity: int, max_rows: int,
                 device: torch.device, use_kernels: bool):
        self.heads, self.nope, self.latent, self.rope_dim = heads, nope, latent, rope_dim
        self.capacity, self.max_rows = capacity, max_rows
        self.use_kernels = use_kernels
        self.n_splits = min(SPLITS, -(-capacity // BLOCK_KEYS))
        if use_kernels:
            self.c_pad = next_pow2(latent, 16)
            self._part_o = torch.empty(max_rows * self.n_splits * heads * self.c_pad, dtype=torch.float32,
                                       device=device)
            self._part_lse = torch.empty(max_rows * self.n_splits * heads, dtype=torch.float32, device=device)

    @staticmethod
    def scratch_bytes(heads: int, latent: int, capacity: int, max_rows: int) -> int:
        splits = min(SPLITS, -(-capacity // BLOCK_KEYS))
        return max_rows * splits * heads * (max(16, 1 << (latent - 1).bit_length()) + 1) * 4

    def prepare(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                rows_per_seq: int, latent_cache: torch.Tensor, rope_cache: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, inv_freq: torch.Tensor, factor: float, interleave: bool) -> None:
        """q [R, h, n+r] (rows may be strided; its rope part is rotated in place), kv [R, c+r] (rows may be
        strided: both can be views into one fused projection's output); positions and slots [R]."""
        n_rows = q.shape[0]
        if not self.use_kernels:
            rows = torch.arange(n_rows, device=q.device) // rows_per_seq
            prepare_reference(q, kv, positions, slots, rows, latent_cache, rope_cache, norm_weight, eps, inv_freq,
                              factor, interleave, self.nope)
            return
        assert q.stride()[1:] == (q.shape[2], 1) and kv.stride(1) == 1 and latent_cache.is_contiguous()
        self.prepare_launch(q, kv, positions, slots, rows_per_seq, latent_cache, rope_cache, norm_weight, eps,
                            inv_freq, factor, interleave)()

    def prepare_launch(self, q, kv, positions, slots, rows_per_seq, latent_cache, rope_cache, norm_weight, eps,
                       inv_freq, factor, interleave) -> Launch:
        half = self.rope_dim // 2
        return Launch(_prepare_kernel, (q.shape[0],), num_warps=4, num_stages=1, q_ptr=q, kv_ptr=kv,
                      pos_ptr=positions, slot_ptr=slots, latent_ptr=latent_cache, rope_ptr=rope_cache,
                      norm_ptr=norm_weight, inv_freq_ptr=inv_freq, eps=eps, factor=factor, rows_per_seq=rows_per_seq,
                      cap=latent_cache.shape[1], q_stride=q.stride(0), kv_stride=kv.stride(0), NH=self.heads,
                      NOPE=self.nope, C=self.latent, HALF=half,
                      INTERLEAVE=interleave, HP=next_pow2(self.heads), CP=next_pow2(self.latent),
                      HALFP=next_pow2(half))

    def attend(self, q_latent: torch.Tensor, q: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
               slots: torch.Tensor, rows_per_seq: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q_latent [h, R, c], q [R, h, n+r] (rotated) -> [h, R, c] over the keys 0..slot of each row."""
        n_rows = q.shape[0]
        if out is None:
            out = torch.empty_like(q_latent)
        if not self.use_kernels:
            rows = torch.arange(n_rows, device=q.device) // rows_per_seq
            return out.copy_(attend_reference(q_latent, q[..., self.nope:], latent_cache, rope_cache, rows, slots,
                                              scale))
        assert n_rows <= self.max_rows and q_latent.is_contiguous() and q.stride()[1:] == (q.shape[2], 1)
        for launch in self.attend_launches(q_latent, q, latent_cache, rope_cache, slots, rows_per_seq, scale, out):
            launch()
        return out

    def attend_launches(self, q_latent, q, latent_cache, rope_cache, slots, rows_per_seq, scale, out) -> list[Launch]:
        n_rows, heads = q.shape[0], self.heads
        ieee = q.dtype == torch.float32
        common = dict(NH=heads, C=self.latent, CP=self.c_pad, NS=self.n_splits, BS=BLOCK_KEYS, n_rows=n_rows,
                      n_splits=self.n_splits)
        return [
            Launch(_split_kernel, (n_rows, self.n_splits, triton.cdiv(heads, HEAD_BLOCK)), num_warps=4, num_stages=2,
                   ql_ptr=q_latent, q_ptr=q, latent_ptr=latent_cache, rope_ptr=rope_cache, slot_ptr=slots,
                   part_o_ptr=self._part_o, part_lse_ptr=self._part_lse, scale=scale, rows_per_seq=rows_per_seq,
                   q_stride=q.stride(0), cap=latent_cache.shape[1], NOPE=self.nope, RD=self.rope_dim, RP=next_pow2(self.rope_dim, 16),
                   HB=HEAD_BLOCK, IEEE=ieee, DOT_F32=INTERPRET and not ieee, **common),
            Launch(_merge_kernel, (n_rows, heads), num_warps=4, num_stages=1, part_o_ptr=self._part_o,
                   part_lse_ptr=self._part_lse, slot_ptr=slots, out_ptr=out, **common),
        ]
