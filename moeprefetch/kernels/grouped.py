"""Routed experts of a block of many tokens (prefill chunks) as one grouped GEMM per projection.

Two ways, chosen by the expert format and the device (`grouped_mm_usable`), never by the cache:

- `grouped_mm_experts`: torch._grouped_mm (CUTLASS) over experts whose records are rows of one strided tensor (a
  layer's consecutive slots, or consecutive staging rows), for bf16 experts on Hopper;
- `GroupedExperts`: Triton kernels for the other formats. The (token, k) pairs of a chunk are sorted by distinct
  expert u (`plan_blocks`, on the host or the device) and cut into blocks of at most BLOCK_M pairs of one expert. One
  program per (block, output tile) multiplies its pairs' rows by the expert's weight tile, read through the same
  record table as decode (`experts.py`): a VRAM slot (staging rows after the pool are addressed as slots), or the
  pinned host record over PCIe.

Triton inputs
    x [T, H]           the chunk's router inputs
    pair_token [P]     token of each sorted pair (P = T x k)
    blocks [NB, 3]     int32 (u, first sorted pair, pairs) per block; u = -1 for the unused blocks at the end
    u_key, u_slot      as in experts.py (u_dst unused: admissions are copied in before or after the launch)
Output y [P, H] fp32 per sorted pair; the caller puts the pairs back in (token, k) order and combines them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from . import HAS_TRITON, INTERPRET, Launch
from .definitions import expert_ffn
from .experts import ACTIVATIONS, RecordLayout, record_views
from .tiles import LONG_BLOCK_PAIRS, LONG_BLOCK_TILES, SHORT_BLOCK_INT4_TILES, SHORT_BLOCK_TILES, GroupedTiles

if TYPE_CHECKING:  # a record format (`expert_records.ExpertFormat`) is read only through its attributes here
    from ..expert_records import ExpertFormat

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from .common import activate, dot
    from .experts import _load_weight_tile, _record_bases

BLOCK_M = SHORT_BLOCK_TILES.block_m  # pairs per block of the short prompts' tiles (the default)
logger = logging.getLogger(__name__)


def plan_blocks(ids: torch.Tensor, u_of_expert: torch.Tensor, block_m: int = BLOCK_M, n_u: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k], u_of_expert [E] (distinct index u of each routed expert, < n_u) -> (pair_token [P], order [P]: the
    pair index t*k+j of each sorted pair, blocks [NB, 3]) on the ids' device.

    Fixed shapes, so that a device never waits for the host: NB = ceil(P / block_m) + n_u, the most blocks any
    routing can need; the blocks in use come first, in (u, first pair) order, and the rest are (-1, 0, 0), which the
    kernels skip. Tensor operations only: a long prompt has ~10^5 pairs per layer, too many for a Python loop."""
    t, k = ids.shape
    dev = ids.device
    u = u_of_expert[ids.flatten()].long()
    n_u = int(u_of_expert.max()) + 1 if n_u is None else n_u
    # by expert, then pair index: a stable sort of narrow keys (~2x faster on the host than int64 keys)
    order = torch.sort(u.to(torch.int16 if n_u <= 1 << 15 and dev.type == "cpu" else torch.int32),
                       stable=True).indices
    # pairs of each u; not bincount, whose output size would make a device wait for the host
    counts = torch.zeros(n_u, dtype=torch.int64, device=dev).index_add_(0, u, torch.ones_like(u))
    per_u = (counts + block_m - 1) // block_m  # blocks of each u
    block_end = torch.cumsum(per_u, 0)
    b = torch.arange(-(-t * k // block_m) + n_u, device=dev)
    block_u = torch.searchsorted(block_end, b, right=True)  # n_u past the last block in use
    in_use = block_u < n_u
    bu = block_u.clamp(max=n_u - 1)
    nth = b - (block_end - per_u)[bu]
    first = (torch.cumsum(counts, 0) - counts)[bu] + nth * block_m
    count = torch.minimum(counts[bu] - nth * block_m, torch.full_like(nth, block_m))
    blocks = torch.stack((block_u, first, count), 1).masked_fill(~in_use[:, None], 0)
    blocks[:, 0].masked_fill_(~in_use, -1)
    return (order // k).to(torch.int32), order, blocks.to(torch.int32)


def grouped_reference(x: torch.Tensor, pair_token: torch.Tensor, blocks: torch.Tensor, u_key: torch.Tensor,
                      u_slot: torch.Tensor, pool: torch.Tensor, host: torch.Tensor | None, fmt: ExpertFormat,
                      act: Callable[[torch.Tensor], torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: each block's pairs through its expert (compute dtype GEMMs), y [P, H] fp32 (into `out`, whose
    rows outside the blocks are left as they are)."""
    y = torch.zeros(pair_token.shape[0], x.shape[1], dtype=torch.float32, device=x.device) if out is None else out
    for u, first, count in blocks.tolist():
        if u < 0:
            continue
        slot, key = int(u_slot[u]), int(u_key[u])
        record = pool[slot] if slot >= 0 else host[key].to(pool.device)  # type: ignore[index]
        gate_up, down = fmt.dequantize(record.view(1, -1))
        tokens = pair_token[first : first + count].long()
        y[first : first + count] = expert_ffn(x[tokens], gate_up[0], down[0], act).float()
    return y


def grouped_mm_usable(fmt: ExpertFormat, device: torch.device) -> bool:
    """Whether prefill's experts run as torch._grouped_mm (CUTLASS grouped GEMMs, ~2.4x the Triton kernel's rate on
    the H200, experiments/results/grouped_h200.json): bf16 experts on a Hopper-or-later GPU, with a torch that has it.
    Decided by the engine's format and device, never by its cache, so every cache size computes the same bits."""
    lay = RecordLayout.of(fmt)
    aligned = all(v % 8 == 0 for v in (lay.hidden, lay.intermediate, lay.rec_w, lay.gate_w, lay.down_w))  # 16 B
    return (device.type == "cuda" and hasattr(torch, "_grouped_mm") and not fmt.quantized and aligned
            and fmt.payload_dtype == torch.bfloat16 and lay.up_w == lay.gate_w + lay.intermediate * lay.hidden
            and torch.cuda.get_device_capability(device)[0] >= 9)


def grouped_mm_experts(x_sorted: torch.Tensor, counts: torch.Tensor, records: torch.Tensor, fmt: ExpertFormat,
                       act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x_sorted [P, H]: pairs sorted by group, counts[g] of them through the expert in records[g] ([G, record bytes],
    rows of one strided tensor: a layer's slots, or consecutive staging rows) -> [P, H] in x's dtype.

    One grouped GEMM per projection, as transformers computes an expert: gate/up rounded to the compute dtype before
    the activation. A pair's result depends only on its row and its expert, not on the other groups of the call
    (no split over K), which the GPU tests check bit for bit across groupings."""
    lay = RecordLayout.of(fmt)
    h, i = lay.hidden, lay.intermediate
    w = records.view(fmt.payload_dtype)
    gate_up = w[:, lay.gate_w : lay.gate_w + 2 * i * h].unflatten(1, (2 * i, h)).transpose(1, 2)  # [G, H, 2I]
    down = w[:, lay.down_w : lay.down_w + h * i].unflatten(1, (h, i)).transpose(1, 2)  # [G, I, H]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    hidden = torch._grouped_mm(x_sorted, gate_up, offs=offs)
    return torch._grouped_mm(act(hidden[:, :i]) * hidden[:, i:], down, offs=offs)


if HAS_TRITON:

    @triton.jit
    def _block_rows(blocks_ptr, b, BM: tl.constexpr):
        u = tl.load(blocks_ptr + 3 * b)
        first = tl.load(blocks_ptr + 3 * b + 1)
        count = tl.load(blocks_ptr + 3 * b + 2)
        pairs = first + tl.arange(0, BM)
        return u, pairs, pairs < first + count

    @triton.jit
    def _grouped_gate_up_kernel(x_ptr, pair_token_ptr, blocks_ptr, u_key_ptr, u_slot_ptr, w_ptr, s_ptr, delta_ptr,
                                mid_ptr, H: tl.constexpr, I: tl.constexpr, REC_W: tl.constexpr, GATE_W: tl.constexpr,
                                UP_W: tl.constexpr, REC_S: tl.constexpr, GATE_S: tl.constexpr, UP_S: tl.constexpr,
                                GATE_Z: tl.constexpr, UP_Z: tl.constexpr, SCOLS: tl.constexpr, BR: tl.constexpr,
                                BC: tl.constexpr, QUANT: tl.constexpr, INT4: tl.constexpr, ZERO: tl.constexpr,
                                ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        """mid[pair, n-tile] = act(x_token . gate_u) * (x_token . up_u) for the pairs of one block."""
        u, pairs, on = _block_rows(blocks_ptr, tl.program_id(0), BM)
        if u < 0:
            return
        # no admission here (admitted experts were copied in first): the destination outputs go unused
        key, src_w, src_s, dst_w, dst_s, admit = _record_bases(u, u_key_ptr, u_slot_ptr, u_slot_ptr, delta_ptr,
                                                               REC_W, REC_S)
        tokens = tl.load(pair_token_ptr + pairs, mask=on, other=0).to(tl.int64)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            rk = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + tokens[:, None] * H + rk[None, :], mask=on[:, None] & (rk[None, :] < H), other=0.0)
            g = _load_weight_tile(w_ptr, s_ptr, src_w, src_s, dst_w, dst_s, False, GATE_W, GATE_S, GATE_Z, rn,
                                  rn < I, k0, H, SCOLS, BR, BC, QUANT, INT4, ZERO, BK, x_ptr.dtype.element_ty, False)
            up = _load_weight_tile(w_ptr, s_ptr, src_w, src_s, dst_w, dst_s, False, UP_W, UP_S, UP_Z, rn,
                                   rn < I, k0, H, SCOLS, BR, BC, QUANT, INT4, ZERO, BK, x_ptr.dtype.element_ty, False)
            acc_g += dot(xt, tl.trans(g), IEEE, DOT_F32)
            acc_u += dot(xt, tl.trans(up), IEEE, DOT_F32)
        mid = (activate(acc_g, ACT) * acc_u).to(mid_ptr.dtype.element_ty)
        tl.store(mid_ptr + pairs[:, None].to(tl.int64) * I + rn[None, :], mid, mask=on[:, None] & (rn[None, :] < I))

    @triton.jit
    def _grouped_down_kernel(mid_ptr, blocks_ptr, u_key_ptr, u_slot_ptr, w_ptr, s_ptr, delta_ptr, y_ptr,
                             H: tl.constexpr, I: tl.constexpr, REC_W: tl.constexpr, DOWN_W: tl.constexpr,
                             REC_S: tl.constexpr, DOWN_S: tl.constexpr, DOWN_Z: tl.constexpr, SCOLS: tl.constexpr,
                             BR: tl.constexpr, BC: tl.constexpr, QUANT: tl.constexpr, INT4: tl.constexpr,
                             ZERO: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        """y[pair, n-tile] = mid[pair] . down_u[n-tile] (fp32) for the pairs of one block."""
        u, pairs, on = _block_rows(blocks_ptr, tl.program_id(0), BM)
        if u < 0:
            return
        key, src_w, src_s, dst_w, dst_s, admit = _record_bases(u, u_key_ptr, u_slot_ptr, u_slot_ptr, delta_ptr,
                                                               REC_W, REC_S)
        rows = pairs.to(tl.int64)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            rk = k0 + tl.arange(0, BK)
            m = tl.load(mid_ptr + rows[:, None] * I + rk[None, :], mask=on[:, None] & (rk[None, :] < I), other=0.0)
            d = _load_weight_tile(w_ptr, s_ptr, src_w, src_s, dst_w, dst_s, False, DOWN_W, DOWN_S, DOWN_Z, rn,
                                  rn < H, k0, I, SCOLS, BR, BC, QUANT, INT4, ZERO, BK, mid_ptr.dtype.element_ty, False)
            acc += dot(m, tl.trans(d), IEEE, DOT_F32)
        tl.store(y_ptr + rows[:, None] * H + rn[None, :], acc, mask=on[:, None] & (rn[None, :] < H))


class GroupedExperts:
    """Prefill's routed experts: one grouped GEMM per projection over the slot pool and the host arena."""

    def __init__(self, fmt: ExpertFormat, pool: torch.Tensor, host: torch.Tensor | None, act_name: str,
                 act: Callable[[torch.Tensor], torch.Tensor], use_kernels: bool, tiles: GroupedTiles | None = None):
        self.fmt, self.pool, self.host, self.act = fmt, pool, host, act
        self.fixed_tiles = tiles  # a benchmark's choice; otherwise chosen per call by `tiles_for`
        self.layout = RecordLayout.of(fmt)
        self.use_kernels = use_kernels and act_name in ACTIVATIONS
        self.act_code = ACTIVATIONS.get(act_name, 0)
        if self.use_kernels:
            self._w, self._s, self._delta = record_views(fmt, pool, host)

    def tiles_for(self, pairs: int, n_experts: int) -> GroupedTiles:
        """The tiles of a call with `pairs` (token, expert) pairs over a model of `n_experts` routed experts: by the
        call's shape, never by its routing."""
        if self.fixed_tiles is not None:
            return self.fixed_tiles
        if pairs >= LONG_BLOCK_PAIRS * n_experts:
            return LONG_BLOCK_TILES
        return SHORT_BLOCK_INT4_TILES if self.fmt.int4 else SHORT_BLOCK_TILES

    def __call__(self, x: torch.Tensor, pair_token: torch.Tensor, blocks: torch.Tensor, u_key: torch.Tensor,
                 u_slot: torch.Tensor, y: torch.Tensor | None = None, mid: torch.Tensor | None = None,
                 tiles: GroupedTiles | None = None) -> torch.Tensor:
        """y [P, H] fp32: each sorted pair's expert output. Given `y` (and `mid`, the [P, I] intermediate), only the
        pairs of `blocks` are written, so a layer may run its experts in several calls into one buffer. `tiles` must
        be those whose block_m cut the blocks (default: the fixed tiles, else the 64-pair ones)."""
        if not self.use_kernels:
            return grouped_reference(x, pair_token, blocks, u_key, u_slot, self.pool, self.host, self.fmt, self.act,
                                     out=y)
        if mid is None:
            mid = torch.empty(pair_token.shape[0], self.fmt.intermediate, dtype=x.dtype, device=x.device)
        if y is None:
            y = torch.empty(pair_token.shape[0], self.fmt.hidden, dtype=torch.float32, device=x.device)
        try:
            tiles = tiles or self.fixed_tiles or SHORT_BLOCK_TILES
            for launch in self.launches(x.contiguous(), pair_token, blocks, u_key, u_slot, mid, y, tiles):
                launch()
        except (CompilationError, OutOfResources) as exc:
            # a compiler that rejects the kernel must not take prefill down: the definition computes the same
            logger.warning("the grouped prefill kernel did not compile here (%s); prefill uses the reference", exc)
            self.use_kernels = False
            return self(x, pair_token, blocks, u_key, u_slot, y=y, tiles=tiles)
        return y

    def launches(self, x, pair_token, blocks, u_key, u_slot, mid, y, tiles: GroupedTiles) -> list[Launch]:
        lay, t = self.layout, tiles
        ieee = x.dtype == torch.float32
        common = dict(blocks_ptr=blocks, u_key_ptr=u_key, u_slot_ptr=u_slot, w_ptr=self._w, s_ptr=self._s,
                      delta_ptr=self._delta, H=lay.hidden, I=lay.intermediate, REC_W=lay.rec_w, **lay.quant_args(),
                      BM=t.block_m, BN=t.block_n, BK=t.block_k, IEEE=ieee, DOT_F32=INTERPRET and not ieee)
        shape = dict(num_warps=t.num_warps, num_stages=t.num_stages)
        n_blocks = blocks.shape[0]
        return [
            Launch(_grouped_gate_up_kernel, (n_blocks, triton.cdiv(lay.intermediate, t.block_n)), **shape, x_ptr=x,
                   pair_token_ptr=pair_token, mid_ptr=mid, GATE_W=lay.gate_w, UP_W=lay.up_w, GATE_S=lay.gate_s,
                   UP_S=lay.up_s, GATE_Z=lay.gate_z, UP_Z=lay.up_z, SCOLS=triton.cdiv(lay.hidden, lay.block_cols), ACT=self.act_code, **common),
            Launch(_grouped_down_kernel, (n_blocks, triton.cdiv(lay.hidden, t.block_n)), **shape, mid_ptr=mid,
                   y_ptr=y, DOWN_W=lay.down_w, DOWN_S=lay.down_s, DOWN_Z=lay.down_z,
                   SCOLS=triton.cdiv(lay.intermediate, lay.block_cols), **common),
        ]
