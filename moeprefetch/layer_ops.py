"""The decoder layer's pieces computed by fused Triton kernels, for the device's decode step.

`FusedOps` overrides the definitions of `model.LayerOps` (which the CPU path and prefill run): residual add and
RMSNorm in one kernel, the router's selection in one kernel, the MLP's activation-times-up in one kernel, and MLA
decode attention over each row's real context length (`kernels/attention.py`). The projections stay cuBLAS GEMVs,
which read weights at HBM speed. Results match the definitions within rounding (tests state the tolerance); they are
bit-stable run to run, because no kernel's configuration depends on the data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelArgs
from .kernels.attention import MLADecode
from .kernels.gqa_attention import GQADecode
from .kernels.norm import act_mul, residual_norm
from .kernels.router import select_experts
from .model import GQAKV, LayerKV, LayerOps, Routing, absorbed_weights, gqa_decode_queries, linear, router_shape
from .rope import RotaryEmbedding
from .weights import AttentionWeights, GQAWeights, LayerWeights, Linear, MLPWeights, RouterWeights, projection_groups


def adjacent(parts: list[Linear]) -> bool:
    """The parts' weights already lie one after another in one buffer (a streamed layer's ring record)."""
    first = parts[0].weight
    end = first.data_ptr()
    for p in parts:
        w = p.weight
        if (not w.is_contiguous() or w.dtype != first.dtype or w.shape[1:] != first.shape[1:]
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or w.data_ptr() != end):
            return False
        end += w.numel() * w.element_size()
    return True


def fuse_rows(parts: list[Linear], views_only: bool = False) -> torch.Tensor | None:
    """One weight [sum of outs, in] for projections that read the same input; each part's weight becomes a view into
    it, so the memory is not doubled and every other reader (prefill) keeps working. Parts that are adjacent already
    (a streamed layer's ring record places them so) are spanned by a view, with no copy. None where a part has a
    bias, or where `views_only` (the parts live in a streaming ring, whose bytes change) and they are not adjacent."""
    if any(p.bias is not None for p in parts):
        return None
    if adjacent(parts):
        first = parts[0].weight
        return torch.as_strided(first, (sum(p.weight.shape[0] for p in parts), *first.shape[1:]), first.stride())
    if views_only:
        return None
    fused = torch.cat([p.weight for p in parts])
    start = 0
    for p in parts:
        rows = p.weight.shape[0]
        p.weight = fused[start : start + rows]
        start += rows
    return fused


class FusedOps(LayerOps):
    """Fused kernels for rows of decode steps; `use_kernels=False` gives the same structure on the references (what
    the CPU tests compare against without Triton's interpreter).

    Given the layers' weights (`fuse`), projections that read the same input (`weights.projection_groups`) become one
    GEMV, `streamed` layers' too (their ring records hold each group's rows adjacent, spanned by a view), so a layer
    computes the same bits whether it streams or not."""

    def __init__(self, args: ModelArgs, act, act_name: str, rope: RotaryEmbedding, capacity: int, max_rows: int,
                 device: torch.device, use_kernels: bool = True,
                 fuse: list[LayerWeights] | None = None, streamed: frozenset[int] = frozenset()):
        super().__init__(args, act, rope)
        self.act_name = act_name
        self.use_kernels = use_kernels
        self._fused: dict[int, torch.Tensor] = {}  # id(weights object) -> its fused projection
        for lw in fuse or []:
            self._fuse_layer(lw, views_only=lw.index in streamed)
        if fuse and device.type == "cuda":
            torch.cuda.empty_cache()  # the parts' old blocks: fused copies replaced them
        self.router = router_shape(args)
        self.mla = MLADecode(args.num_attention_heads, args.qk_nope_head_dim, args.kv_lora_rank,
                             args.qk_rope_head_dim, capacity, max_rows, device, use_kernels) \
            if args.attention == "mla" else None
        self.gqa = GQADecode(args.num_attention_heads, args.num_key_value_heads, args.qk_head_dim, capacity,
                             max_rows, args.sliding_window, device, use_kernels) if args.attention == "gqa" else None

    def _fuse_layer(self, lw: LayerWeights, views_only: bool) -> None:
        for owner, parts in projection_groups(lw):
            fused = fuse_rows(parts, views_only)
            if fused is not None:
                self._fused[id(owner)] = fused

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return residual_norm(x.contiguous(), [], weight, self.args.rms_norm_eps, self.use_kernels)[1]

    def residual_norm(self, x: torch.Tensor, deltas: list[torch.Tensor], weight: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        deltas = [d.contiguous() for d in deltas]
        return residual_norm(x.contiguous(), deltas, weight, self.args.rms_norm_eps, self.use_kernels)

    def route(self, router: RouterWeights, h: torch.Tensor) -> Routing:
        logits = F.linear(h.float(), router.weight)
        ids, weights, choice = select_experts(self.router, logits, router.bias, self.use_kernels)
        return Routing(ids=ids, weights=weights, scores=choice)

    def mlp(self, w: MLPWeights, h: torch.Tensor) -> torch.Tensor:
        fused = self._fused.get(id(w))
        if fused is None:
            gate, up = linear(h, w.gate_proj), linear(h, w.up_proj)
        else:
            gate, up = F.linear(h, fused).chunk(2, dim=-1)
        return linear(act_mul(gate, up, self.act_name, self.act, self.use_kernels), w.down_proj)

    def attend_decode(self, w: AttentionWeights | GQAWeights, x: torch.Tensor, positions: torch.Tensor,
                      kv: LayerKV | GQAKV, slots: torch.Tensor | None = None) -> torch.Tensor:
        """`model.attention_absorbed` (or the grouped-query definition) over each row's keys 0..slot only: x [B, L, H]
        at rotary `positions` [B, L], stored at cache index `slots` (default: the positions)."""
        args = self.args
        if not self.use_kernels:
            return super().attend_decode(w, x, positions, kv, slots)
        slots = positions if slots is None else slots
        if self.gqa is not None:
            return self._attend_gqa(w, x, positions, kv, slots)
        b, length, hidden = x.shape
        rows, heads, nope = b * length, args.num_attention_heads, args.qk_nope_head_dim
        flat = x.reshape(rows, hidden)
        fused = self._fused.get(id(w))
        query = w.q_proj if w.q_proj is not None else w.q_a_proj
        if fused is None:
            q, kv_a = linear(flat, query), linear(flat, w.kv_a_proj)
        else:
            q, kv_a = F.linear(flat, fused).split([query.weight.shape[0], w.kv_a_proj.weight.shape[0]], dim=-1)
        if w.q_proj is None:
            q = linear(self.norm(q, w.q_a_norm), w.q_b_proj)
        q = q.view(rows, heads, args.qk_head_dim)
        slots_flat = slots.reshape(rows).contiguous()
        self.mla.prepare(q, kv_a, positions.reshape(rows).contiguous(), slots_flat, length,
                         kv.latent, kv.rope, w.kv_a_norm, args.rms_norm_eps, self.rope.inv_freq,
                         self.rope.attention_factor, self.rope.interleave)
        w_uk, w_uv = absorbed_weights(args, w)  # [h, n, c], [h, v, c]
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk)  # [h, R, c]
        out_latent = self.mla.attend(q_latent, q, kv.latent, kv.rope, slots_flat, length, args.softmax_scale)
        out = torch.bmm(out_latent, w_uv.transpose(1, 2))  # [h, R, v]
        return linear(out.transpose(0, 1).reshape(b, length, heads * args.v_head_dim), w.o_proj)

    def _attend_gqa(self, w: GQAWeights, x: torch.Tensor, positions: torch.Tensor, kv: GQAKV,
                    slots: torch.Tensor) -> torch.Tensor:
        """`model.attention_gqa_decode` over each row's keys 0..slot only (within its sliding window, if any)."""
        args = self.args
        b, length, _ = x.shape
        fused = self._fused.get(id(w))  # q, k and v as one GEMV (none where they have biases)
        q = gqa_decode_queries(args, w, self.rope, x, positions, kv, slots,
                               F.linear(x, fused) if fused is not None else None)
        out = self.gqa.attend(q.reshape(b * length, args.num_attention_heads, args.qk_head_dim).contiguous(),
                              kv.key, kv.value, slots.reshape(-1).contiguous(), length, args.softmax_scale)
        return linear(out.view(b, length, -1), w.o_proj)
