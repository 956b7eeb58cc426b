"""Pure compute of the decoder blocks: RMSNorm, DeepSeek's MLA attention (expanded and absorbed forms), grouped-query
attention (Qwen3-MoE, Mixtral), routers, MLPs.

Functions take weights and activations and return activations; nothing here knows where weights live or how routed
experts arrive (that is `residency/`). Shapes: B batch, T/L tokens per row, S key positions, h heads, H hidden,
c = kv_lora_rank, r = qk_rope_head_dim, n = qk_nope_head_dim, v = v_head_dim.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from .config import ModelArgs
from .kernels.experts import combine_in_k_order
from .kernels.norm import residual_norm_reference
from .kernels.norm import rms_norm_reference as rms_norm
from .kernels.router import RouterShape, select_experts_reference
from .rope import RotaryEmbedding
from .weights import AttentionWeights, GQAWeights, LayerWeights, Linear, MLPWeights, MTPWeights, RouterWeights


# Prefill attention leaves cuDNN's backend out: it builds a plan for every new sequence length, and on the H200 a
# prompt of a length not seen before spent ~40 ms in six such calls (seconds with cold caches) before its first token.
# The memory-efficient kernel takes the causal mask and unequal key/value head sizes with no per-shape cost.
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def linear(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def mlp(w: MLPWeights, x: torch.Tensor, act) -> torch.Tensor:
    return linear(act(linear(x, w.gate_proj)) * linear(x, w.up_proj), w.down_proj)


# ---- attention ----------------------------------------------------------------------------------------------------


@dataclass
class LayerKV:
    """Compressed MLA cache of one layer: the normalised latent and the rotated shared rope key."""

    latent: torch.Tensor  # [B, S_cap, c]
    rope: torch.Tensor  # [B, S_cap, r]


def _queries(args: ModelArgs, w: AttentionWeights, x: torch.Tensor) -> torch.Tensor:
    """x [..., H] -> q [..., h, n + r]."""
    if w.q_proj is not None:
        q = linear(x, w.q_proj)
    else:
        q = linear(rms_norm(linear(x, w.q_a_proj), w.q_a_norm, args.rms_norm_eps), w.q_b_proj)
    return q.unflatten(-1, (args.num_attention_heads, args.qk_head_dim))


def _latent_kv(args: ModelArgs, w: AttentionWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (normalised latent [..., c], un-rotated rope key [..., r])."""
    kv = linear(x, w.kv_a_proj)
    latent, k_rope = kv.split([args.kv_lora_rank, args.qk_rope_head_dim], dim=-1)
    return rms_norm(latent, w.kv_a_norm, args.rms_norm_eps), k_rope


def attention_expanded(
    args: ModelArgs,
    w: AttentionWeights,
    rope: RotaryEmbedding,
    x: torch.Tensor,
    positions: torch.Tensor,
    kv: LayerKV | None = None,
    row: int = 0,
    start: int = 0,
) -> torch.Tensor:
    """Attention over a block of T new tokens (prefill chunk or uncached forward), keys expanded per head.

    x [B, T, H] at `positions` [B, T]. Without `kv`, keys are the T tokens themselves (uncached forward). With `kv`
    (then B == 1), the new latents are written at [row, start:start+T] and the keys are the cache's [0, start+T).
    """
    b, t, _ = x.shape
    heads, n = args.num_attention_heads, args.qk_nope_head_dim
    q = _queries(args, w, x)  # [B, T, h, n+r]
    q_nope, q_rope = q.split([n, args.qk_rope_head_dim], dim=-1)
    latent, k_rope = _latent_kv(args, w, x)
    cos, sin = rope.cos_sin(positions)  # [B, T, r/2]
    q_rope = rope.apply(q_rope, cos[:, :, None], sin[:, :, None])
    k_rope = rope.apply(k_rope, cos, sin)
    if kv is not None:
        kv.latent[row, start : start + t] = latent[0]
        kv.rope[row, start : start + t] = k_rope[0]
        latent = kv.latent[row : row + 1, : start + t]
        k_rope = kv.rope[row : row + 1, : start + t]
    s = latent.shape[1]
    expanded = linear(latent, w.kv_b_proj).unflatten(-1, (heads, n + args.v_head_dim))  # [B, S, h, n+v]
    k_nope, value = expanded.split([n, args.v_head_dim], dim=-1)
    keys = torch.cat((k_nope, k_rope[:, :, None].expand(b, s, heads, -1)), dim=-1)  # [B, S, h, n+r]
    queries = torch.cat((q_nope, q_rope), dim=-1)
    if x.is_cuda:  # the chunk's queries are the last T of S keys: causal aligned to the lower right, no mask tensor
        causal = causal_lower_right(t, s)
    else:
        causal = torch.arange(s, device=x.device)[None, :] <= torch.arange(start, start + t, device=x.device)[:, None]
    # a fused attention kernel (memory-efficient on CUDA): no [B, h, T, S] score tensor, so long prompts fit
    with sdpa_kernel(_PREFILL_BACKENDS) if x.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=causal, scale=args.softmax_scale)  # [B, h, T, v]
    return linear(out.transpose(1, 2).flatten(2), w.o_proj)


