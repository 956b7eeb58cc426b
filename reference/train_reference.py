#!/usr/bin/env python
"""Train a small DeepSeek-V3-architecture reference model (+ one MTP layer) and save it in HF format.

The model follows transformers' ``modeling_deepseek_v3.py`` semantics exactly (MLA with interleaved RoPE,
sigmoid router with ``e_score_correction_bias`` and group-limited top-k, shared expert, fp32 RMSNorm) so that
``transformers.DeepseekV3ForCausalLM.from_pretrained(out_dir)`` loads the result and reproduces our logits,
and transformers' ``MtpModel`` reproduces our MTP logits.

Training-time design decisions (documented here once, referenced in comments below):

* **Dense-masked MoE.** In training every token runs through *all* routed experts as two big GEMMs over
  the stacked expert weights, and the outputs are combined with a dense ``[tokens, E]`` weight matrix that is
  zero outside the top-k. Non-selected experts contribute ``0 * f(x) = 0`` (and get zero gradient), so this is
  mathematically the sparse MoE; for experts this tiny (H=256, I=48) two well-shaped GEMMs beat any
  gather/scatter dispatch by a wide margin on a GPU. ``moe_impl="sparse"`` keeps a per-expert reference path
  (used by tests and by CPU evaluation).
* **Auxiliary-loss-free balancing** (DeepSeek-V3 §2.1.2): after every optimizer step each MoE layer's
  ``e_score_correction_bias += gamma * sign(mean_load - load_e)``. The bias is a buffer, never trained.
  We also keep DeepSeek-V3's tiny sequence-wise balance loss (``--seq-aux-alpha``, default 1e-4; set 0 to drop).
* **MTP** (one layer): ``h' = eh_proj([enorm(emb(t[i+1])), hnorm(H_i)])`` with ``H_i`` the main model's
  final hidden state *after* ``model.norm`` (embedding first), one MoE decoder block at positions ``i+1``,
  ``shared_head.norm``, then the shared main ``lm_head``; it predicts ``t[i+2]``. The MTP loss back-propagates
  into the trunk, as in DeepSeek-V3.
* **routed_scaling_factor = 2.5** (DeepSeek-V3's value), so the checkpoint exercises the same code path as the
  real model; a constant factor is absorbed by training either way.
* **Saved dtypes:** everything bf16 except ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias``, which
  are kept fp32: the router runs in fp32 in training, transformers >= 5.24 keeps ``gate.weight`` in fp32, and a
  bf16-rounded router can flip near-tie expert choices relative to what was trained (32 KB per layer).
* **LR schedule** is linear warmup then cosine; with ``--time-budget-s`` the cosine progress is
  ``max(step / total_steps, elapsed / budget)`` so the decay always completes whichever limit is hit first.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

LOG = logging.getLogger("train_reference")

BOS_ID = 0
EOS_ID = 1
MB = 1_000_000  # sizes are checked in decimal megabytes (stricter than MiB)


# ----------------------------------------------------------------------------------------------------------------
# Model configuration
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """DeepSeek-V3 hyper-parameters, named as in the HF ``config.json``."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 5
    num_attention_heads: int = 4
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    kv_lora_rank: int = 64
    intermediate_size: int = 512
    moe_intermediate_size: int = 48
    n_routed_experts: int = 32
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 1
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    initializer_range: float = 0.02
    num_nextn_predict_layers: int = 1
    seq_aux_alpha: float = 1e-4  # recorded in config.json as aux_loss_alpha

    def __post_init__(self) -> None:
        if self.n_routed_experts % self.n_group:
            raise ValueError("n_routed_experts must be divisible by n_group")
        if self.n_routed_experts // self.n_group < 2:
            raise ValueError("DeepSeek group scoring sums the top-2 experts of a group: need >= 2 per group")
        if self.topk_group > self.n_group:
            raise ValueError("topk_group must be <= n_group")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError("num_experts_per_tok exceeds the experts available in topk_group groups")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even (interleaved pairs)")
        if self.num_nextn_predict_layers != 1:
            raise ValueError("exactly one MTP layer is supported")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` contents (DeepSeek-V3 field names plus transformers 5.x rope parameters)."""
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "n_shared_experts": self.n_shared_experts,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": self.routed_scaling_factor,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
            "ep_size": 1,
            "seq_aux": self.seq_aux_alpha > 0,
            "aux_loss_alpha": self.seq_aux_alpha,
            "q_lora_rank": None,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_interleave": True,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": None,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Inverse of :meth:`to_hf_config`; rejects configurations this implementation does not model."""
        if hf.get("q_lora_rank") is not None:
            raise ValueError("q_lora_rank is not supported by the reference model")
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise ValueError("only default RoPE is supported by the reference model")
        if not hf.get("rope_interleave", True):
            raise ValueError("only rope_interleave=True is supported")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        kwargs["seq_aux_alpha"] = float(hf.get("aux_loss_alpha", 0.0))
        return cls(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics, bit-compatible with ``DeepseekV3RMSNorm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(cfg: ModelConfig, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [n_positions, rope_dim/2] (one angle per interleaved pair), computed like HF in fp32."""
    dim = cfg.qk_rope_head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(n_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb_interleave``: rotate pairs (x0,x1),(x2,x3)... and emit [evens | odds].

    The output layout (de-interleaved halves) does not change q·k, but we mirror HF exactly anyway.
    """
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention without q-LoRA (``q_lora_rank=None``), as DeepseekV3Attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, n = cfg.hidden_size, cfg.num_attention_heads
        self.q_proj = nn.Linear(h, n * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bsz, seq, _ = x.shape
        n, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

        q = self.q_proj(x).view(bsz, seq, n, cfg.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([dn, dr], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, dr], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(bsz, seq, n, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], dim=-1)

        q_rot = apply_rope_interleave(q_rot, cos, sin)
        k_rot = apply_rope_interleave(k_rot.view(bsz, 1, seq, dr), cos, sin)
        q = torch.cat([q_nope, q_rot.to(q_nope.dtype)], dim=-1)
        k = torch.cat([k_nope, k_rot.to(k_nope.dtype).expand(bsz, n, seq, dr)], dim=-1)
        # Zero-pad V to the QK head dim: flash SDPA needs equal head dims, and the padded output columns
        # are exactly zero, so slicing them off is lossless.
        if dv < cfg.qk_head_dim:
            v = F.pad(v, (0, cfg.qk_head_dim - dv))
        out = F.scaled_dot_product_attention(q, k, v.to(q.dtype), is_causal=True, scale=cfg.qk_head_dim**-0.5)
        out = out[..., :dv].transpose(1, 2).reshape(bsz, seq, n * dv)
        return self.o_proj(out)


class DenseMLP(nn.Module):
    """SiLU-GLU MLP (dense layers and the shared expert)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid router with selection-only correction bias (DeepseekV3TopkRouter semantics)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        # A buffer, not a parameter: it is moved by the load-balancing rule, never by the optimizer.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (scores [T, E] fp32, topk_idx [T, K], topk_weight [T, K] fp32)."""
        # Routing is computed in fp32 even under bf16 autocast, as in HF and DeepSeek's noaux_tc.
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
            idx = select_experts(scores, self.e_score_correction_bias.float(), self.cfg)
            weight = scores.gather(1, idx)  # weights from the UNBIASED scores
            if self.cfg.norm_topk_prob:
                weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
            weight = weight * self.cfg.routed_scaling_factor
        return scores, idx, weight


def select_experts(scores: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Group-limited top-k on the biased scores (selection only); returns expert indices [T, K]."""
    biased = scores + bias
    tokens = biased.shape[0]
    grouped = biased.view(tokens, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
    # -inf (not 0): biased scores can be negative, so a 0 mask could pick experts from dropped groups.
    masked = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(tokens, -1)
    return masked.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices


class MoE(nn.Module):
    """Routed experts (stacked weights) + one shared expert; returns output, per-expert load and aux loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg)
        # Same fused layout as transformers 5.x: gate rows first, then up rows.
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts_down = nn.Parameter(torch.empty(e, h, i))
        self.shared_experts = DenseMLP(h, i * cfg.n_shared_experts)
        self.impl = "dense"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bsz, seq, hidden = x.shape
        flat = x.reshape(-1, hidden)
        scores, idx, weight = self.gate(flat)
        if self.impl == "dense":
            routed = self._dense_experts(flat, idx, weight)
        else:
            routed = self._sparse_experts(flat, idx, weight)
        out = routed.view(bsz, seq, hidden).to(x.dtype) + self.shared_experts(x)
        selected = torch.zeros_like(scores).scatter_(1, idx, 1.0)
        load = selected.sum(dim=0).detach()
        aux = self._seq_balance_loss(scores, selected, bsz, seq) if self.cfg.seq_aux_alpha > 0 else scores.new_zeros(())
        return out, load, aux

    def combine_weights(self, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Dense [T, E] routing weights, zero outside the top-k (differentiable w.r.t. ``weight``)."""
        dense = weight.new_zeros(weight.shape[0], self.cfg.n_routed_experts)
        return dense.scatter(1, idx, weight)

    def _dense_experts(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """All experts for all tokens as two GEMMs; exact because unselected experts get weight 0."""
        e, i, h = self.cfg.n_routed_experts, self.cfg.moe_intermediate_size, self.cfg.hidden_size
        gate_up = F.linear(x, self.experts_gate_up.reshape(e * 2 * i, h)).view(-1, e, 2, i)
        act = F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]  # [T, E, I]
        # Scale before the (linear) down projection: sum_e w_e down_e(a_e) == down_cat(concat_e w_e a_e).
        act = act * self.combine_weights(idx, weight).to(act.dtype).unsqueeze(-1)
        down = self.experts_down.permute(1, 0, 2).reshape(h, e * i)  # [H, E*I]
        return F.linear(act.reshape(-1, e * i), down)

    def _sparse_experts(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Per-expert gather/compute/scatter reference (HF eager semantics); cheaper on CPU."""
        i = self.cfg.moe_intermediate_size
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for expert in range(self.cfg.n_routed_experts):
            token, slot = torch.where(idx == expert)
            if token.numel() == 0:
                continue
            w_gate_up = self.experts_gate_up[expert]
            gate_up = F.linear(x[token], w_gate_up)
            act = F.silu(gate_up[:, :i]) * gate_up[:, i:]
            y = F.linear(act, self.experts_down[expert]) * weight[token, slot, None]
            out.index_add_(0, token, y.float())
        return out

    def _seq_balance_loss(
        self, scores: torch.Tensor, selected: torch.Tensor, bsz: int, seq: int
    ) -> torch.Tensor:
        """DeepSeek-V3 sequence-wise balance loss alpha * sum_i f_i P_i (eqs. 17-20), averaged over sequences."""
        e, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        frac = selected.view(bsz, seq, e).sum(dim=1) * (e / (k * seq))
        probs = (scores / scores.sum(dim=-1, keepdim=True)).view(bsz, seq, e).mean(dim=1)
        return self.cfg.seq_aux_alpha * (frac * probs).sum(dim=-1).mean()


class DecoderLayer(nn.Module):
    """Pre-norm block: MLA + (dense MLP | MoE)."""

    def __init__(self, cfg: ModelConfig, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = MoE(cfg) if moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoE)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        hidden = self.post_attention_layernorm(x)
        if self.is_moe:
            mlp_out, load, aux = self.mlp(hidden)
            return x + mlp_out, load, aux
        return x + self.mlp(hidden), None, None


class MTPLayer(nn.Module):
    """DeepSeek-V3 multi-token-prediction module (depth 1); embedding and head are shared with the trunk."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderLayer(cfg, moe=True)
        self.shared_head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, next_embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Embedding first in the concat, as DeepSeek checkpoints / vLLM / SGLang / transformers expect.
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x, load, aux = self.block(x, cos, sin)
        return self.shared_head_norm(x), load, aux


# ----------------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------------


class ReferenceModel(nn.Module):
    """DeepSeek-V3 trunk + one MTP layer; ``forward(window)`` returns the training losses."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, moe=cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPLayer(cfg)
        # +2: the MTP block runs at positions shifted by one.
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings + 2)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    # -- initialisation ------------------------------------------------------------------------------------------

    def reset_parameters(self) -> None:
        """N(0, 0.02) everywhere (DeepSeek/HF), residual-output projections scaled by 1/sqrt(2*blocks) (GPT-2),
        norms at 1, correction bias at 0."""
        std = self.cfg.initializer_range
        residual_std = std / math.sqrt(2 * (self.cfg.num_hidden_layers + 1))
        for name, param in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                nn.init.ones_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts_down")):
                nn.init.normal_(param, 0.0, residual_std)
            else:
                nn.init.normal_(param, 0.0, std)
        for router in self.routers():
            router.e_score_correction_bias.zero_()

    # -- structure helpers ---------------------------------------------------------------------------------------

    def moe_modules(self) -> list[MoE]:
        """MoE modules in order: main MoE layers, then the MTP layer's."""
        mods = [layer.mlp for layer in self.layers if layer.is_moe]
        return [*mods, self.mtp.block.mlp]

    def routers(self) -> list[Router]:
        return [moe.gate for moe in self.moe_modules()]

    def moe_layer_names(self) -> list[str]:
        names = [f"layer {i}" for i, layer in enumerate(self.layers) if layer.is_moe]
        return [*names, f"mtp (layer {self.cfg.num_hidden_layers})"]

    def set_moe_impl(self, impl: str) -> None:
        if impl not in ("dense", "sparse"):
            raise ValueError(f"unknown MoE implementation {impl!r}")
        for moe in self.moe_modules():
            moe.impl = impl

    def _rope(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start + length > self.rope_cos.shape[0]:
            raise ValueError("sequence exceeds max_position_embeddings")
        return self.rope_cos[start : start + length], self.rope_sin[start : start + length]

    # -- forward pieces ------------------------------------------------------------------------------------------

    def main_hidden(
        self, input_ids: torch.Tensor, start_pos: int = 0
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Trunk forward -> (final hidden state AFTER model.norm [B,S,H], per-MoE-layer loads, aux loss)."""
        cos, sin = self._rope(start_pos, input_ids.shape[1])
        x = self.embed_tokens(input_ids)
        loads: list[torch.Tensor] = []
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, load, layer_aux = layer(x, cos, sin)
            if load is not None:
                loads.append(load)
                aux = aux + layer_aux
        return self.norm(x), loads, aux

    def mtp_hidden(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, start_pos: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MTP forward: pair (H_i, token i+1) at position i+1 -> shared_head.norm output predicting token i+2."""
        cos, sin = self._rope(start_pos, next_ids.shape[1])
        return self.mtp(self.embed_tokens(next_ids), hidden, cos, sin)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(
        self, window: torch.Tensor, mtp_weight: float = 0.3
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """window [B, S+2] -> (total loss, main CE, MTP CE, balance loss, loads [n_moe, E])."""
        seq = window.shape[1] - 2
        hidden, loads, aux = self.main_hidden(window[:, :seq])
        main_loss = cross_entropy(self.logits(hidden), window[:, 1 : seq + 1])
        mtp_h, mtp_load, mtp_aux = self.mtp_hidden(hidden, window[:, 1 : seq + 1])
        mtp_loss = cross_entropy(self.logits(mtp_h), window[:, 2 : seq + 2])
        aux = aux + mtp_aux
        total = main_loss + mtp_weight * mtp_loss + aux
        return total, main_loss.detach(), mtp_loss.detach(), aux.detach(), torch.stack([*loads, mtp_load])

    @torch.no_grad()
    def update_routing_bias(self, loads: torch.Tensor, gamma: float) -> None:
        """Auxiliary-loss-free balancing: bias_e += gamma * sign(mean_load - load_e), per MoE layer."""
        for router, load in zip(self.routers(), loads):
            router.e_score_correction_bias.add_(torch.sign(load.mean() - load), alpha=gamma)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean CE computed in fp32 (logits may be bf16 under autocast)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_parameters(model: ReferenceModel) -> dict[str, int]:
    """Total / MTP-only / activated-per-token parameter counts (embedding and head counted once)."""
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    cfg = model.cfg
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    inactive_per_moe = (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert
    n_moe_main = sum(1 for layer in model.layers if layer.is_moe)
    return {
        "total": total,
        "main_model": total - mtp,
        "mtp_layer": mtp,
        "activated_main_per_token": total - mtp - n_moe_main * inactive_per_moe,
    }


# ----------------------------------------------------------------------------------------------------------------
# HF checkpoint conversion, saving and loading
# ----------------------------------------------------------------------------------------------------------------


FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
# Room left for the safetensors JSON header so that the shard *file* stays under the size limit.
SHARD_HEADER_RESERVE = 64 * 1024


def hf_name(cfg: ModelConfig, name: str) -> str:
    """Map one of our (non-expert) state-dict names to the DeepSeek/HF checkpoint name."""
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    if name.startswith("mtp.block."):
        return mtp_prefix + name[len("mtp.block.") :]
    if name.startswith("mtp.shared_head_norm."):
        return mtp_prefix + "shared_head.norm." + name[len("mtp.shared_head_norm.") :]
    if name.startswith("mtp."):
        return mtp_prefix + name[len("mtp.") :]
    if name.startswith("lm_head."):
        return name
    return "model." + name


def to_hf_state_dict(model: ReferenceModel) -> dict[str, torch.Tensor]:
    """Checkpoint tensors in DeepSeek naming (per-expert), bf16 except the fp32 router tensors, in module order."""
    cfg = model.cfg
    i = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if name.endswith(("experts_gate_up", "experts_down")):
            base = hf_name(cfg, name.rsplit(".", 1)[0]) + ".experts"
            for e in range(cfg.n_routed_experts):
                if name.endswith("experts_gate_up"):
                    out[f"{base}.{e}.gate_proj.weight"] = tensor[e, :i].to(torch.bfloat16).contiguous()
                    out[f"{base}.{e}.up_proj.weight"] = tensor[e, i:].to(torch.bfloat16).contiguous()
                else:
                    out[f"{base}.{e}.down_proj.weight"] = tensor[e].to(torch.bfloat16).contiguous()
            continue
        key = hf_name(cfg, name)
        dtype = torch.float32 if key.endswith(FP32_SUFFIXES) else torch.bfloat16
        out[key] = tensor.to(dtype).contiguous()
    return out


def load_hf_state_dict(model: ReferenceModel, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`to_hf_state_dict`; strict (every tensor must be present and used)."""
    cfg = model.cfg
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in tensors:
            raise KeyError(f"checkpoint is missing {key}")
        used.add(key)
        return tensors[key].float()

    new_state: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        if name.endswith(("experts_gate_up", "experts_down")):
            base = hf_name(cfg, name.rsplit(".", 1)[0]) + ".experts"
            experts = range(cfg.n_routed_experts)
            if name.endswith("experts_gate_up"):
                stacked = [
                    torch.cat([take(f"{base}.{e}.gate_proj.weight"), take(f"{base}.{e}.up_proj.weight")])
                    for e in experts
                ]
            else:
                stacked = [take(f"{base}.{e}.down_proj.weight") for e in experts]
            new_state[name] = torch.stack(stacked)
        else:
            new_state[name] = take(hf_name(cfg, name))
    unused = sorted(set(tensors) - used)
    if unused:
        raise KeyError(f"checkpoint has tensors the reference model does not use: {unused[:8]}")
    model.load_state_dict(new_state, strict=True)


def tensor_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy in-order sharding so that every shard stays <= max_shard_bytes of tensor data."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_shard_bytes:
            raise ValueError(f"{key} ({nbytes} B) alone exceeds the shard limit")
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def save_sharded(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> list[Path]:
    """Write model-0000i-of-0000N.safetensors + model.safetensors.index.json (HF layout)."""
    from safetensors.torch import save_file

    shards = plan_shards(tensors, max_shard_bytes - SHARD_HEADER_RESERVE)
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for n, keys in enumerate(shards, start=1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(out_dir / fname), metadata={"format": "pt"})
        (out_dir / fname).chmod(0o644)  # safetensors creates 0600 files; the engine may run as another user
        weight_map.update({k: fname for k in keys})
        paths.append(out_dir / fname)
    index = {"metadata": {"total_size": tensor_nbytes(tensors)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def read_checkpoint_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a sharded (index.json) or single-file safetensors checkpoint."""
    from safetensors.torch import load_file

    index_path = ckpt_dir / "model.safetensors.index.json"
    if index_path.exists():
        files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        tensors.update(load_file(str(ckpt_dir / fname)))
    return tensors


def load_checkpoint(ckpt_dir: str | Path, device: str | torch.device = "cpu") -> ReferenceModel:
    """Build a :class:`ReferenceModel` (fp32 parameters) from a saved HF-format checkpoint directory."""
    ckpt_dir = Path(ckpt_dir)
    cfg = ModelConfig.from_hf_config(json.loads((ckpt_dir / "config.json").read_text()))
    model = ReferenceModel(cfg)
    load_hf_state_dict(model, read_checkpoint_tensors(ckpt_dir))
    return model.to(device).eval()


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


def tokenizer_vocab_size(corpus_dir: Path) -> int:
    """Vocabulary size of the corpus tokenizer (incl. added tokens)."""
    path = corpus_dir / "tokenizer.json"
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except ImportError:  # tokenizers ships with transformers, but fall back to reading the JSON
        spec = json.loads(path.read_text())
        ids = list(spec["model"]["vocab"].values()) + [t["id"] for t in spec.get("added_tokens", [])]
        return max(ids) + 1


def load_token_ids(path: Path, device: torch.device) -> torch.Tensor:
    """uint16 ids -> int32 tensor on ``device`` (the whole corpus fits easily in GPU memory)."""
    ids = np.load(path, mmap_mode="r")
    return torch.from_numpy(np.asarray(ids, dtype=np.int32)).to(device)


def sample_windows(
    data: torch.Tensor, batch: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """Random contiguous windows [batch, length] (int64), sampled on the data's device without host sync."""
    starts = torch.randint(
        0, data.numel() - length + 1, (batch,), generator=generator, device=data.device
    )
    offsets = torch.arange(length, device=data.device)
    return data[starts[:, None] + offsets[None, :]].long()


def fixed_windows(data: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """Deterministic evenly spaced windows (held-out monitoring)."""
    last = data.numel() - length
    starts = torch.linspace(0, last, count, device=data.device).long()
    return data[starts[:, None] + torch.arange(length, device=data.device)[None, :]].long()


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Running counters of the training loop (local to one run)."""

    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    stopped_by: str = "steps"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but CUDA is not available")
    return torch.device(name)


def resolve_autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; plain fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"bf16": torch.bfloat16, "fp32": None}[name]


def build_optimizer(model: nn.Module, args: argparse.Namespace, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms); fused kernel on CUDA."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda"
    )


def lr_at(step: int, elapsed: float, total_steps: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine to lr*min_lr_ratio; time-aware when a time budget is set."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
    if args.time_budget_s:
        progress = max(progress, elapsed / args.time_budget_s)
    progress = min(progress, 1.0)
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1.0 + math.cos(math.pi * progress))


def autocast_ctx(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    return torch.autocast(device_type=device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


@torch.no_grad()
def heldout_loss(
    model: ReferenceModel, windows: torch.Tensor, batch: int, amp: torch.dtype | None
) -> dict[str, float]:
    """Mean main/MTP CE over fixed held-out windows (eager model, no grad)."""
    main_sum = mtp_sum = 0.0
    chunks = windows.split(batch)
    for chunk in chunks:
        with autocast_ctx(chunk.device, amp):
            _, main, mtp, _, _ = model(chunk)
        main_sum += float(main)
        mtp_sum += float(mtp)
    return {"heldout_loss": main_sum / len(chunks), "heldout_mtp_loss": mtp_sum / len(chunks)}


def maybe_compile(model: ReferenceModel, enabled: bool) -> nn.Module:
    if not enabled:
        return model
    LOG.info("compiling the training step with torch.compile (first step includes compile time)")
    return torch.compile(model)


def train_step(
    step_model: nn.Module,
    model: ReferenceModel,
    optimizer: torch.optim.Optimizer,
    window: torch.Tensor,
    args: argparse.Namespace,
    amp: torch.dtype | None,
) -> tuple[torch.Tensor, ...]:
    """One optimizer step + bias update; returns detached (main, mtp, aux, loads) without syncing."""
    with autocast_ctx(window.device, amp):
        total, main, mtp, aux, loads = step_model(window, args.mtp_weight)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.update_routing_bias(loads, args.bias_update_gamma)
    return main, mtp, aux, loads


def first_step_with_fallback(
    step_model: nn.Module,
    model: ReferenceModel,
    optimizer: torch.optim.Optimizer,
    window: torch.Tensor,
    args: argparse.Namespace,
    amp: torch.dtype | None,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Run the first step; if torch.compile fails there, fall back to eager instead of losing the run."""
    if step_model is model:
        return model, train_step(model, model, optimizer, window, args, amp)
    try:
        return step_model, train_step(step_model, model, optimizer, window, args, amp)
    except Exception:  # noqa: BLE001 - any compiler failure should degrade to eager, not abort training
        LOG.exception("torch.compile failed on the first step; continuing in eager mode")
        optimizer.zero_grad(set_to_none=True)
        return model, train_step(model, model, optimizer, window, args, amp)


def routing_stats(model: ReferenceModel, loads: torch.Tensor) -> list[dict[str, Any]]:
    """Per MoE layer: correction-bias summary and load imbalance of the given load counts."""
    stats = []
    for name, router, load in zip(model.moe_layer_names(), model.routers(), loads.float().cpu()):
        bias = router.e_score_correction_bias.float().cpu()
        mean = float(load.mean()) or 1.0
        stats.append(
            {
                "layer": name,
                "bias_min": float(bias.min()),
                "bias_max": float(bias.max()),
                "bias_mean": float(bias.mean()),
                "bias_std": float(bias.std()),
                "load_max_over_mean": float(load.max()) / mean,
                "load_min_over_mean": float(load.min()) / mean,
                "load_cv": float(load.std(unbiased=False)) / mean,
            }
        )
    return stats


def run_training(
    model: ReferenceModel,
    train_ids: torch.Tensor,
    heldout_windows: torch.Tensor | None,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """The training loop. Returns the log dict (loss curve, throughput, routing stats)."""
    amp = resolve_autocast_dtype(args.dtype, device)
    optimizer = build_optimizer(model, args, device)
    step_model = maybe_compile(model, args.compile)
    tokens_per_step = args.batch_size * args.seq_len
    total_steps = args.max_steps or max(1, math.ceil(args.train_tokens / tokens_per_step))
    generator = torch.Generator(device=device).manual_seed(args.seed)

    state = TrainState()
    curve: list[dict[str, float]] = []
    sums = torch.zeros(3, device=device)  # main, mtp, aux since last log
    load_sum = torch.zeros(len(model.routers()), model.cfg.n_routed_experts, device=device)
    last_loads = load_sum.clone()
    since_log = 0
    t_start = time.perf_counter()
    t_log, tokens_log = t_start, 0
    first_step_s = 0.0
    model.train()
    bar = tqdm(total=total_steps, desc="train", unit="step", mininterval=2.0, disable=args.no_progress)
    try:
        while state.step < total_steps:
            lr = lr_at(state.step, state.elapsed, total_steps, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            window = sample_windows(train_ids, args.batch_size, args.seq_len + 2, generator)
            if state.step == 0:
                step_model, (main, mtp, aux, loads) = first_step_with_fallback(
                    step_model, model, optimizer, window, args, amp
                )
            else:
                main, mtp, aux, loads = train_step(step_model, model, optimizer, window, args, amp)
            sums += torch.stack([main.float(), mtp.float(), aux.float()])
            load_sum += loads
            since_log += 1
            state.step += 1
            state.tokens += tokens_per_step
            bar.update(1)
            if state.step == 1:
                _sync(device)
                first_step_s = time.perf_counter() - t_start
            state.elapsed = time.perf_counter() - t_start
            is_last = state.step >= total_steps
            over_budget = bool(args.time_budget_s) and state.elapsed >= args.time_budget_s
            if state.step % args.log_every == 0 or is_last or over_budget:
                _sync(device)
                now = time.perf_counter()
                point = _log_point(state, sums / since_log, lr, (state.tokens - tokens_log) / (now - t_log))
                if heldout_windows is not None and (
                    is_last or over_budget or (args.eval_every and state.step % args.eval_every == 0)
                ):
                    point.update(heldout_loss(model, heldout_windows, args.batch_size, amp))
                    model.train()
                curve.append(point)
                bar.set_postfix(
                    loss=f"{point['loss']:.3f}", mtp=f"{point['mtp_loss']:.3f}", tps=f"{point['tokens_per_s']:.0f}"
                )
                LOG.info("step %d %s", state.step, json.dumps({k: round(v, 5) for k, v in point.items()}))
                last_loads = load_sum.clone()
                sums.zero_()
                load_sum.zero_()
                since_log = 0
                t_log, tokens_log = time.perf_counter(), state.tokens
            if over_budget:
                state.stopped_by = "time_budget"
                LOG.info("time budget of %.0f s reached after %d steps", args.time_budget_s, state.step)
                break
    except KeyboardInterrupt:
        state.stopped_by = "interrupted"
        LOG.warning("interrupted at step %d; saving what we have", state.step)
    finally:
        bar.close()
    _sync(device)
    wall = time.perf_counter() - t_start
    steady_tokens = state.tokens - tokens_per_step
    return {
        "steps": state.step,
        "planned_steps": total_steps,
        "stopped_by": state.stopped_by,
        "tokens_seen": state.tokens,
        "tokens_per_step": tokens_per_step,
        "train_wall_time_s": wall,
        "first_step_s": first_step_s,
        "tokens_per_s": state.tokens / wall if wall else 0.0,
        "tokens_per_s_after_first_step": steady_tokens / (wall - first_step_s) if wall > first_step_s else 0.0,
        "loss_curve": curve,
        "final_train_loss": curve[-1]["loss"] if curve else None,
        "final_train_mtp_loss": curve[-1]["mtp_loss"] if curve else None,
        "final_heldout_loss": curve[-1].get("heldout_loss") if curve else None,
        "final_heldout_mtp_loss": curve[-1].get("heldout_mtp_loss") if curve else None,
        "routing": routing_stats(model, last_loads),
        "compiled": step_model is not model,
    }


def _log_point(state: TrainState, means: torch.Tensor, lr: float, tokens_per_s: float) -> dict[str, float]:
    main, mtp, aux = (float(v) for v in means.cpu())
    return {
        "step": state.step,
        "tokens": state.tokens,
        "elapsed_s": state.elapsed,
        "lr": lr,
        "loss": main,
        "mtp_loss": mtp,
        "balance_loss": aux,
        "tokens_per_s": tokens_per_s,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------


def environment_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(device),
        "gpu": None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def save_checkpoint(
    model: ReferenceModel, out_dir: Path, corpus_dir: Path, shard_bytes: int
) -> dict[str, Any]:
    """config.json, sharded safetensors + index, tokenizer files. Returns size facts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_state_dict(model)
    (out_dir / "config.json").write_text(json.dumps(model.cfg.to_hf_config(), indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for stale in out_dir.glob("model-*-of-*.safetensors"):
        stale.unlink()  # a re-run with fewer shards must not leave orphans behind
    paths = save_sharded(tensors, out_dir, shard_bytes)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (corpus_dir / name).exists():
            shutil.copy2(corpus_dir / name, out_dir / name)
    return {
        "checkpoint_bytes": tensor_nbytes(tensors),
        "num_tensors": len(tensors),
        "shards": [{"file": p.name, "bytes": p.stat().st_size} for p in paths],
    }


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


# Shapes beside the shipped reference model's (the ModelConfig defaults). "deep": the deep benchmark model of
# issue 36, DeepSeek-V2-Lite's routing shape (26 MoE layers of 64 experts, top-6, 2 shared experts, 8 groups of which
# 4 are kept) with a tiny hidden size, so that it trains in a few minutes on the H200 and weighs ~31 MB in bf16 (the
# benchmark pads its experts to V2-Lite's 17.3 MB)
PRESETS: dict[str, dict[str, Any]] = {
    "reference": {},
    "deep": dict(hidden_size=128, num_layers=27, intermediate_size=512, moe_intermediate_size=16,
                 n_routed_experts=64, experts_per_tok=6, n_group=8, topk_group=4, n_shared_experts=2,
                 max_size_mb=40.0),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="reference",
                   help="model shape defaults (explicit shape options still override them)")
    io = p.add_argument_group("input/output")
    io.add_argument("--corpus", type=Path, required=True,
                    help="dir with train_ids.npy, heldout_ids.npy, tokenizer.json")
    io.add_argument("--out", type=Path, required=True, help="checkpoint output dir")
    io.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    io.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="autocast dtype (auto: bf16 on cuda, fp32 on cpu)")
    io.add_argument("--seed", type=int, default=0)
    io.add_argument("--no-progress", action="store_true", help="disable the tqdm bar")

    m = p.add_argument_group("model shape")
    d = ModelConfig()
    m.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's vocab size")
    m.add_argument("--hidden-size", type=int, default=d.hidden_size)
    m.add_argument("--num-layers", type=int, default=d.num_hidden_layers, help="main decoder layers (excl. MTP)")
    m.add_argument("--num-heads", type=int, default=d.num_attention_heads)
    m.add_argument("--qk-nope-dim", type=int, default=d.qk_nope_head_dim)
    m.add_argument("--qk-rope-dim", type=int, default=d.qk_rope_head_dim)
    m.add_argument("--v-head-dim", type=int, default=d.v_head_dim)
    m.add_argument("--kv-lora-rank", type=int, default=d.kv_lora_rank)
    m.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    m.add_argument("--moe-intermediate-size", type=int, default=d.moe_intermediate_size)
    m.add_argument("--n-routed-experts", type=int, default=d.n_routed_experts)
    m.add_argument("--experts-per-tok", type=int, default=d.num_experts_per_tok)
    m.add_argument("--n-group", type=int, default=d.n_group)
    m.add_argument("--topk-group", type=int, default=d.topk_group)
    m.add_argument("--n-shared-experts", type=int, default=d.n_shared_experts)
    m.add_argument("--routed-scaling-factor", type=float, default=d.routed_scaling_factor)
    m.add_argument("--first-k-dense", type=int, default=d.first_k_dense_replace)
    m.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    m.add_argument("--rope-theta", type=float, default=d.rope_theta)
    m.add_argument("--max-size-mb", type=float, default=25.0,
                   help="assert the bf16 checkpoint is at most this (1 MB = 1e6 B)")
    m.add_argument("--shard-size-mb", type=float, default=15.0, help="max safetensors shard file size (1 MB = 1e6 B)")

    t = p.add_argument_group("training")
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--batch-size", type=int, default=128, help="sequences per step")
    t.add_argument("--train-tokens", type=float, default=100e6, help="planned tokens (sets the cosine length)")
    t.add_argument("--max-steps", type=int, default=None, help="overrides --train-tokens")
    t.add_argument("--time-budget-s", type=float, default=None,
                   help="stop (and save) after this many seconds of training; the cosine schedule adapts")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--min-lr-ratio", type=float, default=0.1)
    t.add_argument("--warmup-steps", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--mtp-weight", type=float, default=0.3)
    t.add_argument("--bias-update-gamma", type=float, default=1e-3, help="aux-loss-free balancing step")
    t.add_argument("--seq-aux-alpha", type=float, default=1e-4, help="sequence-wise balance loss weight (0 = off)")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile the training step (falls back to eager on failure)")
    t.add_argument("--log-every", type=int, default=20)
    t.add_argument("--eval-every", type=int, default=250, help="held-out loss every N steps (0: only at the end)")
    t.add_argument("--eval-batches", type=int, default=2, help="held-out batches per evaluation")
    return p


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        qk_nope_head_dim=args.qk_nope_dim,
        qk_rope_head_dim=args.qk_rope_dim,
        v_head_dim=args.v_head_dim,
        kv_lora_rank=args.kv_lora_rank,
        intermediate_size=args.intermediate_size,
        moe_intermediate_size=args.moe_intermediate_size,
        n_routed_experts=args.n_routed_experts,
        num_experts_per_tok=args.experts_per_tok,
        n_group=args.n_group,
        topk_group=args.topk_group,
        n_shared_experts=args.n_shared_experts,
        routed_scaling_factor=args.routed_scaling_factor,
        first_k_dense_replace=args.first_k_dense,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        seq_aux_alpha=args.seq_aux_alpha,
    )


def validate_args(args: argparse.Namespace) -> None:
    if args.seq_len + 1 > args.max_position_embeddings:
        raise ValueError("seq_len must leave room for the MTP position shift within max_position_embeddings")
    if args.warmup_steps < 1:
        args.warmup_steps = 1


def checkpoint_size_bytes(model: ReferenceModel) -> int:
    return tensor_nbytes(to_hf_state_dict(model))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, save, and return the training log dict."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    preset = parser.parse_known_args(argv)[0].preset
    parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    validate_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    # Almost everything runs under bf16 autocast; this only affects the few fp32 matmuls (router, eval).
    torch.set_float32_matmul_precision("high")

    train_ids = load_token_ids(args.corpus / "train_ids.npy", device)
    heldout_path = args.corpus / "heldout_ids.npy"
    heldout_ids = load_token_ids(heldout_path, device) if heldout_path.exists() else None
    vocab = args.vocab_size or tokenizer_vocab_size(args.corpus)
    max_id = int(train_ids.max())
    if max_id >= vocab:
        raise ValueError(f"token id {max_id} >= vocab size {vocab}")
    if train_ids.numel() < args.seq_len + 2:
        raise ValueError("training corpus shorter than one window")
    LOG.info("corpus: %d train tokens, %s held-out tokens, vocab %d", train_ids.numel(),
             heldout_ids.numel() if heldout_ids is not None else "no", vocab)

    cfg = model_config_from_args(args, vocab)
    model = ReferenceModel(cfg).to(device)
    params = count_parameters(model)
    size = checkpoint_size_bytes(model)
    LOG.info("parameters: %s; checkpoint (bf16, router fp32): %.2f MB", params, size / MB)
    if size > args.max_size_mb * MB:
        raise ValueError(f"checkpoint would be {size / MB:.2f} MB > --max-size-mb {args.max_size_mb}")

    heldout_windows = None
    if heldout_ids is not None and heldout_ids.numel() >= args.seq_len + 2:
        count = min(args.eval_batches * args.batch_size, heldout_ids.numel() // (args.seq_len + 2))
        heldout_windows = fixed_windows(heldout_ids, max(1, count), args.seq_len + 2)

    t0 = time.perf_counter()
    result = run_training(model, train_ids, heldout_windows, args, device)
    model.eval()
    saved = save_checkpoint(model, args.out, args.corpus, int(args.shard_size_mb * MB))
    log = {
        "command": "python reference/train_reference.py " + shlex.join(argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model_config": asdict(cfg),
        "parameters": params,
        **saved,
        "corpus": {"dir": str(args.corpus), "train_tokens": train_ids.numel(),
                   "heldout_tokens": heldout_ids.numel() if heldout_ids is not None else 0},
        **result,
        "total_wall_time_s": time.perf_counter() - t0,
        "environment": environment_info(device),
    }
    (args.out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(
        f"saved {args.out}: {params['total']:,} params ({saved['checkpoint_bytes'] / MB:.2f} MB), "
        f"{result['tokens_seen']:,} tokens in {result['train_wall_time_s']:.1f} s "
        f"({result['tokens_per_s']:,.0f} tok/s), final loss {result['final_train_loss']}, "
        f"mtp {result['final_train_mtp_loss']}, held-out {result['final_heldout_loss']}"
    )
    return log


if __name__ == "__main__":
    main()
