"""Model architecture read from a checkpoint's config.json (through transformers' AutoConfig).

`ModelArgs` is the single frozen description of the architecture that every other module reads; nothing else looks
at the Hugging Face config object. DeepSeek-V3 and V2 differ only in defaults here (router scoring and top-k method),
so both map onto the same fields.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .families import FAMILIES, SUPPORTED_MODEL_TYPES, family_of
from .int4_checkpoints import Int4CheckpointArgs, parse_int4_config

logger = logging.getLogger(__name__)

# Each family's config.json must state its shape fields itself (`families.py`): AutoConfig would silently fill class
# defaults (the full 671B shape) for a missing one, and a model built from the wrong shape fails much later with a
# confusing error.

SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class RopeArgs:
    """Rotary embedding parameters (default RoPE or YaRN)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = True  # DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...


@dataclass(frozen=True)
class QuantArgs:
    """FP8 block quantisation of a checkpoint (DeepSeek-V3 style `*_scale_inv` tensors)."""

    method: str = "fp8"
    block_rows: int = 128
    block_cols: int = 128


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    scoring_func: str  # "sigmoid" (V3) | "softmax" (V2)
    topk_method: str  # "noaux_tc" (V3) | "greedy" | "group_limited_greedy" (V2)
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeArgs
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    hidden_act: str
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    quant: QuantArgs | None = None
    int4: Int4CheckpointArgs | None = None  # a 4-bit weight-only checkpoint (GPTQ, AWQ, compressed-tensors)
    # grouped-query attention (families.py: "gqa"); for those, the MLA fields above hold head_dim as the rotary and
    # value size and 0 for the latent ranks
    num_key_value_heads: int = 0
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotary embedding (Qwen3)
    sliding_window: int | None = None  # keys at most this many positions back (Mixtral), or all
    sparse_layers: tuple[int, ...] | None = None  # the MoE layers, where a family lists them (else the dense prefix)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived shapes -------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attention(self) -> str:
        return family_of(self).attention

    @property
    def mtp_layer_index(self) -> int:
        """The checkpoint layer index of the (first) MTP layer: the id after the main layers."""
        return self.num_hidden_layers

    def is_moe_layer(self, layer: int) -> bool:
        """A main layer is MoE iff it is past the dense prefix and on the MoE stride; MTP layers are always MoE."""
        if layer >= self.num_hidden_layers:
            return True
        if self.sparse_layers is not None:
            return layer in self.sparse_layers
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def softmax_scale(self) -> float:
        """Attention scale: 1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN in the MLA families
        (DeepSeek's attention does so; transformers' grouped-query families scale only cos and sin: `rope.py`)."""
        scale = self.qk_head_dim**-0.5
        if self.attention == "mla" and self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _read_raw_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist or is not a directory")
    if not config_file.is_file():
        raise CheckpointError(f"{config_file} is missing: a checkpoint directory needs a config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object, not {type(raw).__name__}")
    return raw


def _rope_args(hf_config: Any, raw: dict[str, Any]) -> RopeArgs:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = raw.get("rope_scaling") or {}
    for key, value in legacy.items():  # older configs carry YaRN under rope_scaling
        params.setdefault(key, value)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if rope_type not in ("default", "yarn"):
        raise CheckpointError(f"rope type {rope_type!r} is not supported (supported: default, yarn)")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 4096)
    if rope_type == "yarn" and factor is None:
        factor = raw.get("max_position_embeddings", original) / original
    interleave = FAMILIES[raw["model_type"]].attention == "mla"  # GQA families rotate halves
    if raw.get("model_type") in ("deepseek_v3", "glm4_moe_lite"):
        interleave = bool(raw.get("rope_interleave", True))
    return RopeArgs(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor or 1.0),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        interleave=interleave,
    )


def _quant_args(raw: dict[str, Any]) -> QuantArgs | None:
    qc = raw.get("quantization_config")
    if not qc or parse_int4_config(qc) is not None:  # 4-bit checkpoints: `int4`, int4_checkpoints.py
        return None
    method = qc.get("quant_method", "fp8")
    if method != "fp8":
        raise CheckpointError(f"quantization method {method!r} is not supported (supported: fp8 block quantisation, "
                              f"4-bit compressed-tensors pack-quantized, GPTQ and AWQ)")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise CheckpointError(f"FP8 format {fmt!r} is not supported (supported: e4m3)")
    block = qc.get("weight_block_size") or [128, 128]
    if len(block) != 2 or min(block) <= 0:
        raise CheckpointError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return QuantArgs(method="fp8", block_rows=int(block[0]), block_cols=int(block[1]))


