#!/usr/bin/env python
"""Write a tiny random checkpoint of a supported family in real Hugging Face format (for tests and smoke runs).

The model is built with transformers' own classes (DeepSeek-V3/V2, Qwen3-MoE, Mixtral, GLM-4.5, GLM-4.7-Flash) and
saved with `save_pretrained` (per-expert tensor names, sharded with an index when asked). The MTP layer is added under its real names `model.layers.{N}.*`: a
full MoE decoder block (taken from an (N+1)-layer model of the same config) plus `enorm`, `hnorm`, `eh_proj` and
`shared_head.norm`. Options rewrite the experts in the fused layout or quantise the checkpoint to FP8 with block
scales (`*_scale_inv`), as DeepSeek-V3's release is.

    python scripts/make_tiny_checkpoint.py OUT_DIR [--model-type deepseek_v2] [--fp8] [--fused] [--no-mtp]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("make_tiny_checkpoint")

V3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    max_position_embeddings=512,
    rope_interleave=True,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
)
V2_DEFAULTS: dict[str, Any] = dict(
    V3_DEFAULTS,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    num_nextn_predict_layers=0,
)


QWEN3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)
GLM4_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
    max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=1,
    tie_word_embeddings=False,
)
GLM4_LITE_DEFAULTS: dict[str, Any] = dict(
    V3_DEFAULTS, q_lora_rank=24, v_head_dim=24, n_group=1, topk_group=1, routed_scaling_factor=1.8,
    mlp_layer_types=["dense", "sparse", "sparse"],
)
MIXTRAL_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-5,
    sliding_window=None, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)


def _randomize(model: torch.nn.Module, generator: torch.Generator, std: float) -> None:
    """Give every parameter non-trivial random values (norms around 1, router bias spread out)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(std * torch.randn(param.shape, generator=generator))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=generator))


DEFAULTS = {"deepseek_v3": V3_DEFAULTS, "deepseek_v2": V2_DEFAULTS, "qwen3_moe": QWEN3_DEFAULTS,
            "mixtral": MIXTRAL_DEFAULTS, "glm4_moe": GLM4_DEFAULTS, "glm4_moe_lite": GLM4_LITE_DEFAULTS}


def _classes(model_type: str):
    import transformers

    names = {"deepseek_v3": "DeepseekV3", "deepseek_v2": "DeepseekV2", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral",
             "glm4_moe": "Glm4Moe", "glm4_moe_lite": "Glm4MoeLite"}[model_type]
    return getattr(transformers, f"{names}Config"), getattr(transformers, f"{names}ForCausalLM")


def _build(model_type: str, config_kwargs: dict[str, Any], layers: int, seed: int, std: float):
    config_cls, model_cls = _classes(model_type)
    kwargs = dict(config_kwargs)
    kwargs["num_hidden_layers"] = layers
    if "mlp_layer_types" in kwargs:  # one entry per layer (an MTP build has one more)
        kinds = list(kwargs["mlp_layer_types"])
        kwargs["mlp_layer_types"] = (kinds + ["sparse"] * layers)[:layers]
    if model_type == "deepseek_v2":
        kwargs.pop("rope_interleave", None)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    _randomize(model, generator, std)
    return config, model


