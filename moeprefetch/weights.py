"""Checkpoint tensors -> typed weight objects for everything except routed experts (see expert_records.py).

With expert_records.py (the routed experts' names) this is the only place that knows Hugging Face tensor names. Each tensor is checked against the shape
the config implies and its dtype before it is used; FP8 block-quantised tensors are dequantised with their
`*_scale_inv` here, so the compute code only ever sees the engine's dtype (routers and their bias stay fp32).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import Iterator

import torch

from .checkpoint import FLOAT_DTYPES, CheckpointReader
from .config import ModelArgs
from .errors import CheckpointError
from .families import family_of
from .quant import dequantize_blocks

logger = logging.getLogger(__name__)


@dataclass
class Linear:
    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None


@dataclass
class AttentionWeights:
    q_proj: Linear | None  # when q_lora_rank is None
    q_a_proj: Linear | None
    q_a_norm: torch.Tensor | None
    q_b_proj: Linear | None
    kv_a_proj: Linear  # hidden -> kv_lora_rank + qk_rope_head_dim
    kv_a_norm: torch.Tensor
    kv_b_proj: Linear  # kv_lora_rank -> heads * (qk_nope + v)
    o_proj: Linear


@dataclass
class GQAWeights:
    """Grouped-query attention (Qwen3-MoE, Mixtral): h query heads share h_kv key/value heads of size d."""

    q_proj: Linear  # hidden -> h * d
    k_proj: Linear  # hidden -> h_kv * d
    v_proj: Linear  # hidden -> h_kv * d
    o_proj: Linear  # h * d -> hidden
    q_norm: torch.Tensor | None  # [d], RMSNorm of each query head (Qwen3)
    k_norm: torch.Tensor | None  # [d]


@dataclass
class MLPWeights:
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear


@dataclass
class RouterWeights:
    weight: torch.Tensor  # [n_experts, hidden] fp32
    bias: torch.Tensor | None  # e_score_correction_bias [n_experts] fp32, selection only


@dataclass
class LayerWeights:
    index: int
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    attn: AttentionWeights | GQAWeights
    mlp: MLPWeights | None  # dense layers
    router: RouterWeights | None  # MoE layers
    shared: MLPWeights | None  # MoE layers with shared experts


@dataclass
class MTPWeights:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Linear  # [hidden, 2*hidden]; input is cat(enorm(embed), hnorm(hidden)) — embedding first
    layer: LayerWeights
    head_norm: torch.Tensor  # shared_head.norm
    head: torch.Tensor | None  # shared_head.head; None -> the main lm_head
    embed: torch.Tensor | None  # embed_tokens of the MTP layer; None -> the main embedding


@dataclass
class ModelWeights:
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]
    mtp: MTPWeights | None

    def mtp_head(self) -> torch.Tensor:
        assert self.mtp is not None
        return self.mtp.head if self.mtp.head is not None else self.lm_head


def projection_groups(lw: LayerWeights) -> list[tuple[object, list[Linear]]]:
    """Projections of a layer that read the same input, which a decode step computes as one GEMV over their rows
    stacked (`layer_ops.FusedOps`), with the weights object that owns each group: the query (or its LoRA
    down-projection) with kv_a_proj (or q, k and v), and each MLP's gate with its up projection."""
    attn = lw.attn
    if isinstance(attn, GQAWeights):
        groups: list[tuple[object, list[Linear]]] = [(attn, [attn.q_proj, attn.k_proj, attn.v_proj])]
    else:
        groups = [(attn, [attn.q_proj if attn.q_proj is not None else attn.q_a_proj, attn.kv_a_proj])]
    groups += [(m, [m.gate_proj, m.up_proj]) for m in (lw.mlp, lw.shared) if m is not None]
    return groups


