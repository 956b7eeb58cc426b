"""The MoE router's selection in one kernel: scores, correction bias, group-limited top-k, normalisation, scaling.

The router's logits come from a GEMV outside (fp32, as the reference implementations compute them); this kernel
does, per row, what `select_experts_reference` (the definition, used by the CPU path) does in a dozen torch ops.
Top-k is k rounds of arg-max, so the experts come out in descending score order like `torch.topk`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import HAS_TRITON, Launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .common import next_pow2

METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


@dataclass(frozen=True)
class RouterShape:
    n_experts: int
    top_k: int
    n_group: int
    topk_group: int
    method: str  # greedy | group_limited_greedy | noaux_tc
    sigmoid: bool  # sigmoid scores (V3) or softmax (V2)
    norm_topk_prob: bool
    scaling: float

    @property
    def grouped(self) -> bool:
        return self.method != "greedy" and self.n_group > 1 and self.topk_group < self.n_group


def select_experts_reference(shape: RouterShape, logits: torch.Tensor, bias: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 -> (ids [N, k] int64, weights [N, k] fp32, selection scores [N, E] fp32), exactly as
    DeepSeek-V3 (sigmoid, bias for selection only, group-limited) or V2 (softmax, greedy or group-limited)."""
    scores = router_scores(shape, logits)
    choice = scores + bias if bias is not None else scores
    if shape.grouped:
        grouped = choice.view(-1, shape.n_group, shape.n_experts // shape.n_group)
        if shape.method == "noaux_tc":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:  # group_limited_greedy ranks groups by their best expert
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(shape.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        # -inf, never 0.0: biased V3 scores can be negative and a 0.0 mask would let masked groups win
        choice = choice.masked_fill(~group_mask.repeat_interleave(shape.n_experts // shape.n_group, 1),
                                    float("-inf"))
    ids = choice.topk(shape.top_k, dim=-1).indices
    return ids, combine_weights_reference(shape, scores, ids), choice


def combine_weights_reference(shape: RouterShape, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The combination weights of the experts `ids` [N, k] from the router's unbiased scores [N, E] (the bias only
    selects): gathered, renormalised when the family does, scaled."""
    weights = scores.gather(1, ids)
    if shape.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * shape.scaling


def router_scores(shape: RouterShape, logits: torch.Tensor) -> torch.Tensor:
    """The router's unbiased scores from its fp32 logits [N, E]."""
    return logits.sigmoid() if shape.sigmoid else logits.softmax(dim=-1)


if HAS_TRITON:

    @triton.jit
    def _select_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, choice_ptr, scaling, E: tl.constexpr,
                       G: tl.constexpr, GS: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr, K: tl.constexpr,
                       TOPK_GROUP: tl.constexpr, METHOD: tl.constexpr, GROUPED: tl.constexpr,
                       SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr):
        r = tl.program_id(0)
        g = tl.arange(0, GP)[:, None]
        s = tl.arange(0, SP)[None, :]
        on = (g < G) & (s < GS)
        expert = g * GS + s  # [GP, SP]: experts laid out by group
        logits = tl.load(logits_ptr + r * E + expert, mask=on, other=float("-inf"))
        if SIGMOID:
            scores = tl.where(on, tl.sigmoid(logits), 0.0)
        else:
            top = tl.max(tl.max(logits, axis=1), axis=0)
            e = tl.where(on, tl.exp(logits - top), 0.0)
            scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + expert, mask=on, other=0.0)
        choice = tl.where(on, choice, float("-inf"))
        if GROUPED:
            best = tl.max(choice, axis=1)  # [GP]
            if METHOD == 2:  # noaux_tc: a group's score is the sum of its two best
                first = tl.argmin(tl.where(choice == best[:, None], s, SP), axis=1)
                second = tl.max(tl.where(s == first[:, None], float("-inf"), choice), axis=1)
                if GS > 1:
                    group_score = best + second
                else:
                    group_score = best
            else:
                group_score = best
            gs = tl.arange(0, GP)
            group_score = tl.where(gs < G, group_score, float("-inf"))
            keep = gs < 0
            for _ in tl.static_range(TOPK_GROUP):
                pick = tl.argmax(group_score, axis=0)
                keep = keep | (gs == pick)
                group_score = tl.where(gs == pick, float("-inf"), group_score)
            choice = tl.where(keep[:, None], choice, float("-inf"))
        tl.store(choice_ptr + r * E + expert, choice, mask=on)
        flat_choice = tl.reshape(choice, [GP * SP])
        flat_scores = tl.reshape(scores, [GP * SP])
        flat_expert = tl.reshape(expert, [GP * SP])
        ks = tl.arange(0, KP)
        picked_ids = tl.zeros([KP], dtype=tl.int64)
        picked_w = tl.zeros([KP], dtype=tl.float32)
        for j in tl.static_range(K):
            at = tl.argmax(flat_choice, axis=0)
            idx = tl.arange(0, GP * SP)
            e_id = tl.sum(tl.where(idx == at, flat_expert, 0), axis=0)
            w = tl.sum(tl.where(idx == at, flat_scores, 0.0), axis=0)
            picked_ids = tl.where(ks == j, e_id.to(tl.int64), picked_ids)
            picked_w = tl.where(ks == j, w, picked_w)
            flat_choice = tl.where(idx == at, float("-inf"), flat_choice)
        if NORM:
            picked_w = picked_w / (tl.sum(picked_w, axis=0) + 1e-20)
        tl.store(ids_ptr + r * K + ks, picked_ids, mask=ks < K)
        tl.store(weights_ptr + r * K + ks, picked_w * scaling, mask=ks < K)


def select_experts(shape: RouterShape, logits: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`select_experts_reference` in one kernel launch."""
    k = shape.top_k
    if not use_kernel:
        return select_experts_reference(shape, logits, bias)
    n = logits.shape[0]
    logits = logits.contiguous()
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    choice = torch.empty_like(logits)
    select_launch(shape, logits, bias, ids, weights, choice)()
    return ids, weights, choice


def select_launch(shape: RouterShape, logits: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                  weights: torch.Tensor, choice: torch.Tensor) -> Launch:
    k = shape.top_k
    groups = shape.n_group if shape.grouped else 1
    size = shape.n_experts // groups
    return Launch(_select_kernel, (logits.shape[0],), num_warps=4, num_stages=1, logits_ptr=logits,
           bias_ptr=bias if bias is not None else logits, ids_ptr=ids, weights_ptr=weights, choice_ptr=choice,
           scaling=float(shape.scaling), E=shape.n_experts, G=groups, GS=size, GP=next_pow2(groups),
           SP=next_pow2(size), K=k, TOPK_GROUP=shape.topk_group, METHOD=METHODS[shape.method],
           GROUPED=shape.grouped, SIGMOID=shape.sigmoid, HAS_BIAS=bias is not None, NORM=shape.norm_topk_prob,
           KP=next_pow2(k))