def load_model_args(path: str | Path) -> ModelArgs:
    """Read `path/config.json` through transformers' AutoConfig and validate what the engine relies on."""
    path = Path(path)
    raw = _read_raw_config(path)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path / 'config.json'} has model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    required = FAMILIES[model_type].required_fields
    missing = [name for name in required if raw.get(name) is None]
    if model_type in ("qwen3_moe", "mixtral") and raw.get("num_experts", raw.get("num_local_experts")) is None:
        missing.append("num_experts" if model_type == "qwen3_moe" else "num_local_experts")
    if missing:
        raise CheckpointError(f"{path / 'config.json'} is missing required field(s): {', '.join(missing)}")

    from transformers import AutoConfig  # imported lazily: it is slow to import

    try:
        hf = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # transformers validates strictly and raises many types
        reason = " ".join(str(exc).split())  # one line: transformers' validation errors span several
        raise CheckpointError(f"{path / 'config.json'} was rejected by transformers' AutoConfig: {reason}") from None

    def get(name: str, default: Any = None) -> Any:
        value = raw.get(name, getattr(hf, name, default))
        return default if value is None else value

    parse = _gqa_args if FAMILIES[model_type].attention == "gqa" else _mla_args
    args = parse(raw, get, hf, model_type, path)
    _validate_shapes(args, path)
    return args


def _common_fields(raw: dict[str, Any], get, hf: Any, eps: float) -> dict[str, Any]:
    """The ModelArgs fields every family reads the same way (`eps`: the family's default RMSNorm epsilon)."""
    act = get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise CheckpointError(f"hidden_act {act!r} is not supported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    eos = get("eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return dict(vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
                num_hidden_layers=int(get("num_hidden_layers")), hidden_act=act,
                rms_norm_eps=float(get("rms_norm_eps", eps)),
                max_position_embeddings=int(get("max_position_embeddings", 4096)), rope=_rope_args(hf, raw),
                tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                attention_bias=bool(get("attention_bias", False)), bos_token_id=get("bos_token_id", None),
                eos_token_ids=tuple(int(e) for e in eos_ids), pad_token_id=get("pad_token_id", None),
                quant=_quant_args(raw), int4=parse_int4_config(raw.get("quantization_config") or None), extra={k: v for k, v in raw.items() if k not in ("architectures",)})


def _router_fields(n_experts: int, top_k: int, n_group: int, topk_group: int, group_limited: bool
                   ) -> dict[str, int]:
    """The router's sizes, checked against each other."""
    if n_experts % n_group:
        raise CheckpointError(f"n_routed_experts ({n_experts}) is not a multiple of n_group ({n_group})")
    if not 0 < topk_group <= n_group:
        raise CheckpointError(f"topk_group ({topk_group}) must lie in 1..n_group ({n_group})")
    if not 0 < top_k <= n_experts:
        raise CheckpointError(f"num_experts_per_tok ({top_k}) must lie in 1..n_routed_experts ({n_experts})")
    if group_limited and top_k > topk_group * (n_experts // n_group):
        raise CheckpointError(
            f"num_experts_per_tok ({top_k}) exceeds the experts in the {topk_group} selected group(s)"
        )
    return dict(n_routed_experts=n_experts, num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group)


def _dense_prefix(raw: dict[str, Any], get, path: Path) -> int:
    """first_k_dense_replace, whose dense layers need an intermediate_size."""
    first_dense = int(get("first_k_dense_replace", 0) or 0)
    if first_dense > 0 and raw.get("intermediate_size") is None:
        raise CheckpointError(f"{path / 'config.json'} is missing required field intermediate_size (dense layers)")
    return first_dense


def _mtp_layers(raw: dict[str, Any]) -> int:
    return int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0)


def _mla_args(raw: dict[str, Any], get, hf: Any, model_type: str, path: Path) -> ModelArgs:
    """DeepSeek-V3/V2 and GLM-4.7-Flash: MLA attention, their routers, a dense prefix (or listed layer kinds)."""
    is_v3 = model_type in ("deepseek_v3", "glm4_moe_lite")  # V3's router and defaults
    scoring = get("scoring_func", "sigmoid" if is_v3 else "softmax")
    topk_method = get("topk_method", "noaux_tc" if is_v3 else "greedy")
    if scoring not in ("sigmoid", "softmax"):
        raise CheckpointError(f"scoring_func {scoring!r} is not supported (supported: sigmoid, softmax)")
    if topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise CheckpointError(
            f"topk_method {topk_method!r} is not supported (supported: noaux_tc, greedy, group_limited_greedy)"
        )
    scoring, topk_method = _transformers_router(model_type, is_v3, scoring, topk_method)
    n_group = int(get("n_group", 1) or 1)
    router = _router_fields(int(get("n_routed_experts")), int(get("num_experts_per_tok")), n_group,
                            int(get("topk_group", n_group) or n_group), topk_method != "greedy")
    common = _common_fields(raw, get, hf, 1e-6)
    return ModelArgs(
        model_type=model_type, **common, **router,
        intermediate_size=int(get("intermediate_size", 0)), moe_intermediate_size=int(get("moe_intermediate_size")),
        num_attention_heads=int(get("num_attention_heads")),
        q_lora_rank=raw.get("q_lora_rank", getattr(hf, "q_lora_rank", None)), kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")), n_shared_experts=int(get("n_shared_experts", 0) or 0),
        first_k_dense_replace=_dense_prefix(raw, get, path), moe_layer_freq=_moe_layer_freq(get, model_type),
        scoring_func=scoring, topk_method=topk_method, norm_topk_prob=_norm_topk_prob(raw, hf, is_v3),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)), num_nextn_predict_layers=_mtp_layers(raw),
        mlp_bias=bool(get("mlp_bias", False)),
        sparse_layers=_listed_sparse_layers(raw, hf, common["num_hidden_layers"]),
    )


