"""Building an engine: validate the options, read config and checkpoint, plan memory, load, and wire the parts.

Everything a user can get wrong is checked here before anything large is allocated, and reported as one sentence.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .residency.state import POLICIES
from .checkpoint import CheckpointReader
from .config import ModelArgs, load_model_args
from .errors import CheckpointError, RequestError, ResourceError
from .experts import EXPERT_DTYPES, CheckpointExperts, ExpertFormat
from .planner import MemoryPlan, parse_bytes, plan_memory
from .predictors import MTP_PREDICTORS, PredictorSpec
from .residency import Residency
from .runner import KVCaches
from .store import HostExpertStore
from .streaming import LayerStreamer
from .weights import load_model_weights

if TYPE_CHECKING:
    from .engine import MoEPrefetchEngine

logger = logging.getLogger(__name__)

# how the MTP head reads its routed experts: only those in VRAM (drafts steer speed, never tokens), or all of them
DRAFT_EXPERTS = ("cached", "all")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
ExpertKey = tuple[int, int]


@dataclass(frozen=True)
class EngineOptions:
    device: torch.device
    dtype: torch.dtype
    policy: str
    predictor: str
    lookahead: int
    prefetch_budget: float
    max_inflight_experts: int | None
    max_seq_len: int
    max_batch_size: int
    prefill_chunk: int
    expert_dtype: str
    min_confidence: float = 0.0
    draft_experts: str = "cached"  # the MTP head's routed experts: "cached" (VRAM only) or "all"
    cuda_graphs: bool = True
    progress: bool = True


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise RequestError(f"device {device!r} is not a valid torch device; use 'cpu' or 'cuda'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ResourceError("device='cuda' was requested but CUDA is not available on this machine")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise RequestError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    return dev


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise RequestError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise RequestError(f"dtype {dtype!r} is not supported; use float32, bfloat16 or float16")


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RequestError(f"{name} must be a positive integer, got {value!r}")


def check_fraction(name: str, value: Any, upper_open: bool = True) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0
            or (value >= 1 if upper_open else value > 1)):
        raise RequestError(f"{name} must be a number in [0, 1{')' if upper_open else ']'}, got {value!r}")


def predictor_spec(spec: str, lookahead: int, has_mtp: bool) -> PredictorSpec:
    """Parse and check a predictor against the model (one clear sentence when it cannot work)."""
    check_positive_int("lookahead", lookahead)
    try:
        parsed = PredictorSpec.parse(spec, lookahead)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    if any(n in MTP_PREDICTORS for n in parsed.names) and not has_mtp:
        raise RequestError(f"predictor {spec!r} needs an MTP layer, and this checkpoint has none")
    if parsed.ring > 9:
        raise RequestError(f"lookahead={lookahead} is too far for the oracle: at most 8 steps ahead")
    return parsed


def _load_tokenizer(path: Path):
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise CheckpointError(f"the tokenizer in {path} cannot be loaded by AutoTokenizer: {exc}") from None


def _has_mtp(args: ModelArgs, reader: CheckpointReader) -> bool:
    prefix = f"model.layers.{args.mtp_layer_index}."
    return args.num_nextn_predict_layers > 0 and any(name.startswith(prefix) for name in reader.tensors)


def validate_hot_set(hot_set: Any, layers: list[int], n_experts: int) -> list[ExpertKey]:
    """(layer, expert) pairs, e.g. from a JSON-saved routing profile, checked against the model."""
    keys: list[ExpertKey] = []
    for item in hot_set or []:
        try:
            layer, expert = (int(v) for v in item)
        except (TypeError, ValueError):
            raise RequestError(f"hot_set entries must be (layer, expert) pairs, got {item!r}") from None
        if layer not in layers or not 0 <= expert < n_experts:
            raise RequestError(f"hot_set entry {item!r} names no routed expert of this model (MoE layers {layers})")
        keys.append((layer, expert))
    return keys


def _check_options(policy: str, expert_dtype: str, max_batch_size: Any, prefill_chunk: Any,
                   max_inflight_experts: Any, stream_layers: Any, expert_cache_slots: Any, stream_ahead: Any,
                   min_confidence: Any, prefetch_budget: Any, vram_budget: Any, expert_cache_fraction: Any,
                   max_seq_len: Any, draft_experts: Any = "cached") -> None:
    """Every engine option, checked before anything is read or allocated."""
    if draft_experts not in DRAFT_EXPERTS:
        raise RequestError(f"draft_experts must be one of {', '.join(DRAFT_EXPERTS)}, got {draft_experts!r}")
    if policy not in POLICIES:
        raise RequestError(f"unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if expert_dtype not in EXPERT_DTYPES:
        raise RequestError(f"expert_dtype must be one of {', '.join(EXPERT_DTYPES)}, got {expert_dtype!r}")
    check_positive_int("max_batch_size", max_batch_size)
    check_positive_int("prefill_chunk", prefill_chunk)
    for name, value in (("max_inflight_experts", max_inflight_experts), ("stream_layers", stream_layers),
                        ("expert_cache_slots", expert_cache_slots), ("max_seq_len", max_seq_len)):
        if value is not None:
            check_positive_int(name, value)
    check_positive_int("stream_ahead", stream_ahead)
    check_fraction("min_confidence", min_confidence, upper_open=False)
    if (not isinstance(prefetch_budget, (int, float)) or isinstance(prefetch_budget, bool)
            or not math.isfinite(prefetch_budget) or prefetch_budget < 0):
        raise RequestError(f"prefetch_budget must be a number >= 0 (a multiple of top-k), got {prefetch_budget!r}")
    sizes = [name for name, value in (("expert_cache_slots", expert_cache_slots), ("vram_budget", vram_budget),
                                      ("expert_cache_fraction", expert_cache_fraction)) if value is not None]
    if len(sizes) > 1:
        raise RequestError(f"give one of {' or '.join(sizes)}, not both: each sizes the expert cache")
    if expert_cache_fraction is not None and (
            not isinstance(expert_cache_fraction, (int, float)) or isinstance(expert_cache_fraction, bool)
            or not 0 < expert_cache_fraction <= 1):
        raise RequestError(f"expert_cache_fraction must be a number in (0, 1], got {expert_cache_fraction!r}")


def build_engine(
    cls: type["MoEPrefetchEngine"],
    path: str | Path,
    device: str | torch.device,
    dtype: str | torch.dtype,
    *,
    expert_cache_slots: int | None,
    expert_cache_fraction: float | None,
    vram_budget: str | int | float | None,
    policy: str,
    predictor: str | None,
    lookahead: int,
    prefetch_budget: float,
    max_inflight_experts: int | None,
    min_confidence: float,
    draft_experts: str,
    max_seq_len: int | None,
    max_batch_size: int,
    prefill_chunk: int,
    expert_dtype: str,
    pin_memory: bool,
    hot_set: Sequence[ExpertKey] | None,
    cuda_graphs: bool,
    stream_layers: int | None,
    stream_ahead: int,
    progress: bool,
) -> "MoEPrefetchEngine":
    path = Path(path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    _check_options(policy, expert_dtype, max_batch_size, prefill_chunk, max_inflight_experts, stream_layers,
                   expert_cache_slots, stream_ahead, min_confidence, prefetch_budget, vram_budget,
                   expert_cache_fraction, max_seq_len, draft_experts)
    budget_bytes = parse_bytes(vram_budget) if vram_budget is not None else None

    args = load_model_args(path)
    reader = CheckpointReader(path)
    tokenizer = _load_tokenizer(path)
    has_mtp = _has_mtp(args, reader)
    # measured best recall, precision and hit rate of the predictors (BENCHMARKS.md, experiments/results)
    predictor = predictor or ("mtp+next_layer_gate" if has_mtp else "next_layer_gate")
    predictor_spec(predictor, lookahead, has_mtp)
    seq_len = max_seq_len or min(args.max_position_embeddings, 4096)
    if seq_len > args.max_position_embeddings:
        raise RequestError(
            f"max_seq_len={seq_len} exceeds the model's max_position_embeddings ({args.max_position_embeddings})")
    options = EngineOptions(
        device=dev, dtype=torch_dtype, policy=policy, predictor=predictor, lookahead=lookahead,
        prefetch_budget=float(prefetch_budget), max_inflight_experts=max_inflight_experts, max_seq_len=seq_len,
        max_batch_size=max_batch_size, prefill_chunk=prefill_chunk, expert_dtype=expert_dtype,
        min_confidence=float(min_confidence), draft_experts=draft_experts, cuda_graphs=bool(cuda_graphs), progress=progress)
    block = (args.quant.block_rows, args.quant.block_cols) if args.quant else (128, 128)
    fmt = ExpertFormat.build(args.hidden_size, args.moe_intermediate_size, torch_dtype, expert_dtype, block)
    expert_layers = list(args.moe_layers) + ([args.mtp_layer_index] if has_mtp else [])
    total_experts = len(expert_layers) * args.n_routed_experts
    if expert_cache_fraction is not None:
        expert_cache_slots = max(round(expert_cache_fraction * total_experts), args.num_experts_per_tok)
    plan = plan_engine_memory(args, reader, options, fmt, total_experts, has_mtp, budget_bytes, expert_cache_slots,
                              stream_layers, stream_ahead)
    logger.info(plan.describe())
    for note in plan.notes:
        logger.info(note)

    hot = validate_hot_set(hot_set, expert_layers, args.n_routed_experts)
    if hot and policy != "static":
        raise RequestError("hot_set is only used by policy='static'")
    if not plan.all_resident and len(hot) > plan.expert_slots - args.num_experts_per_tok:
        raise RequestError(
            f"the static hot set ({len(hot)} experts) leaves fewer than top-k ({args.num_experts_per_tok}) of the "
            f"{plan.expert_slots} cache slots free")
    start = time.perf_counter()
    weights, streamer, residency = _load(reader, args, options, plan, fmt, expert_layers, block, hot, pin_memory)
    reader.close()
    logger.info("loaded %s in %.1f s", path, time.perf_counter() - start)
    return cls(path, args, weights, residency, tokenizer, options, plan, streamer)


def _load(reader: CheckpointReader, args: ModelArgs, options: EngineOptions, plan: MemoryPlan, fmt: ExpertFormat,
          expert_layers: list[int], block: tuple[int, int], hot: list[ExpertKey], pin_memory: bool):
    """Weights to the device (or the streaming ring), experts to the host store or the pool, the residency table."""
    dev, torch_dtype, policy, progress = options.device, options.dtype, options.policy, options.progress
    weights = load_model_weights(reader, args, torch_dtype, dev, progress, frozenset(plan.streamed_layers))
    streamer = None
    if plan.streamed_layers:
        streamer = LayerStreamer([weights.layers[i] for i in plan.streamed_layers], dev, plan.stream_ahead,
                                 pin=pin_memory and dev.type == "cuda")
        for i, layer in zip(plan.streamed_layers, streamer.layers):
            weights.layers[i] = layer
    store = None
    if not plan.all_resident:
        store = HostExpertStore(fmt, expert_layers, args.n_routed_experts, pin=pin_memory and dev.type == "cuda")
    residency = Residency(fmt, expert_layers, len(args.moe_layers), args.n_routed_experts, args.num_experts_per_tok,
                          plan.expert_slots, dev, args.hidden_act, store, max_rows=2 * options.max_batch_size,
                          policy=policy, hot_set=hot)
    experts = CheckpointExperts(reader, args, block)

    def pack(layer: int, expert: int, out: torch.Tensor) -> None:
        experts.pack(fmt, layer, expert, out)

    if store is None:
        residency.preload(pack, progress)
    else:
        store.fill(pack, progress)
    return weights, streamer, residency


def plan_engine_memory(
    args: ModelArgs,
    reader: CheckpointReader,
    options: EngineOptions,
    fmt: ExpertFormat,
    total_experts: int,
    has_mtp: bool,
    budget_bytes: int | None,
    slots: int | None,
    stream_layers: int | None = None,
    stream_ahead: int = 2,
) -> MemoryPlan:
    element = torch.tensor([], dtype=options.dtype).element_size()
    layer_bytes: dict[int, int] = {}
    resident = 0
    for name, info in reader.tensors.items():
        if ".mlp.experts." in name or name.endswith("_scale_inv"):
            continue
        numel = math.prod(info.shape)
        nbytes = numel * (4 if ".mlp.gate." in name else element)
        resident += nbytes
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer < args.num_hidden_layers:  # the MTP layer stays resident
                layer_bytes[layer] = layer_bytes.get(layer, 0) + nbytes
    kv = KVCaches.bytes_per_token(args, options.dtype, has_mtp) * options.max_seq_len * options.max_batch_size
    rows = options.max_batch_size * 2
    workspace = (
        rows * args.num_experts_per_tok * max(rows, 16) * (args.moe_intermediate_size * element + args.hidden_size * 4)
        + options.prefill_chunk * options.max_seq_len * args.num_attention_heads * 4 * 2  # prefill scores
        + options.prefill_chunk * args.num_attention_heads * (args.qk_nope_head_dim + args.v_head_dim) * element * 4
        + 2 * fmt.record_bytes  # prefill staging of experts that find no free slot
        + 256 * 1024**2  # allocator slack, logits, small tensors
    )
    return plan_memory(
        resident_bytes=resident,
        layer_bytes=layer_bytes,
        kv_bytes=kv,
        workspace_bytes=workspace if budget_bytes is not None else 0,
        expert_record_bytes=fmt.record_bytes,
        total_experts=total_experts,
        top_k=args.num_experts_per_tok,
        budget_bytes=budget_bytes,
        expert_cache_slots=slots,
        stream_layers=stream_layers,
        stream_ahead=stream_ahead,
    )
