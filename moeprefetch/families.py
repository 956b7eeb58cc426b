"""One description per supported model family: how its config and tensor names differ, in one place.

Everything family-specific that is not a number in `ModelArgs` lives here: the attention kind (DeepSeek's MLA, or
grouped-query attention), where a MoE layer keeps its router and routed experts, what the experts' projections are
called, and the config fields a checkpoint must state. Other modules ask `family_of(args)` instead of testing
`model_type`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    attention: str  # "mla" (DeepSeek's latent attention) | "gqa" (grouped-query attention with a K/V cache)
    moe_prefix: str  # a MoE layer's block under model.layers.N: router at {prefix}.gate, experts at {prefix}.experts
    expert_projections: tuple[str, str, str]  # the names of (gate, up, down) under {prefix}.experts.{e}
    required_fields: tuple[str, ...]  # config.json fields that must be stated (AutoConfig would fill defaults)


_COMMON = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok")
_MLA = _COMMON + ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                  "moe_intermediate_size")

FAMILIES: dict[str, Family] = {
    "deepseek_v3": Family("deepseek_v3", "mla", "mlp", ("gate_proj", "up_proj", "down_proj"), _MLA),
    "deepseek_v2": Family("deepseek_v2", "mla", "mlp", ("gate_proj", "up_proj", "down_proj"), _MLA),
    "qwen3_moe": Family("qwen3_moe", "gqa", "mlp", ("gate_proj", "up_proj", "down_proj"),
                        _COMMON + ("moe_intermediate_size",)),
    "mixtral": Family("mixtral", "gqa", "block_sparse_moe", ("w1", "w3", "w2"), _COMMON + ("intermediate_size",)),
    # GLM-4.5/4.6: grouped-query attention (bias, optional q/k norm, partial rotary) with DeepSeek-V3's router,
    # shared experts, dense prefix and MTP layer
    "glm4_moe": Family("glm4_moe", "gqa", "mlp", ("gate_proj", "up_proj", "down_proj"),
                       _COMMON + ("moe_intermediate_size",)),
    # GLM-4.7-Flash: DeepSeek-V3's MLA and router, dense/sparse layers listed by mlp_layer_types, MTP layer
    "glm4_moe_lite": Family("glm4_moe_lite", "mla", "mlp", ("gate_proj", "up_proj", "down_proj"), _MLA),
}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(args_or_type) -> Family:
    """The family of a `ModelArgs` (or of a model_type string)."""
    model_type = args_or_type if isinstance(args_or_type, str) else args_or_type.model_type
    return FAMILIES[model_type]