def iter_tensors(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor held by a weights object (recursively), for byte counts and device moves."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list):
        for item in obj:
            yield from iter_tensors(item)
    elif obj is not None and hasattr(obj, "__dataclass_fields__"):
        for f in fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def weights_nbytes(obj: object) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


# ---- reading with validation ---------------------------------------------------------------------------------------


class TensorLoader:
    """Reads named tensors, checks shape/dtype, dequantises FP8, converts and moves them to the target device."""

    def __init__(self, reader: CheckpointReader, args: ModelArgs, dtype: torch.dtype, device: torch.device):
        self.reader = reader
        self.args = args
        self.dtype = dtype
        self.device = device

    def exists(self, name: str) -> bool:
        return name in self.reader

    def raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Stored tensor (dequantised to fp32 if FP8), validated, on the CPU."""
        info = self.reader.info(name)
        if info.shape != shape:
            raise CheckpointError(
                f"tensor {name!r} in {info.file.name} has shape {list(info.shape)}, but the config implies {list(shape)}"
            )
        if info.dtype in ("F8_E4M3", "F8_E5M2"):
            scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
            if scale_name not in self.reader:
                raise CheckpointError(f"FP8 tensor {name!r} in {info.file.name} has no {scale_name!r} scale tensor")
            quant = self.args.quant
            block = (quant.block_rows, quant.block_cols) if quant else (128, 128)
            payload = self.reader.read(name)
            scale = self.reader.read(scale_name)
            try:
                tensor = dequantize_blocks(payload, scale, block, torch.float32)
            except ValueError as exc:
                raise CheckpointError(f"scale tensor {scale_name!r} does not fit {name!r}: {exc}") from None
        elif info.dtype in FLOAT_DTYPES:
            tensor = self.reader.read(name)
        else:
            raise CheckpointError(
                f"tensor {name!r} in {info.file.name} has dtype {info.dtype}; weights must be floating point or FP8"
            )
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"tensor {name!r} in {info.file.name} holds NaN or infinite values (corrupt data?)")
        return tensor

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = self.raw(name, shape)
        return tensor.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> Linear:
        weight = self.get(f"{prefix}.weight", (out_features, in_features))
        b = None
        if bias or f"{prefix}.bias" in self.reader:
            b = self.get(f"{prefix}.bias", (out_features,))
        return Linear(weight, b)


def _gqa_attention(loader: TensorLoader, p: str) -> GQAWeights:
    a = loader.args
    d, heads, kv_heads, bias = a.qk_head_dim, a.num_attention_heads, a.num_key_value_heads, a.attention_bias
    return GQAWeights(
        q_proj=loader.linear(f"{p}.self_attn.q_proj", heads * d, a.hidden_size, bias),
        k_proj=loader.linear(f"{p}.self_attn.k_proj", kv_heads * d, a.hidden_size, bias),
        v_proj=loader.linear(f"{p}.self_attn.v_proj", kv_heads * d, a.hidden_size, bias),
        o_proj=loader.linear(f"{p}.self_attn.o_proj", a.hidden_size, heads * d),
        q_norm=loader.get(f"{p}.self_attn.q_norm.weight", (d,)) if a.qk_norm else None,
        k_norm=loader.get(f"{p}.self_attn.k_norm.weight", (d,)) if a.qk_norm else None,
    )


def _attention(loader: TensorLoader, p: str) -> AttentionWeights | GQAWeights:
    a = loader.args
    if a.attention == "gqa":
        return _gqa_attention(loader, p)
    heads = a.num_attention_heads
    bias = a.attention_bias
    if a.q_lora_rank is None:
        q_proj = loader.linear(f"{p}.self_attn.q_proj", heads * a.qk_head_dim, a.hidden_size)
        q_a = q_a_norm = q_b = None
    else:
        q_proj = None
        q_a = loader.linear(f"{p}.self_attn.q_a_proj", a.q_lora_rank, a.hidden_size, bias)
        q_a_norm = loader.get(f"{p}.self_attn.q_a_layernorm.weight", (a.q_lora_rank,))
        q_b = loader.linear(f"{p}.self_attn.q_b_proj", heads * a.qk_head_dim, a.q_lora_rank)
    return AttentionWeights(
        q_proj=q_proj,
        q_a_proj=q_a,
        q_a_norm=q_a_norm,
        q_b_proj=q_b,
        kv_a_proj=loader.linear(
            f"{p}.self_attn.kv_a_proj_with_mqa", a.kv_lora_rank + a.qk_rope_head_dim, a.hidden_size, bias
        ),
        kv_a_norm=loader.get(f"{p}.self_attn.kv_a_layernorm.weight", (a.kv_lora_rank,)),
        kv_b_proj=loader.linear(
            f"{p}.self_attn.kv_b_proj", heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank
        ),
        o_proj=loader.linear(f"{p}.self_attn.o_proj", a.hidden_size, heads * a.v_head_dim, bias),
    )


def _mlp(loader: TensorLoader, p: str, intermediate: int) -> MLPWeights:
    h = loader.args.hidden_size
    bias = loader.args.mlp_bias
    return MLPWeights(
        gate_proj=loader.linear(f"{p}.gate_proj", intermediate, h, bias),
        up_proj=loader.linear(f"{p}.up_proj", intermediate, h, bias),
        down_proj=loader.linear(f"{p}.down_proj", h, intermediate, bias),
    )


def load_layer(loader: TensorLoader, index: int) -> LayerWeights:
    a = loader.args
    p = f"model.layers.{index}"
    moe = a.is_moe_layer(index)
    router = shared = mlp = None
    if moe:
        gate = f"{p}.{family_of(a).moe_prefix}.gate"
        bias_name = f"{gate}.e_score_correction_bias"
        bias = loader.get(bias_name, (a.n_routed_experts,), torch.float32) if loader.exists(bias_name) else None
        router = RouterWeights(
            weight=loader.get(f"{gate}.weight", (a.n_routed_experts, a.hidden_size), torch.float32), bias=bias
        )
        if a.n_shared_experts > 0:
            shared = _mlp(loader, f"{p}.mlp.shared_experts", a.moe_intermediate_size * a.n_shared_experts)
    else:
        mlp = _mlp(loader, f"{p}.mlp", a.intermediate_size)
    return LayerWeights(
        index=index,
        input_norm=loader.get(f"{p}.input_layernorm.weight", (a.hidden_size,)),
        post_attention_norm=loader.get(f"{p}.post_attention_layernorm.weight", (a.hidden_size,)),
        attn=_attention(loader, p),
        mlp=mlp,
        router=router,
        shared=shared,
    )


def mtp_tensor_names(args: ModelArgs, reader: CheckpointReader) -> tuple[list[str], list[str]]:
    """(required names, names present) for the first MTP layer; routed experts excluded."""
    n = args.mtp_layer_index
    p = f"model.layers.{n}"
    required = [f"{p}.enorm.weight", f"{p}.hnorm.weight", f"{p}.eh_proj.weight", f"{p}.shared_head.norm.weight"]
    required += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight", f"{p}.mlp.gate.weight"]
    required.append(f"{p}.self_attn.o_proj.weight")
    if args.attention == "gqa":
        required += [f"{p}.self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj")]
    else:
        required += [f"{p}.self_attn.kv_a_proj_with_mqa.weight", f"{p}.self_attn.kv_b_proj.weight",
                     f"{p}.self_attn.kv_a_layernorm.weight"]
        if args.q_lora_rank is None:
            required.append(f"{p}.self_attn.q_proj.weight")
        else:
            required += [f"{p}.self_attn.q_a_proj.weight", f"{p}.self_attn.q_b_proj.weight"]
    if args.n_shared_experts > 0:
        required += [f"{p}.mlp.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    present = [name for name in reader.tensors if name.startswith(f"{p}.")]
    return required, present


def resident_bytes(reader: CheckpointReader, args: ModelArgs, element_size: int) -> tuple[int, dict[int, int]]:
    """Device bytes of everything but the routed experts (routers in fp32, the rest in the engine's dtype, FP8
    scales dropped by dequantisation): the total, and per main decoder layer (the candidates for streaming; the MTP
    layer always stays resident)."""
    total, per_layer = 0, {}
    moe = family_of(args).moe_prefix
    for name, info in reader.tensors.items():
        if f".{moe}.experts." in name or name.endswith("_scale_inv"):
            continue
        nbytes = math.prod(info.shape) * (4 if f".{moe}.gate." in name else element_size)
        total += nbytes
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer < args.num_hidden_layers:
                per_layer[layer] = per_layer.get(layer, 0) + nbytes
    return total, per_layer


def load_model_weights(
    reader: CheckpointReader,
    args: ModelArgs,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    host_layers: frozenset[int] = frozenset(),
    host_embedding: bool = False,
) -> ModelWeights:
    """All non-routed-expert weights, validated, on `device` in `dtype` — except `host_layers`, kept on the CPU for
    layer streaming, and with `host_embedding` the embedding table (read row by row from host memory)."""
    from tqdm.auto import tqdm

    loader = TensorLoader(reader, args, dtype, device)
    host_loader = TensorLoader(reader, args, dtype, torch.device("cpu"))
    h, v = args.hidden_size, args.vocab_size
    embed = (host_loader if host_embedding else loader).get("model.embed_tokens.weight", (v, h))
    if args.tie_word_embeddings and "lm_head.weight" not in reader:
        lm_head = embed
    else:
        lm_head = loader.get("lm_head.weight", (v, h))
    layers = [
        load_layer(host_loader if i in host_layers else loader, i)
        for i in tqdm(range(args.num_hidden_layers), desc="loading layers", disable=not progress, leave=False)
    ]
    weights = ModelWeights(
        embed=embed,
        final_norm=loader.get("model.norm.weight", (h,)),
        lm_head=lm_head,
        layers=layers,
        mtp=_load_mtp(loader, reader, args),
    )
    return weights


def _load_mtp(loader: TensorLoader, reader: CheckpointReader, args: ModelArgs) -> MTPWeights | None:
    if args.num_nextn_predict_layers <= 0:
        return None
    required, present = mtp_tensor_names(args, reader)
    if not present:
        logger.info("checkpoint has no MTP layer (model.layers.%d.*): MTP is unavailable", args.mtp_layer_index)
        return None
    missing = [name for name in required if name not in reader]
    if missing:
        raise CheckpointError(
            f"the MTP layer model.layers.{args.mtp_layer_index} is only partly present: missing {missing[0]}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    h, v = args.hidden_size, args.vocab_size
    p = f"model.layers.{args.mtp_layer_index}"
    head = embed = None
    if f"{p}.shared_head.head.weight" in reader:
        head = loader.get(f"{p}.shared_head.head.weight", (v, h))
    if f"{p}.embed_tokens.weight" in reader:
        embed = loader.get(f"{p}.embed_tokens.weight", (v, h))
    return MTPWeights(
        enorm=loader.get(f"{p}.enorm.weight", (h,)),
        hnorm=loader.get(f"{p}.hnorm.weight", (h,)),
        eh_proj=loader.linear(f"{p}.eh_proj", h, 2 * h),
        layer=load_layer(loader, args.mtp_layer_index),
        head_norm=loader.get(f"{p}.shared_head.norm.weight", (h,)),
        head=head,
        embed=embed,
    )