def _moe_layer_freq(get, model_type: str) -> int:
    """transformers' DeepSeek models put an MoE block in every layer past the dense prefix, whatever
    moe_layer_freq says (every released checkpoint says 1), and write their checkpoints so: this one follows."""
    freq = get("moe_layer_freq", 1)
    if freq not in (None, 1):
        logger.warning("moe_layer_freq=%r is ignored for %s, as transformers does: every layer past the dense prefix "
                       "is MoE", freq, model_type)
    return 1


def _transformers_router(model_type: str, is_v3: bool, scoring: str, topk_method: str) -> tuple[str, str]:
    """The router transformers runs for these fields: DeepseekV3 (and GLM-4.7-Flash) always route with sigmoid
    scores, the correction bias and group-limited top-k (noaux_tc), DeepseekV2 always with softmax and its
    topk_method (greedy or group_limited_greedy; it has no noaux_tc). Fields it ignores are ignored here too, said
    once, so a checkpoint gives transformers' tokens."""
    if is_v3:
        if (scoring, topk_method) != ("sigmoid", "noaux_tc"):
            logger.warning("scoring_func=%r and topk_method=%r are ignored for %s, as transformers does: it routes "
                           "with sigmoid scores and noaux_tc", scoring, topk_method, model_type)
        return "sigmoid", "noaux_tc"
    if topk_method == "noaux_tc":
        raise CheckpointError("topk_method 'noaux_tc' is not supported for deepseek_v2 (transformers' DeepseekV2 "
                              "routes with greedy or group_limited_greedy)")
    if scoring != "softmax":
        logger.warning("scoring_func=%r is ignored for deepseek_v2, as transformers' DeepseekV2 does: it routes with "
                       "softmax scores", scoring)
    return "softmax", topk_method


def _gqa_attention_fields(raw: dict[str, Any], get, hf: Any) -> dict[str, Any]:
    """Heads, head size and rotary size of a grouped-query family, as ModelArgs fields (the rotary part of a head
    comes first: qk_rope_head_dim of it rotates, qk_nope_head_dim does not)."""
    heads = int(get("num_attention_heads"))
    head_dim = int(get("head_dim", 0) or int(get("hidden_size")) // heads)
    kv_heads = int(get("num_key_value_heads", heads) or heads)
    if heads % kv_heads:
        raise CheckpointError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    params = dict(getattr(hf, "rope_parameters", None) or {})
    partial = float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor")
                    or getattr(hf, "partial_rotary_factor", None) or 1.0)
    rotary = int(head_dim * partial)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise CheckpointError(f"the rotary part of a head ({rotary} of {head_dim}) must be even and positive")
    return dict(num_attention_heads=heads, num_key_value_heads=kv_heads, q_lora_rank=None, kv_lora_rank=0,
                qk_nope_head_dim=head_dim - rotary, qk_rope_head_dim=rotary, v_head_dim=head_dim)


def _glm4_args(raw: dict[str, Any], get, hf: Any, path: Path) -> ModelArgs:
    n_group = int(get("n_group", 1) or 1)
    router = _router_fields(int(raw.get("n_routed_experts", raw.get("num_local_experts")) or 0),
                            int(get("num_experts_per_tok")), n_group, int(get("topk_group", n_group) or n_group),
                            group_limited=True)
    return ModelArgs(
        model_type="glm4_moe", **_common_fields(raw, get, hf, 1e-5), **router, **_gqa_attention_fields(raw, get, hf),
        intermediate_size=int(get("intermediate_size", 0) or 0),
        moe_intermediate_size=int(get("moe_intermediate_size")), n_shared_experts=int(get("n_shared_experts", 0) or 0),
        first_k_dense_replace=_dense_prefix(raw, get, path), moe_layer_freq=1, scoring_func="sigmoid",
        topk_method="noaux_tc", norm_topk_prob=bool(get("norm_topk_prob", True)),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)), num_nextn_predict_layers=_mtp_layers(raw),
        mlp_bias=False, qk_norm=bool(get("use_qk_norm", False)),
    )