# ---- grouped-query attention (Qwen3-MoE, Mixtral) ------------------------------------------------------------------


@dataclass
class GQAKV:
    """K/V cache of one grouped-query attention layer (keys rotated)."""

    key: torch.Tensor  # [B, S_cap, h_kv, d]
    value: torch.Tensor  # [B, S_cap, h_kv, d]


def _gqa_qkv(args: ModelArgs, w: GQAWeights, rope: RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor,
             projected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, H] at `positions` [B, T] -> rotated q [B, T, h, d], rotated k and v [B, T, h_kv, d]. `projected`: x
    through q, k and v at once (a fused decode GEMV), if already computed."""
    d, eps = args.qk_head_dim, args.rms_norm_eps
    if projected is None:
        q, k, v = linear(x, w.q_proj), linear(x, w.k_proj), linear(x, w.v_proj)
    else:
        q, k, v = projected.split([w.q_proj.weight.shape[0], w.k_proj.weight.shape[0], w.v_proj.weight.shape[0]], -1)
    q = q.unflatten(-1, (args.num_attention_heads, d))
    k = k.unflatten(-1, (args.num_key_value_heads, d))
    v = v.unflatten(-1, (args.num_key_value_heads, d))
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    cos, sin = rope.cos_sin(positions)  # [B, T, r/2]: the first r of each head's d rotate (all but GLM: r = d)
    cos, sin, r = cos[:, :, None], sin[:, :, None], args.qk_rope_head_dim

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return rope.apply(x, cos, sin) if r == d else torch.cat((rope.apply(x[..., :r], cos, sin), x[..., r:]), -1)

    return rotate(q), rotate(k), v


def _visible(args: ModelArgs, key_index: torch.Tensor, query_index: torch.Tensor) -> torch.Tensor:
    """Which keys each query sees: those at or before it, and within the sliding window if the model has one."""
    seen = key_index <= query_index
    if args.sliding_window is not None:
        seen = seen & (key_index > query_index - args.sliding_window)
    return seen


def attention_gqa_block(args: ModelArgs, w: GQAWeights, rope: RotaryEmbedding, x: torch.Tensor,
                        positions: torch.Tensor, kv: GQAKV | None = None, row: int = 0, start: int = 0) -> torch.Tensor:
    """Grouped-query attention over a block of T new tokens (as `attention_expanded`): without `kv` the keys are the
    block itself; with it (B == 1) the block's keys and values are written at [row, start:start+T] and the keys are
    the cache's [0, start+T)."""
    b, t, _ = x.shape
    q, k, v = _gqa_qkv(args, w, rope, x, positions)
    if kv is not None:
        kv.key[row, start : start + t] = k[0]
        kv.value[row, start : start + t] = v[0]
        k, v = kv.key[row : row + 1, : start + t], kv.value[row : row + 1, : start + t]
    s = k.shape[1]
    repeat = args.num_attention_heads // args.num_key_value_heads
    keys, values = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)  # [B, S, h, d]
    if x.is_cuda and args.sliding_window is None:
        mask = causal_lower_right(t, s)
    else:
        mask = _visible(args, torch.arange(s, device=x.device)[None, :],
                        torch.arange(start, start + t, device=x.device)[:, None])
    with sdpa_kernel(_PREFILL_BACKENDS) if x.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, scale=args.softmax_scale)  # [B, h, T, d]
    return linear(out.transpose(1, 2).flatten(2), w.o_proj)


def gqa_decode_queries(args: ModelArgs, w: GQAWeights, rope: RotaryEmbedding, x: torch.Tensor,
                       positions: torch.Tensor, kv: GQAKV, slots: torch.Tensor,
                       projected: torch.Tensor | None = None) -> torch.Tensor:
    """Decode rows x [B, L, H]: their keys and values written into the cache at `slots` [B, L] -> rotated q
    [B, L, h, d]."""
    b, l, _ = x.shape
    q, k, v = _gqa_qkv(args, w, rope, x, positions, projected)
    rows = torch.arange(b, device=x.device)[:, None].expand(b, l)
    kv.key[rows, slots] = k
    kv.value[rows, slots] = v
    return q


