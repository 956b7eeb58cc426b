"""Routed experts of one MoE layer, read in place through the residency table: one kernel for hits and misses.

The plan (`residency/plan_kernel.py`) groups a layer's (row, k) entries by distinct expert u and says where each expert's packed record
is: a VRAM slot of the pool, or its row in the page-locked host arena, which the kernel reads over PCIe (zero-copy:
under unified addressing a pinned host address is a valid device address). A missed expert may also be *admitted*:
the kernel writes every tile it reads into a victim slot, so the bytes cross the link once and the slot is complete
when the kernel ends. Every weight tile is read by exactly one program, so an expert's bytes cross at most once per
step whatever the batch.

Inputs
    x [N, H]        router inputs of every row (compute dtype); rows are exact (real, verified drafts) or shadow rows
    assign [N, k]   int32: the distinct expert u of each (row, k) entry, -1 = not computed
    weights [N, k]  fp32 combination weights
    u_key [U]       int32 key (layer position * E + expert) of distinct expert u, -1 = unused
    u_slot [U]      int32 VRAM slot holding it, -1 = read its host record (host row = key)
    u_dst [U]       int32 slot to admit it into while streaming, -1 = none
Output [N, H] fp32 = sum over j of weights[r, j] * expert(assign[r, j])(x[r]), in fixed j order.

Why the tokens never change: an (row, expert) product is computed by the same program with the same tiles and the
same reduction order whether its bytes come from a slot or from host memory, and no row's result depends on the
other rows of its tile (each output element is its own dot product). Outputs are summed in fixed k order. The
multiply (CUDA-core GEMV or tl.dot) and the tiles follow the step's shape (its most rows), never a call's data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from . import HAS_TRITON, INTERPRET, Launch
from .definitions import expert_ffn
from .tiles import DOT_TILES, DOT_WIDE_TILES, EIGHT_BIT_GEMV_TILES, GEMV_TILES, INT4_GEMV_TILES, Tiles

if TYPE_CHECKING:  # a record format (`expert_records.ExpertFormat`) is read only through its attributes here
    from ..expert_records import ExpertFormat

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .common import activate, dot, next_pow2

ACTIVATIONS = {"silu": 0, "relu": 1, "gelu_pytorch_tanh": 2}  # the kernel's activations; others use the reference
ROW_PAD_MIN = 16  # tl.dot needs at least 16 rows
GEMV_MAX_ROWS = 4  # up to this many rows per step, the kernels multiply on the CUDA cores (no tl.dot, no padding)
# the fewest rows a GEMV program carries: a one-row step of a checkpoint without an MTP layer runs the two-row kernel
# (its second row masked), as every batch-1 step did before the twenty-eighth session. With one-row programs
# V2-Lite's offloaded batch-1 step took 70.2 ms a token against 37.8 with two (H100, the same misses and bytes: the
# expert kernels 66.6 against 34.1 ms), though one layer's host reads timed alone run at 51 GB/s either way
# (BENCHMARKS "Batches", twenty-ninth session; the cause in the engine is not found yet)
GEMV_MIN_ROWS = 2


# The tile choices (and why each) are data: kernels/tiles.json, read by kernels/tiles.py.
DEFAULT_TILES = DOT_TILES


@dataclass(frozen=True)
class RecordLayout:
    """Element offsets of one packed expert record, in payload elements and (for scales and zero points) elements of
    the format's `scale_dtype`."""

    hidden: int
    intermediate: int
    rec_w: int
    gate_w: int
    up_w: int
    down_w: int
    quantized: bool
    rec_s: int = 0
    gate_s: int = 0
    up_s: int = 0
    down_s: int = 0
    block_rows: int = 1
    block_cols: int = 1
    int4: bool = False  # payload regions hold 4-bit codes, two to a byte along the inputs
    zero_points: bool = False  # and per-group zero points (fp32 elements from the record's start)
    gate_z: int = 0
    up_z: int = 0
    down_z: int = 0

    @staticmethod
    def of(fmt: ExpertFormat) -> "RecordLayout":
        w = torch.tensor([], dtype=fmt.payload_dtype).element_size()
        regions = fmt.regions
        base = dict(hidden=fmt.hidden, intermediate=fmt.intermediate, rec_w=fmt.record_bytes // w,
                    gate_w=regions["gate"].offset // w, up_w=regions["up"].offset // w,
                    down_w=regions["down"].offset // w, quantized=fmt.quantized)
        if not fmt.quantized:
            return RecordLayout(**base)
        s = fmt.scale_dtype.itemsize
        zeros = {f"{name}_z": regions[f"{name}_zero"].offset // s for name in ("gate", "up", "down")} \
            if fmt.zero_points else {}
        return RecordLayout(**base, rec_s=fmt.record_bytes // s, gate_s=regions["gate_scale"].offset // s,
                            up_s=regions["up_scale"].offset // s, down_s=regions["down_scale"].offset // s,
                            block_rows=fmt.block[0], block_cols=fmt.block[1], int4=fmt.int4,
                            zero_points=fmt.zero_points, **zeros)

    def quant_args(self) -> dict:
        """The kernels' constexprs that say how a record's weights are stored."""
        return dict(REC_S=max(self.rec_s, 1), BR=self.block_rows, BC=self.block_cols, QUANT=self.quantized,
                    INT4=self.int4, ZERO=self.zero_points)


def record_views(fmt: ExpertFormat, pool: torch.Tensor, host: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' typed views of the pool (payload, metadata) and [2] int64 on the pool's device: the host arena's
    offset from the pool in payload and in metadata elements (under unified addressing a kernel reaches host records
    through the pool's pointer)."""
    w = pool.view(fmt.payload_dtype)
    s = pool.view(fmt.scale_dtype) if fmt.quantized else w
    delta = (host.data_ptr() - pool.data_ptr()) if host is not None else 0
    return w, s, torch.tensor([delta // w.element_size(), delta // s.element_size()], dtype=torch.int64,
                              device=pool.device)


def row_pad(rows: int) -> int:
    """Rows per tile: the next power of two >= rows (at least 16). Fix it per engine, not per step, so that every
    step of every batch size and mode up to that size runs the same compiled kernel."""
    return max(ROW_PAD_MIN, 1 << max(rows - 1, 0).bit_length())


# ---- reference ----------------------------------------------------------------------------------------------------


def routed_experts_reference(x: torch.Tensor, assign: torch.Tensor, weights: torch.Tensor, u_key: torch.Tensor,
                             u_slot: torch.Tensor, u_dst: torch.Tensor, pool: torch.Tensor, host: torch.Tensor | None,
                             fmt: ExpertFormat, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The definition: each (row, expert) product alone, as one GEMV pair in the compute dtype, summed in k order."""
    terms = expert_terms_reference(x, assign, u_key, u_slot, u_dst, pool, host, fmt, act)
    return combine_in_k_order(terms, weights.float(), assign >= 0)


def combine_in_k_order(terms: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """terms [N, k, H] fp32, weights [N, k] fp32, valid [N, k] (None: all) -> [N, H] fp32: the sum from zero, entry
    by entry in k order, of weight x term over the valid entries. The one rule every path combines experts by (these
    kernels' accumulators, prefill's grouped GEMMs, expert parallelism after its all-reduce): a fixed order, not the
    order in which experts happened to be computed, is what makes a row's bits independent of what was cached."""
    weighted = weights[..., None] * terms
    if valid is not None:
        weighted = torch.where(valid[..., None], weighted, torch.zeros((), dtype=weighted.dtype, device=weighted.device))
    out = torch.zeros(terms.shape[0], terms.shape[2], dtype=torch.float32, device=terms.device)
    for j in range(terms.shape[1]):
        out = out + weighted[:, j]
    return out


def expert_terms_reference(x: torch.Tensor, assign: torch.Tensor, u_key: torch.Tensor, u_slot: torch.Tensor,
                           u_dst: torch.Tensor, pool: torch.Tensor, host: torch.Tensor | None, fmt: ExpertFormat,
                           act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Each (row, k) entry's product [N, k, H] fp32 (zeros where assign < 0), before weighting; admissions land."""
    n, k = assign.shape
    assign_rows = assign.tolist()
    slots, dsts = u_slot.tolist(), u_dst.tolist()
    terms = torch.zeros(n, k, x.shape[1], dtype=torch.float32, device=x.device)
    for u, key in enumerate(u_key.tolist()):
        if key < 0:
            continue
        record = pool[slots[u]] if slots[u] >= 0 else host[key].to(pool.device)  # type: ignore[index]
        if dsts[u] >= 0:
            pool[dsts[u]].copy_(record)  # admission: the bytes that were read land in the victim slot
        gate_up, down = fmt.dequantize(record.view(1, -1))
        for r in range(n):
            for j in (j for j, v in enumerate(assign_rows[r]) if v == u):
                terms[r, j] = expert_ffn(x[r : r + 1], gate_up[0], down[0], act).float()[0]
    return terms


# ---- kernels ------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _acc_zeros(N_PAD: tl.constexpr, B: tl.constexpr, BK: tl.constexpr, FMA: tl.constexpr, SWAP: tl.constexpr):
        if FMA:  # per-lane partial sums, reduced over K once at the end
            acc = tl.zeros([N_PAD, B, BK], dtype=tl.float32)
        elif SWAP:
            acc = tl.zeros([B, N_PAD], dtype=tl.float32)
        else:
            acc = tl.zeros([N_PAD, B], dtype=tl.float32)
        return acc

    @triton.jit
    def _acc_add(acc, rows_tile, w_tile, FMA: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
                 SWAP: tl.constexpr):
        """acc += rows [N_PAD, K] . weights [B, K]^T: on the CUDA cores (FMA; a batch-1 GEMV would waste 15 of 16
        padded rows on tl.dot, whose shared-memory staging also limits occupancy) or with tl.dot (SWAP: as
        weights . rows^T, accumulated transposed). Either way each output element is its own dot product, so a row's
        result never depends on the other rows of the tile."""
        if FMA:
            out = acc + rows_tile.to(tl.float32)[:, None, :] * w_tile.to(tl.float32)[None, :, :]
        elif SWAP:
            out = acc + dot(w_tile, tl.trans(rows_tile), IEEE, DOT_F32)
        else:
            out = acc + dot(rows_tile, tl.trans(w_tile), IEEE, DOT_F32)
        return out

    @triton.jit
    def _acc_total(acc, FMA: tl.constexpr, SWAP: tl.constexpr):
        """The accumulated products as [N_PAD, B]."""
        if FMA:
            out = tl.sum(acc, axis=2)
        elif SWAP:
            out = tl.trans(acc)
        else:
            out = acc
        return out

    @triton.jit
    def _load_weight_tile(w_ptr, s_ptr, src_w, src_s, dst_w, dst_s, admit, region_w, region_s, region_z, offs_r,
                          rows_on, k0, ROW_LEN: tl.constexpr, SCOLS: tl.constexpr, BR: tl.constexpr,
                          BC: tl.constexpr, QUANT: tl.constexpr, INT4: tl.constexpr, ZERO: tl.constexpr,
                          BK: tl.constexpr, OUT_DTYPE: tl.constexpr, INT4_VECTORS: tl.constexpr = True):
        """The [rows, BK] tile of inputs k0..k0+BK of a weight region: from the source record, copied into the
        admission slot when `admit`, dequantised with its scales, in the compute dtype. 4-bit tiles are read as
        byte vectors (`INT4_VECTORS`: decode) or byte by byte (prefill's grouped tl.dot kernels: Triton 3.6's
        dot-operand pass fails on the interleaved vector tile there; the bytes come from VRAM or staging rows)."""
        if INT4 and INT4_VECTORS:
            tile = _load_int4_tile(w_ptr, s_ptr, src_w, src_s, dst_w, dst_s, admit, region_w, region_s, region_z,
                                   offs_r, rows_on, k0, ROW_LEN, SCOLS, BC, ZERO, BK, OUT_DTYPE)
        else:
            offs_c = k0 + tl.arange(0, BK)
            mask = rows_on[:, None] & (offs_c[None, :] < ROW_LEN)
            if INT4:  # byte c of a row holds inputs 2c (low nibble) and 2c + 1: each byte is read by both
                offs = offs_r[:, None] * (ROW_LEN // 2) + offs_c[None, :] // 2
                raw = tl.load(w_ptr + src_w + region_w + offs, mask=mask, other=0)
            else:
                offs = offs_r[:, None] * ROW_LEN + offs_c[None, :]
                raw = tl.load(w_ptr + src_w + region_w + offs, mask=mask, other=0.0)
            if admit:
                tl.store(w_ptr + dst_w + region_w + offs, raw, mask=mask)
            if QUANT:
                s_offs = (offs_r[:, None] // BR) * SCOLS + offs_c[None, :] // BC
                if INT4:
                    code = ((raw.to(tl.int32) >> ((offs_c[None, :] & 1) * 4)) & 15).to(tl.float32)
                    if BC % BK == 0:  # the tile lies in one group: a scale (and zero point) per row, broadcast
                        # (gathered per weight they were two 4-byte loads for every half byte: prefill's grouped
                        # gate/up at 64 tokens, V2-Lite, H100, read 4-bit records at about 75 GB/s)
                        row_offs = (offs_r[:, None] // BR) * SCOLS + k0 // BC
                        scale, zero = _load_group_metadata(s_ptr, src_s, dst_s, admit, region_s, region_z,
                                                           row_offs, rows_on[:, None] & (k0 < ROW_LEN), ZERO)
                    else:
                        scale, zero = _load_group_metadata(s_ptr, src_s, dst_s, admit, region_s, region_z, s_offs,
                                                           mask, ZERO)
                    tile = ((code - zero) * scale).to(OUT_DTYPE)
                elif BC % BK == 0:  # 8-bit blocks: the tile lies in one block column, so a scale per row,
                    # broadcast. Gathered per weight they were a 4-byte load for every weight byte: a resident FP8
                    # layer took 10-19 % longer (H100, experiments/results/host_fp8_h100.json)
                    row_offs = (offs_r[:, None] // BR) * SCOLS + k0 // BC
                    scale = _load_metadata(s_ptr, src_s, dst_s, admit, region_s, row_offs,
                                           rows_on[:, None] & (k0 < ROW_LEN))
                    tile = (raw.to(tl.float32) * scale).to(OUT_DTYPE)
                elif BK % BC == 0:  # whole block columns in the tile: a scale per row and column, broadcast
                    TG: tl.constexpr = BK // BC
                    groups = k0 // BC + tl.arange(0, TG)
                    g_offs = (offs_r[:, None] // BR) * SCOLS + groups[None, :]
                    scale = _load_metadata(s_ptr, src_s, dst_s, admit, region_s, g_offs,
                                           rows_on[:, None] & (groups[None, :] * BC < ROW_LEN))
                    by_group = tl.reshape(raw.to(tl.float32), (raw.shape[0], TG, BC)) * scale[:, :, None]
                    tile = tl.reshape(by_group, (raw.shape[0], BK)).to(OUT_DTYPE)
                else:
                    scale = _load_metadata(s_ptr, src_s, dst_s, admit, region_s, s_offs, mask)
                    tile = (raw.to(tl.float32) * scale).to(OUT_DTYPE)
            else:
                tile = raw.to(OUT_DTYPE)
        return tile

    @triton.jit
    def _load_int4_tile(w_ptr, s_ptr, src_w, src_s, dst_w, dst_s, admit, region_w, region_s, region_z, offs_r,
                        rows_on, k0, ROW_LEN: tl.constexpr, SCOLS: tl.constexpr, BC: tl.constexpr,
                        ZERO: tl.constexpr, BK: tl.constexpr, OUT_DTYPE: tl.constexpr):
        """A 4-bit tile: BK/2 contiguous bytes per row, read as vectors (a zero-copy read over PCIe moves whole
        requests; byte-wise loads of the same bytes ran at a third of the link's rate on the H200), each byte's two
        inputs dequantised as W = (code - zero) * scale (quant.py) and interleaved back into input order. When the
        groups tile the tile (a group size that divides BK or that BK divides), each row's scales and zero points
        are loaded once per group and broadcast, not gathered once per byte: the gathers, two fp32 loads for every
        weight byte, were the GEMV's largest cost (int4 resident slower than bf16, BENCHMARKS issue 37)."""
        cb = k0 // 2 + tl.arange(0, BK // 2)  # byte columns: byte c holds inputs 2c (low nibble) and 2c + 1
        mask = rows_on[:, None] & (cb[None, :] < ROW_LEN // 2)
        offs = offs_r[:, None] * (ROW_LEN // 2) + cb[None, :]
        raw = tl.load(w_ptr + src_w + region_w + offs, mask=mask, other=0)
        if admit:
            tl.store(w_ptr + dst_w + region_w + offs, raw, mask=mask)
        if (BK % BC) * (BC % BK) == 0:  # one divides the other
            low, high = _int4_by_groups(raw, s_ptr, src_s, dst_s, admit, region_s, region_z, offs_r, rows_on, k0,
                                        ROW_LEN, SCOLS, BC, ZERO, BK)
        else:  # groups that straddle tiles: each byte's own group
            s_offs = offs_r[:, None] * SCOLS + (2 * cb[None, :]) // BC  # a group is even: both inputs share it
            scale, zero = _load_group_metadata(s_ptr, src_s, dst_s, admit, region_s, region_z, s_offs, mask, ZERO)
            byte = raw.to(tl.int32)
            low = ((byte & 15).to(tl.float32) - zero) * scale
            high = ((byte >> 4).to(tl.float32) - zero) * scale
        return tl.reshape(tl.join(low.to(OUT_DTYPE), high.to(OUT_DTYPE)), (low.shape[0], BK))

    @triton.jit
    def _int4_by_groups(raw, s_ptr, src_s, dst_s, admit, region_s, region_z, offs_r, rows_on, k0,
                        ROW_LEN: tl.constexpr, SCOLS: tl.constexpr, BC: tl.constexpr, ZERO: tl.constexpr,
                        BK: tl.constexpr):
        """The two inputs of each byte of raw [rows, BK/2] as fp32 weights, with one scale (and zero point) per row
        and group of the tile: TG groups of BC inputs, or one group when a group spans several tiles."""
        TG: tl.constexpr = (BK + BC - 1) // BC  # groups in the tile: BK / BC, or 1 when a group spans tiles
        groups = k0 // BC + tl.arange(0, TG)
        g_mask = rows_on[:, None] & (groups[None, :] * BC < ROW_LEN)
        g_offs = offs_r[:, None] * SCOLS + groups[None, :]
        scale, zero = _load_group_metadata(s_ptr, src_s, dst_s, admit, region_s, region_z, g_offs, g_mask, ZERO)
        byte = tl.reshape(raw.to(tl.int32), (raw.shape[0], TG, BK // 2 // TG))
        if ZERO:
            zero = zero[:, :, None]
        low = ((byte & 15).to(tl.float32) - zero) * scale[:, :, None]
        high = ((byte >> 4).to(tl.float32) - zero) * scale[:, :, None]
        return tl.reshape(low, (raw.shape[0], BK // 2)), tl.reshape(high, (raw.shape[0], BK // 2))

    @triton.jit
    def _load_metadata(s_ptr, src_s, dst_s, admit, region, s_offs, mask):
        """One metadata tile (scales or zero points, in the record's scale dtype) of the source record, copied into
        the admission slot as stored, returned in fp32 (exact: every scale dtype widens to fp32 without rounding)."""
        values = tl.load(s_ptr + src_s + region + s_offs, mask=mask, other=0.0)
        if admit:
            tl.store(s_ptr + dst_s + region + s_offs, values, mask=mask)
        return values.to(tl.float32)

    @triton.jit
    def _load_group_metadata(s_ptr, src_s, dst_s, admit, region_s, region_z, s_offs, mask, ZERO: tl.constexpr):
        """A 4-bit tile's scales and zero points (8 for symmetric groups: quant.INT4_SYMMETRIC_ZERO)."""
        scale = _load_metadata(s_ptr, src_s, dst_s, admit, region_s, s_offs, mask)
        if ZERO:
            zero = _load_metadata(s_ptr, src_s, dst_s, admit, region_z, s_offs, mask)
        else:
            zero = 8.0
        return scale, zero

    @triton.jit
    def _record_bases(u, u_key_ptr, u_slot_ptr, u_dst_ptr, delta_ptr, REC_W: tl.constexpr, REC_S: tl.constexpr):
        """Element offsets (from the pool's base) of expert u's source record and admission slot."""
        key = tl.load(u_key_ptr + u).to(tl.int64)
        slot = tl.load(u_slot_ptr + u).to(tl.int64)
        dst = tl.load(u_dst_ptr + u).to(tl.int64)
        w_delta = tl.load(delta_ptr)  # host arena - pool, in payload elements
        s_delta = tl.load(delta_ptr + 1)  # the same in metadata (scale dtype) elements
        src_w = tl.where(slot >= 0, slot * REC_W, w_delta + key * REC_W)
        src_s = tl.where(slot >= 0, slot * REC_S, s_delta + key * REC_S)
        return key, src_w, src_s, dst * REC_W, dst * REC_S, dst >= 0

    @triton.jit
    def _rows_of(u, assign_ptr, n_rows, TOPK: tl.constexpr, N_PAD: tl.constexpr, K_PAD: tl.constexpr):
        rows = tl.arange(0, N_PAD)
        ks = tl.arange(0, K_PAD)
        entries = tl.load(assign_ptr + rows[:, None] * TOPK + ks[None, :],
                          mask=(rows[:, None] < n_rows) & (ks[None, :] < TOPK), other=-1)
        return rows, tl.max((entries == u).to(tl.int32), axis=1) > 0

    @triton.jit
    def _gate_up_kernel(x_ptr, assign_ptr, u_key_ptr, u_slot_ptr, u_dst_ptr, w_ptr, s_ptr, delta_ptr, mid_ptr, n_rows,
                        H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, REC_W: tl.constexpr,
                        GATE_W: tl.constexpr, UP_W: tl.constexpr, REC_S: tl.constexpr, GATE_S: tl.constexpr,
                        UP_S: tl.constexpr, GATE_Z: tl.constexpr, UP_Z: tl.constexpr, SCOLS: tl.constexpr,
                        BR: tl.constexpr, BC: tl.constexpr, QUANT: tl.constexpr, INT4: tl.constexpr,
                        ZERO: tl.constexpr, ACT: tl.constexpr, N_PAD: tl.constexpr, K_PAD: tl.constexpr,
                        BI: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
                        FMA: tl.constexpr, SWAP: tl.constexpr):
        """mid[u, r, i-tile] = act(x_r . gate_u) * (x_r . up_u) for the rows r of expert u."""
        u = tl.program_id(0)
        tile = tl.program_id(1)
        key, src_w, src_s, dst_w, dst_s, admit = _record_bases(u, u_key_ptr, u_slot_ptr, u_dst_ptr, delta_ptr,
                                                               REC_W, REC_S)
        if key < 0:  # unused entries of the fixed grid do nothing
            return
        rows, row_on = _rows_of(u, assign_ptr, n_rows, TOPK, N_PAD, K_PAD)
        # dequantised weights stay fp32 on the CUDA cores (the FMAs are fp32: rounding them to the compute dtype
        # first cost two conversions a weight); tl.dot takes the compute dtype
        w_dtype: tl.constexpr = tl.float32 if FMA and QUANT else x_ptr.dtype.element_ty
        ri = tile * BI + tl.arange(0, BI)
        acc_g = _acc_zeros(N_PAD, BI, BK, FMA, SWAP)
        acc_u = _acc_zeros(N_PAD, BI, BK, FMA, SWAP)
        for k0 in range(0, H, BK):
            rk = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + rows[:, None] * H + rk[None, :], mask=row_on[:, None] & (rk[None, :] < H),
                         other=0.0)
            g = _load_weight_tile(w_ptr, s_ptr, src_w, src_s, dst_w, dst_s, admit, GATE_W, GATE_S, GATE_Z, ri,
                                  ri < I, k0, H, SCOLS, BR, BC, QUANT, INT4, ZERO, BK, w_dtype)
            up = _load_weight_tile(w_ptr, s_ptr, src_w, src_s, dst_w, dst_s, admit, UP_W, UP_S, UP_Z, ri,
                                   ri < I, k0, H, SCOLS, BR, BC, QUANT, INT4, ZERO, BK, w_dtype)
            acc_g = _acc_add(acc_g, xt, g, FMA, IEEE, DOT_F32, SWAP)
            acc_u = _acc_add(acc_u, xt, up, FMA, IEEE, DOT_F32, SWAP)
        mid = (activate(_acc_total(acc_g, FMA, SWAP), ACT) * _acc_total(acc_u, FMA, SWAP)).to(mid_ptr.dtype.element_ty)
        out = mid_ptr + (u * N_PAD + rows[:, None]) * I + ri[None, :]
        tl.store(out, mid, mask=row_on[:, None] & (ri[None, :] < I))

    @triton.jit
    def _down_kernel(mid_ptr, assign_ptr, u_key_ptr, u_slot_ptr, u_dst_ptr, w_ptr, s_ptr, delta_ptr, y_ptr, n_rows,
                     H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, REC_W: tl.constexpr,
                     DOWN_W: tl.constexpr, REC_S: tl.constexpr, DOWN_S: tl.constexpr, DOWN_Z: tl.constexpr,
                     SCOLS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, QUANT: tl.constexpr,
                     INT4: tl.constexpr, ZERO: tl.constexpr, N_PAD: tl.constexpr, K_PAD: tl.constexpr,
                     BH: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
                     FMA: tl.constexpr, SWAP: tl.constexpr):
        """y[u, r, h-tile] = mid[u, r] . down_u[h-tile] (fp32) for the rows r of expert u."""
        u = tl.program_id(0)
        tile = tl.program_id(1)
        key, src_w, src_s, dst_w, dst_s, admit = _record_bases(u, u_key_ptr, u_slot_ptr, u_dst_ptr, delta_ptr,
                                                               REC_W, REC_S)
        if key < 0:
            return
        rows, row_on = _rows_of(u, assign_ptr, n_rows, TOPK, N_PAD, K_PAD)
        w_dtype: tl.constexpr = tl.float32 if FMA and QUANT else mid_ptr.dtype.element_ty  # as in _gate_up_kernel
        rh = tile * BH + tl.arange(0, BH)
        acc = _acc_zeros(N_PAD, BH, BK, FMA, SWAP)
        for k0 in range(0, I, BK):
            rk = k0 + tl.arange(0, BK)
            m = tl.load(mid_ptr + (u * N_PAD + rows[:, None]) * I + rk[None, :],
                        mask=row_on[:, None] & (rk[None, :] < I), other=0.0)
            d = _load_weight_tile(w_ptr, s_ptr, src_w, src_s, dst_w, dst_s, admit, DOWN_W, DOWN_S, DOWN_Z, rh,
                                  rh < H, k0, I, SCOLS, BR, BC, QUANT, INT4, ZERO, BK, w_dtype)
            acc = _acc_add(acc, m, d, FMA, IEEE, DOT_F32, SWAP)
        out = y_ptr + (u * N_PAD + rows[:, None]) * H + rh[None, :]
        tl.store(out, _acc_total(acc, FMA, SWAP), mask=row_on[:, None] & (rh[None, :] < H))

    @triton.jit
    def _combine_kernel(y_ptr, assign_ptr, weights_ptr, out_ptr, H: tl.constexpr, TOPK: tl.constexpr,
                        N_PAD: tl.constexpr, BH: tl.constexpr):
        """out[r] = sum over j (fixed order) of weights[r, j] * y[assign[r, j], r]."""
        r = tl.program_id(0)
        rh = tl.program_id(1) * BH + tl.arange(0, BH)
        acc = tl.zeros([BH], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            u = tl.load(assign_ptr + r * TOPK + j)
            w = tl.load(weights_ptr + r * TOPK + j)
            valid = (rh * 0 + u) >= 0  # the entry's validity, as a block (a scalar mask does not broadcast everywhere)
            term = tl.load(y_ptr + (u.to(tl.int64) * N_PAD + r) * H + rh, mask=(rh < H) & valid, other=0.0)
            acc += tl.where(valid, w * term, 0.0)
        tl.store(out_ptr + r * H + rh, acc, mask=rh < H)


class RoutedExperts:
    """The fused routed-expert computation over one slot pool and host arena, with fixed scratch buffers (so the
    launches can be captured in a CUDA graph). Steps of at most GEMV_MAX_ROWS rows multiply on the CUDA cores with
    the format's GEMV tiles (GEMV_TILES; EIGHT_BIT_GEMV_TILES and INT4_GEMV_TILES, whose wider reductions read as
    many bytes a load), larger ones with tl.dot and DEFAULT_TILES (DOT_WIDE_TILES above 16-row tiles of unquantised
    records); `tiles` fixes one choice for all (benchmarks)."""

    def __init__(self, fmt: ExpertFormat, pool: torch.Tensor, host: torch.Tensor | None, act_name: str,
                 act: Callable[[torch.Tensor], torch.Tensor], max_rows: int, top_k: int, use_kernels: bool,
                 tiles: Tiles | None = None):
        self.fmt = fmt
        self.max_rows = max_rows
        self.tiles = tiles
        self.layout = RecordLayout.of(fmt)
        self.pool = pool
        self.host = host
        self.act = act
        self.top_k = top_k
        self.n_pad = row_pad(max_rows)  # rows of a tl.dot tile
        self.max_experts = max_rows * top_k  # distinct experts of one layer, at most (numbered in first-use order)
        self.use_kernels = use_kernels and act_name in ACTIVATIONS
        self.act_code = ACTIVATIONS.get(act_name, 0)
        if not self.use_kernels:
            return
        device = pool.device
        self._w, self._s, self._delta = record_views(fmt, pool, host)
        self._mid = torch.empty(self.max_experts, self.n_pad, fmt.intermediate, dtype=fmt.compute_dtype,
                                device=device)
        self._y = torch.empty(self.max_experts, self.n_pad, fmt.hidden, dtype=torch.float32, device=device)

    def __call__(self, x: torch.Tensor, assign: torch.Tensor, weights: torch.Tensor, u_key: torch.Tensor,
                 u_slot: torch.Tensor, u_dst: torch.Tensor, out: torch.Tensor | None = None,
                 step_rows: int | None = None) -> torch.Tensor:
        """Routed output [N, H] fp32. `step_rows` (default: the engine's maximum) bounds the rows of every call the
        caller makes with the same shape of step; it picks the multiply, so a row's bits never depend on how many
        rows one call happens to carry (extra shadow rows, inactive rows)."""
        if not self.use_kernels:
            result = routed_experts_reference(x, assign, weights, u_key, u_slot, u_dst, self.pool, self.host,
                                              self.fmt, self.act)
            return result if out is None else out.copy_(result)
        out = torch.empty(assign.shape[0], self.layout.hidden, dtype=torch.float32, device=x.device) \
            if out is None else out
        for launch in self.launches(x, assign, weights, u_key, u_slot, u_dst, out, step_rows or self.max_rows):
            launch()
        return out

    def terms(self, x: torch.Tensor, assign: torch.Tensor, u_key: torch.Tensor, u_slot: torch.Tensor,
              u_dst: torch.Tensor, step_rows: int | None = None) -> torch.Tensor:
        """Each (row, k) entry's product [N, k, H] fp32, zeros where assign < 0 (expert parallelism sums these over
        the ranks before combining them)."""
        if not self.use_kernels:
            return expert_terms_reference(x, assign, u_key, u_slot, u_dst, self.pool, self.host, self.fmt, self.act)
        n = assign.shape[0]
        for launch in self.product_launches(x, assign, u_key, u_slot, u_dst, step_rows or self.max_rows):
            launch()  # y[u, row]; the ranks' all-reduce comes before the combine
        y = self.products(step_rows or self.max_rows)
        gathered = y[assign.clamp(min=0).long(), torch.arange(n, device=x.device)[:, None]]  # [N, k, H]
        return torch.where((assign >= 0)[..., None], gathered, 0.0)

    def launches(self, x: torch.Tensor, assign: torch.Tensor, weights: torch.Tensor, u_key: torch.Tensor,
                 u_slot: torch.Tensor, u_dst: torch.Tensor, out: torch.Tensor, step_rows: int) -> list[Launch]:
        assert out.shape[-1] == self.layout.hidden and out.shape[0] >= assign.shape[0], (out.shape, assign.shape)
        return self.product_launches(x, assign, u_key, u_slot, u_dst, step_rows) + \
            [self._combine(assign.shape[0], assign, weights, out, self._n_pad(step_rows))]

    def product_launches(self, x: torch.Tensor, assign: torch.Tensor, u_key: torch.Tensor, u_slot: torch.Tensor,
                         u_dst: torch.Tensor, step_rows: int) -> list[Launch]:
        """gate/up and down: each selected expert's product y[u, row] for its rows (fp32)."""
        n, k = assign.shape
        gemv = step_rows <= GEMV_MAX_ROWS
        lay = self.layout
        n_pad = self._n_pad(step_rows)
        # tiles wider than 16 rows take the one-stage choice where it was measured (unquantised records)
        wide = n_pad > ROW_PAD_MIN and not lay.quantized
        gemv_tiles = INT4_GEMV_TILES if lay.int4 else EIGHT_BIT_GEMV_TILES if lay.quantized else GEMV_TILES
        t = self.tiles or (gemv_tiles if gemv else DOT_WIDE_TILES if wide else DEFAULT_TILES)
        u_count = min(u_key.shape[0], n * k)  # u is numbered in first-use order: u < rows x k
        assert n <= min(step_rows, self.max_rows) and u_count <= self.max_experts and x.is_contiguous()
        assert x.shape[1] == lay.hidden, (x.shape, lay.hidden)  # the kernels index rows by the expert's shape
        ieee = x.dtype == torch.float32
        common = dict(assign_ptr=assign, u_key_ptr=u_key, u_slot_ptr=u_slot, u_dst_ptr=u_dst, w_ptr=self._w,
                      s_ptr=self._s, delta_ptr=self._delta, n_rows=n, H=lay.hidden, I=lay.intermediate, TOPK=k,
                      REC_W=lay.rec_w, **lay.quant_args(), N_PAD=n_pad, K_PAD=max(2, 1 << (k - 1).bit_length()), BK=t.block_k,
                      IEEE=ieee, DOT_F32=INTERPRET and not ieee, FMA=gemv, SWAP=bool(t.weights_first) and not gemv)
        shape = dict(num_warps=t.num_warps, num_stages=t.num_stages)
        return [
            Launch(_gate_up_kernel, (u_count, triton.cdiv(lay.intermediate, t.block_i)), **shape, x_ptr=x,
                   mid_ptr=self._mid, GATE_W=lay.gate_w, UP_W=lay.up_w, GATE_S=lay.gate_s, UP_S=lay.up_s,
                   GATE_Z=lay.gate_z, UP_Z=lay.up_z, SCOLS=triton.cdiv(lay.hidden, lay.block_cols), ACT=self.act_code, BI=t.block_i, **common),
            Launch(_down_kernel, (u_count, triton.cdiv(lay.hidden, t.block_h)), **shape, mid_ptr=self._mid,
                   y_ptr=self._y, DOWN_W=lay.down_w, DOWN_S=lay.down_s, DOWN_Z=lay.down_z,
                   SCOLS=triton.cdiv(lay.intermediate, lay.block_cols), BH=t.block_h, **common),
        ]

    def products(self, step_rows: int) -> torch.Tensor:
        """The last call's expert products as y[u, row, H] fp32 (rows padded: `_n_pad`), for steps of `step_rows`."""
        n_pad = self._n_pad(step_rows)
        return self._y.view(-1)[: self._y.shape[0] * n_pad * self.layout.hidden].view(-1, n_pad, self.layout.hidden)

    def _n_pad(self, step_rows: int) -> int:
        """Rows per expert in y's layout for steps of `step_rows` rows (the GEMV's or a tl.dot tile's)."""
        return next_pow2(step_rows, GEMV_MIN_ROWS) if step_rows <= GEMV_MAX_ROWS else \
            row_pad(min(step_rows, self.max_rows))

    def _combine(self, n: int, assign: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, n_pad: int) -> Launch:
        return Launch(_combine_kernel, (n, triton.cdiv(self.layout.hidden, 256)), y_ptr=self._y, assign_ptr=assign,
                      weights_ptr=weights, out_ptr=out, H=self.layout.hidden, TOPK=assign.shape[1], N_PAD=n_pad,
                      BH=256)