def _listed_sparse_layers(raw: dict[str, Any], hf: Any, layers: int) -> tuple[int, ...] | None:
    """GLM-4.7-Flash lists each layer's kind ("dense" or "sparse") in mlp_layer_types (transformers' default when the
    config omits it: the first layer dense); others have a dense prefix."""
    kinds = raw.get("mlp_layer_types") or (getattr(hf, "mlp_layer_types", None)
                                           if raw.get("model_type") == "glm4_moe_lite" else None)
    if kinds is None:
        return None
    if len(kinds) != layers or any(k not in ("dense", "sparse") for k in kinds):
        raise CheckpointError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} layers")
    return tuple(i for i, kind in enumerate(kinds) if kind == "sparse")


def _gqa_args(raw: dict[str, Any], get, hf: Any, model_type: str, path: Path) -> ModelArgs:
    """The grouped-query families. Qwen3-MoE and Mixtral: a softmax top-k router over one group, no shared experts;
    Qwen3 lists its MoE layers (`decoder_sparse_step`, `mlp_only_layers`), Mixtral's are all MoE and its experts'
    intermediate size is `intermediate_size`. GLM-4.5: DeepSeek-V3's router, shared experts, dense prefix and MTP
    layer, attention with bias, optional q/k norm and a partial rotary embedding."""
    if model_type == "glm4_moe":
        return _glm4_args(raw, get, hf, path)
    qwen = model_type == "qwen3_moe"
    router = _router_fields(int(raw.get("num_experts", raw.get("num_local_experts")) or 0),
                            int(get("num_experts_per_tok")), 1, 1, group_limited=False)
    layers = int(get("num_hidden_layers"))
    if qwen:
        step = int(get("decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in (get("mlp_only_layers", []) or [])}
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        expert_size = int(get("moe_intermediate_size"))
        intermediate = int(get("intermediate_size", 0) or 0)
        if len(sparse) < layers and intermediate <= 0:
            raise CheckpointError(f"{path / 'config.json'} has dense layers but no intermediate_size")
    else:
        sparse = tuple(range(layers))
        expert_size = intermediate = int(get("intermediate_size"))
    window = get("sliding_window", None)
    if qwen and not get("use_sliding_window", False):
        window = None
    return ModelArgs(
        model_type=model_type, **_common_fields(raw, get, hf, 1e-6), **router, **_gqa_attention_fields(raw, get, hf),
        intermediate_size=intermediate, moe_intermediate_size=expert_size, n_shared_experts=0,
        first_k_dense_replace=0, moe_layer_freq=1, scoring_func="softmax", topk_method="greedy",
        # Mixtral always renormalises its top-k weights; Qwen3 as its config says
        norm_topk_prob=bool(get("norm_topk_prob", False)) if qwen else True,
        routed_scaling_factor=1.0, num_nextn_predict_layers=0, mlp_bias=False,
        qk_norm=qwen, sliding_window=int(window) if window else None, sparse_layers=sparse,
    )


def _norm_topk_prob(raw: dict[str, Any], hf: Any, is_v3: bool) -> bool:
    value = bool(raw.get("norm_topk_prob", getattr(hf, "norm_topk_prob", is_v3)) or False)
    if not is_v3 and value:
        # transformers' DeepseekV2 router never renormalises; every released V2 checkpoint sets this to false
        logger.warning("norm_topk_prob=true is ignored for deepseek_v2, as transformers' DeepseekV2 does")
        return False
    return value


def _validate_shapes(args: ModelArgs, path: Path) -> None:
    latent = {"kv_lora_rank": args.kv_lora_rank} if args.attention == "mla" else {}
    positive = {
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        **latent,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "moe_intermediate_size": args.moe_intermediate_size,
    }
    bad = [f"{k}={v}" for k, v in positive.items() if v <= 0]
    if bad:
        raise CheckpointError(f"{path / 'config.json'} has non-positive size(s): {', '.join(bad)}")
    if args.qk_rope_head_dim % 2:
        raise CheckpointError(f"qk_rope_head_dim ({args.qk_rope_head_dim}) must be even for rotary embeddings")
    if args.q_lora_rank is not None and args.q_lora_rank <= 0:
        raise CheckpointError(f"q_lora_rank ({args.q_lora_rank}) must be positive or null")