def attention_gqa_decode(args: ModelArgs, w: GQAWeights, rope: RotaryEmbedding, x: torch.Tensor,
                         positions: torch.Tensor, kv: GQAKV, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention (as `attention_absorbed`): x [B, L, H] at `positions` [B, L], written at cache index `slots`,
    each token attending to the cache's entries up to its own index, over the whole fixed-size cache (static
    shapes for CUDA graphs; a row's result never depends on the other rows)."""
    slots = positions if slots is None else slots
    b = x.shape[0]
    q = gqa_decode_queries(args, w, rope, x, positions, kv, slots)
    keys, values = kv.key[:b], kv.value[:b]  # [B, S, h_kv, d]
    groups = args.num_key_value_heads
    grouped = q.unflatten(2, (groups, args.num_attention_heads // groups))  # [B, L, h_kv, r, d]
    scores = torch.einsum("blgrd,bsgd->blgrs", grouped, keys) * args.softmax_scale
    visible = _visible(args, torch.arange(keys.shape[1], device=x.device)[None, None, :], slots[:, :, None])
    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
    out = torch.einsum("blgrs,bsgd->blgrd", probs, values).flatten(2)  # [B, L, h*d]
    return linear(out, w.o_proj)


def attention_block(args: ModelArgs, w: AttentionWeights | GQAWeights, rope: RotaryEmbedding, x: torch.Tensor,
                    positions: torch.Tensor, kv=None, row: int = 0, start: int = 0) -> torch.Tensor:
    """A block of new tokens' attention, for the model's attention kind."""
    if isinstance(w, GQAWeights):
        return attention_gqa_block(args, w, rope, x, positions, kv, row, start)
    return attention_expanded(args, w, rope, x, positions, kv, row, start)


def absorbed_weights(args: ModelArgs, w: AttentionWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj split per head: (W_uk [h, n, c], W_uv [h, v, c]) — views, no copy."""
    per_head = w.kv_b_proj.weight.view(args.num_attention_heads, args.qk_nope_head_dim + args.v_head_dim, -1)
    return per_head[:, : args.qk_nope_head_dim], per_head[:, args.qk_nope_head_dim :]


def attention_absorbed(
    args: ModelArgs,
    w: AttentionWeights,
    rope: RotaryEmbedding,
    x: torch.Tensor,
    positions: torch.Tensor,
    kv: LayerKV,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention with the up-projections absorbed (MLA's decode form), over the cache's full capacity.

    x [B, L, H] holds L new tokens per sequence at rotary `positions` [B, L], stored at cache index `slots`
    (default: the positions); their latents are written into `kv` rows 0..B-1 first, then every token attends to the
    cache entries up to its own index. Attending over the whole fixed-size cache (masked) keeps every shape static —
    for CUDA graphs, and so that a row's result never depends on how far other rows or other modes have advanced.
    """
    slots = positions if slots is None else slots
    b, l, _ = x.shape
    n = args.qk_nope_head_dim
    q = _queries(args, w, x)  # [B, L, h, n+r]
    q_nope, q_rope = q.split([n, args.qk_rope_head_dim], dim=-1)
    latent, k_rope = _latent_kv(args, w, x)
    cos, sin = rope.cos_sin(positions)
    q_rope = rope.apply(q_rope, cos[:, :, None], sin[:, :, None])
    k_rope = rope.apply(k_rope, cos, sin)
    rows = torch.arange(b, device=x.device)[:, None].expand(b, l)
    kv.latent[rows, slots] = latent
    kv.rope[rows, slots] = k_rope
    cache_latent = kv.latent[:b]  # [B, S, c]
    cache_rope = kv.rope[:b]  # [B, S, r]
    w_uk, w_uv = absorbed_weights(args, w)
    q_latent = torch.einsum("blhn,hnc->blhc", q_nope, w_uk)
    scores = torch.einsum("blhc,bsc->blhs", q_latent, cache_latent) + torch.einsum(
        "blhr,bsr->blhs", q_rope, cache_rope
    )
    scores = scores * args.softmax_scale
    key_pos = torch.arange(cache_latent.shape[1], device=x.device)
    visible = key_pos[None, None, :] <= slots[:, :, None]  # [B, L, S]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
    out_latent = torch.einsum("blhs,bsc->blhc", probs, cache_latent)
    out = torch.einsum("blhc,hvc->blhv", out_latent, w_uv).flatten(2)  # [B, L, h*v]
    return linear(out, w.o_proj)


# ---- routing ------------------------------------------------------------------------------------------------------


@dataclass
class Routing:
    ids: torch.Tensor  # [N, k] int64, selected experts (unordered within a row)
    weights: torch.Tensor  # [N, k] fp32 combination weights
    scores: torch.Tensor  # [N, E] fp32 selection scores (biased for V3), for ranking predictions


def router_shape(args: ModelArgs) -> RouterShape:
    return RouterShape(n_experts=args.n_routed_experts, top_k=args.num_experts_per_tok, n_group=args.n_group,
                       topk_group=args.topk_group, method=args.topk_method, sigmoid=args.scoring_func == "sigmoid",
                       norm_topk_prob=args.norm_topk_prob, scaling=args.routed_scaling_factor)


def route(args: ModelArgs, router: RouterWeights, x: torch.Tensor) -> Routing:
    """x [N, H] -> top-k experts and weights, exactly as DeepSeek-V3 (sigmoid, bias for selection only,
    group-limited) or V2 (softmax, greedy or group-limited greedy)."""
    logits = F.linear(x.float(), router.weight)  # [N, E], fp32 like the reference implementations
    ids, weights, choice = select_experts_reference(router_shape(args), logits, router.bias)
    return Routing(ids=ids, weights=weights, scores=choice)


def combine_expert_outputs(outputs: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """outputs [N, k, H], weights [N, k] fp32 -> [N, H] fp32, summed in fixed k order (`combine_in_k_order`, the
    one rule of every path)."""
    return combine_in_k_order(outputs.float(), weights, valid)


# ---- the decoder layer --------------------------------------------------------------------------------------------

RoutedFn = Callable[[int, list[torch.Tensor], list[Routing]], list[torch.Tensor]]


class LayerOps:
    """How the pieces of a decoder layer are computed. These are the definitions (torch, any device);
    `layer_ops.FusedOps` computes the same with fused Triton kernels for the device's decode step."""

    def __init__(self, args: ModelArgs, act: Callable[[torch.Tensor], torch.Tensor], rope: RotaryEmbedding):
        self.args = args
        self.act = act
        self.rope = rope

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.args.rms_norm_eps)

    def residual_norm(self, x: torch.Tensor, deltas: list[torch.Tensor], weight: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x + the deltas' sum rounded to x's dtype, its RMSNorm by `weight`, or None without one)."""
        return residual_norm_reference(x, deltas, weight, self.args.rms_norm_eps)

    def route(self, router: RouterWeights, h: torch.Tensor) -> Routing:
        return route(self.args, router, h)

    def mlp(self, w: MLPWeights, h: torch.Tensor) -> torch.Tensor:
        return mlp(w, h, self.act)

    def attend_decode(self, w: AttentionWeights | GQAWeights, x: torch.Tensor, positions: torch.Tensor, kv,
                      slots: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of x [B, L, H] at rotary `positions` [B, L], stored at cache index `slots`."""
        if isinstance(w, GQAWeights):
            return attention_gqa_decode(self.args, w, self.rope, x, positions, kv, slots)
        return attention_absorbed(self.args, w, self.rope, x, positions, kv, slots)


def block(
    ops: LayerOps,
    lw: LayerWeights,
    groups: list[torch.Tensor],
    attend: Callable[[int, torch.Tensor], torch.Tensor],
    routed: RoutedFn,
) -> list[torch.Tensor]:
    """One decoder layer over groups of rows: prefill chunks (one group), decode steps (real rows, then shadow or
    draft rows) and the MTP head all run this.

    Each group gets its own attention call, `attend(group index, normed x)`, so extra rows never change the shapes of
    the real rows' kernels. The feed-forward half sees every group at once: a dense MLP per group, or routers per
    group and `routed(layer, router inputs, routings)` for the routed experts of all groups together (so that an
    expert's bytes are read once for every row that uses it), plus the shared experts."""
    groups, hs = list(groups), []
    for i, x in enumerate(groups):
        groups[i], h = ops.residual_norm(x, [attend(i, ops.norm(x, lw.input_norm))], lw.post_attention_norm)
        hs.append(h)
    if lw.router is None:
        return [ops.residual_norm(x, [ops.mlp(lw.mlp, h)], None)[0] for x, h in zip(groups, hs)]
    flat = [h.reshape(-1, h.shape[-1]) for h in hs]
    outs = routed(lw.index, flat, [ops.route(lw.router, f) for f in flat])
    deltas = [[out] if lw.shared is None else [out, ops.mlp(lw.shared, f)] for out, f in zip(outs, flat)]
    return [ops.residual_norm(x, [d.view(x.shape) for d in ds], None)[0] for x, ds in zip(groups, deltas)]


def mtp_input(args: ModelArgs, mtp: MTPWeights, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP block's input: eh_proj(enorm(embedding of token i+1) ++ hnorm(main hidden at i)), embedding first
    (what vLLM, SGLang and transformers do with DeepSeek checkpoints)."""
    eps = args.rms_norm_eps
    return linear(torch.cat((rms_norm(embedded, mtp.enorm, eps), rms_norm(hidden, mtp.hnorm, eps)), -1), mtp.eh_proj)