def make_tiny_checkpoint(
    out_dir: str | Path,
    model_type: str = "deepseek_v3",
    *,
    seed: int = 0,
    with_mtp: bool = True,
    fp8: bool = False,
    fp8_block: tuple[int, int] = (16, 16),
    fused_experts: bool = False,
    max_shard_size: str | None = "200KB",
    dtype: torch.dtype = torch.float32,
    std: float = 0.08,
    tokenizer_from: str | Path | None = None,
    **overrides: Any,
) -> Path:
    """Create the checkpoint directory and return its path."""
    from safetensors.torch import load_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {**DEFAULTS[model_type], **overrides}
    with_mtp = with_mtp and "num_nextn_predict_layers" in kwargs  # the families with an MTP layer
    if "num_nextn_predict_layers" in kwargs and not with_mtp:
        kwargs["num_nextn_predict_layers"] = 0
    n = kwargs["num_hidden_layers"]
    config, model = _build(model_type, kwargs, n, seed, std)
    model = model.to(dtype)
    model.save_pretrained(out, max_shard_size=max_shard_size or "10GB")

    extra: dict[str, torch.Tensor] = {}
    if with_mtp:
        # An (N+1)-layer model of the same config: its last layer is a fresh MoE block for the MTP layer.
        _, bigger = _build(model_type, kwargs, n + 1, seed + 1, std)
        generator = torch.Generator().manual_seed(seed + 2)
        h = kwargs["hidden_size"]
        block_prefix = f"model.layers.{n}."
        for name, tensor in _per_expert_state(bigger).items():
            if name.startswith(block_prefix):
                extra[name] = tensor.to(dtype)
        extra[f"model.layers.{n}.enorm.weight"] = (1.0 + 0.2 * torch.randn(h, generator=generator)).to(dtype)
        extra[f"model.layers.{n}.hnorm.weight"] = (1.0 + 0.2 * torch.randn(h, generator=generator)).to(dtype)
        extra[f"model.layers.{n}.eh_proj.weight"] = (std * torch.randn(h, 2 * h, generator=generator)).to(dtype)
        extra[f"model.layers.{n}.shared_head.norm.weight"] = (1.0 + 0.2 * torch.randn(h, generator=generator)).to(dtype)

    # Rewrite the tensors once more if the layout or precision changes, then reshard.
    state = {}
    for file in sorted(out.glob("*.safetensors")):
        state.update(load_file(file))
        file.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    state.update(extra)
    if fused_experts:
        state = _fuse_experts(state, kwargs["n_routed_experts"])
    if fp8:
        state = _quantize_fp8(state, fp8_block)
    _write_shards(out, state, max_shard_size)
    config_json = json.loads((out / "config.json").read_text())
    if "num_nextn_predict_layers" in kwargs:
        config_json["num_nextn_predict_layers"] = kwargs["num_nextn_predict_layers"]
    if fp8:
        config_json["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block),
        }
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            src = Path(tokenizer_from) / name
            if src.is_file():
                (out / name).write_bytes(src.read_bytes())
    return out


def _per_expert_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with transformers' fused in-memory experts split into checkpoint (per-expert) names."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                state[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inter].clone()
                state[f"{prefix}{e}.up_proj.weight"] = tensor[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                state[f"{prefix}{e}.down_proj.weight"] = tensor[e].clone()
        else:
            state[name] = tensor.clone()
    return state


def _fuse_experts(state: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    out = {}
    layers = sorted({name.split(".mlp.experts.")[0] for name in state if ".mlp.experts." in name})
    for prefix in layers:
        gate = [state.pop(f"{prefix}.mlp.experts.{e}.gate_proj.weight") for e in range(n_experts)]
        up = [state.pop(f"{prefix}.mlp.experts.{e}.up_proj.weight") for e in range(n_experts)]
        down = [state.pop(f"{prefix}.mlp.experts.{e}.down_proj.weight") for e in range(n_experts)]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat((g, u)) for g, u in zip(gate, up)])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack(down)
    out.update(state)
    return out


def _quantize_fp8(state: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """FP8-quantise the 2-D projection weights as DeepSeek-V3 does (not norms, router, embeddings, head, eh_proj)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from moeprefetch.quant import quantize_fp8_blocks

    keep = ("norm", "mlp.gate.", "embed_tokens", "lm_head", "eh_proj", "shared_head")
    out = {}
    for name, tensor in state.items():
        if tensor.dim() == 2 and name.endswith(".weight") and not any(k in name for k in keep):
            payload, scale = quantize_fp8_blocks(tensor.float(), block)
            out[name] = payload
            out[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
        else:
            out[name] = tensor
    return out


def _parse_size(text: str) -> int:
    units = {"KB": 1000, "MB": 1000**2, "GB": 1000**3}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _write_shards(out: Path, state: dict[str, torch.Tensor], max_shard_size: str | None) -> None:
    from safetensors.torch import save_file

    limit = _parse_size(max_shard_size) if max_shard_size else None
    names = sorted(state)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = state[name].numel() * state[name].element_size()
        if limit and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        save_file({k: state[k].contiguous() for k in shards[0]}, out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k].contiguous() for k in shard}, out / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output directory")
    parser.add_argument("--model-type", default="deepseek_v3", choices=sorted(DEFAULTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mtp", action="store_true")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--fused", action="store_true", help="write experts in the fused gate_up_proj/down_proj layout")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--tokenizer-from", default=None, help="copy tokenizer.json/tokenizer_config.json from here")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    overrides: dict[str, Any] = {}
    if ns.layers is not None:
        overrides["num_hidden_layers"] = ns.layers
    if ns.experts is not None:
        overrides["n_routed_experts"] = ns.experts
    if ns.top_k is not None:
        overrides["num_experts_per_tok"] = ns.top_k
    path = make_tiny_checkpoint(
        ns.out,
        ns.model_type,
        seed=ns.seed,
        with_mtp=not ns.no_mtp,
        fp8=ns.fp8,
        fused_experts=ns.fused,
        tokenizer_from=ns.tokenizer_from,
        **overrides,
    )
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
