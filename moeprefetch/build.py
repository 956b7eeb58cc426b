"""Building an engine: validate the options, read config and checkpoint, plan memory, load, and wire the parts.

Everything a user can get wrong is checked here before anything large is allocated, and reported as one sentence.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .checkpoint import CheckpointReader
from .config import ModelArgs, load_model_args
from .errors import CheckpointError, RequestError, ResourceError
from .expert_records import INT4_GROUP_SIZE, INT4_SCALE_DTYPE, CheckpointExperts, ExpertFormat
from .int4_checkpoints import Int4Tensors, present_int4_weights
from .learned_predictor import HeadConfig, load_predictor
from .kernels import kernels_usable
from .kernels.attention import MLADecode
from .kernels.gqa_attention import GQADecode
from .kernels.grouped import grouped_mm_usable
from .memory_plan import MemoryPlan, parse_bytes, plan_memory
from .options import EngineConfig, check_positive_int
from .predictors import LOOKAHEAD_READERS, MTP_PREDICTORS, PredictorSpec, default_lookahead
from .residency import Residency, prefill_staging_rows
from .runner import KVCaches
from .distributed import ProcessGroup, local_device
from .placement import ExpertPlacement
from .store import HostExpertStore, check_host_ram
from .streaming import LayerStreamer
from .model import router_shape
from .traces import ForcedRouting
from .weights import load_model_weights, resident_bytes

if TYPE_CHECKING:
    from .engine import MoEPrefetchEngine

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
ExpertKey = tuple[int, int]


@dataclass(frozen=True)
class ResolvedConfig:
    """`EngineConfig` resolved against the checkpoint (built only by `resolve_options`, so no defaults here)."""

    device: torch.device
    dtype: torch.dtype
    policy: str
    lrfu_halflife: float
    predictor: str
    lookahead: int
    prefetch_budget: float | None  # None: the call's predictor decides (`session.prefetch_settings`)
    max_inflight_experts: int | None
    max_seq_len: int
    max_batch_size: int
    prefill_chunk: int
    prefill_window: int  # prompt tokens whose chunks run each layer together (an expert crosses once per window)
    expert_dtype: str
    min_confidence: float
    fill_confidence: float  # predictions below it only protect (fills cost link bytes, protection none)
    fill_link: str  # shared | idle (fills for later layers yield the link to a layer's host reads)
    reuse_weight: float | None  # predictor='learned': how much its reuse probabilities weigh in the victims' order
    bypass: bool | None  # predictor='learned': misses less likely needed soon than their victims are not admitted
    routing_trace: str | None  # benchmarks: decode routing forced from this trace file
    spare_recent: int
    prefetch_lead: int  # MoE layers: a fill is reserved at most this far before its need (0: no limit)
    draft_experts: str
    verify_confidence: float  # speculative='mtp': drafts below it are not verified (their experts not read)
    draft_tokens: int  # speculative='mtp': chained drafts a verify step checks
    # rows a step may compute per sequence beside its real row: the shadow row or the drafts (max(draft_tokens, 1)),
    # none without an MTP layer
    extra_rows: int
    verify_rows: str  # separate | shared: a step's extra rows as batches of their own, or one batch with the real rows
    late_prefetch: str
    cuda_graphs: bool
    fused_kernels: bool
    progress: bool

    @property
    def rows_per_sequence(self) -> int:
        """Rows a decode step computes per sequence at most: its real row and a shadow row or its draft rows."""
        return 1 + self.extra_rows

    @property
    def max_step_rows(self) -> int:
        """Rows a decode step computes at most: every sequence's real row and its shadow or draft rows."""
        return self.rows_per_sequence * self.max_batch_size


def optional_float(value: float | None) -> float | None:
    """An option whose None means "the call decides" (`session.prefetch_settings`)."""
    return None if value is None else float(value)


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


def predictor_spec(spec: str, lookahead: int, has_mtp: bool, learned: HeadConfig | None = None,
                   moe_layers: int | None = None) -> PredictorSpec:
    """Parse and check a predictor against the model (its MTP layer, its `moe_layers` MoE layers) and the engine's
    learned head, if any (one clear sentence when it cannot work)."""
    check_positive_int("lookahead", lookahead)
    try:
        parsed = PredictorSpec.parse(spec, lookahead)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    if any(n in MTP_PREDICTORS for n in parsed.names) and not has_mtp:
        raise RequestError(f"predictor {spec!r} needs an MTP layer, and this checkpoint has none")
    if parsed.learned:
        if learned is None:
            raise RequestError("predictor 'learned' needs a trained routing head: load the engine with "
                               "predictor_path= (moeprefetch train-predictor writes one)")
        if lookahead > learned.leads:
            raise RequestError(f"lookahead={lookahead} reaches further than the learned head's {learned.leads} "
                               f"token{'s' if learned.leads > 1 else ''} ahead")
        if learned.use_mtp and not has_mtp:
            raise RequestError("the learned head reads the MTP head's output, and this checkpoint has none")
        parsed = dataclasses.replace(parsed, learned_mtp=learned.use_mtp)
    if parsed.ring > 9:
        raise RequestError(f"lookahead={lookahead} is too far: predictions reach at most 8 steps ahead")
    # the gate alone reads lookahead as MoE layers ahead, which a model's depth bounds (from its first MoE layer,
    # moe_layers - 1 already reach every later one; in a combination another component reads it as tokens or steps
    # ahead, and the gate looks as far as the layers go)
    readers = [n for n in parsed.names if n in LOOKAHEAD_READERS]
    if readers == ["next_layer_gate"] and moe_layers is not None and lookahead > max(moe_layers - 1, 1):
        raise RequestError(f"lookahead={lookahead} is too far for next_layer_gate, which predicts that many MoE "
                           f"layers ahead: this model has {moe_layers}, so at most {max(moe_layers - 1, 1)}")
    return parsed


# a one-token prompt and one new token, and the two positions the decode step writes beyond them (requests.py)
MIN_SEQ_LEN = 4


def has_tokenizer(path: Path) -> bool:
    """Whether a checkpoint directory ships a tokenizer (else prompts must be token ids)."""
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def _load_tokenizer(path: Path):
    if not has_tokenizer(path):
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


def validate_routing_profile(profile: Any, layers: list[int], n_experts: int) -> dict[ExpertKey, int]:
    """A routing profile ({(layer, expert): uses}, as `routing_profile` gives one), checked against the model."""
    if not isinstance(profile, Mapping):
        raise RequestError(f"profile must be a dict of (layer, expert) pairs to use counts, got "
                           f"{type(profile).__name__}")
    keys = validate_hot_set(list(profile), layers, n_experts)
    counts = {}
    for key, item in zip(keys, profile.items()):
        count = item[1]
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise RequestError(f"profile counts must be non-negative integers, got {count!r} for {item[0]!r}")
        counts[key] = counts.get(key, 0) + int(count)
    return counts


def hot_set_room(slots: int, top_k: int) -> int:
    """How many experts a static hot set may pin: all but top-k slots, so a row's experts can always be admitted
    (a step of more rows reads what finds no unpinned slot in place: the same tokens, bytes not kept)."""
    return max(slots - top_k, 0)


def note_step_working_set(pinned: int, slots: int, top_k: int, step_rows: int) -> None:
    """Pins that leave fewer unpinned slots than a full decode step's experts of one layer (top-k per row it may
    compute) make such steps read some experts in place: said once, where the hot set is set."""
    if pinned and slots - pinned < top_k * step_rows:
        logger.info("static policy: %d pinned experts leave %d of %d slots for steps of up to %d rows (top-%d "
                    "each); a fuller step reads some experts in place (the same tokens)", pinned, slots - pinned,
                    slots, step_rows, top_k)


def build_engine(cls: type["MoEPrefetchEngine"], path: str | Path, config: EngineConfig) -> "MoEPrefetchEngine":
    config.check()
    path = Path(path).expanduser()
    device = config.device
    if config.distributed and str(device) == "cuda":  # each rank takes cuda:LOCAL_RANK
        device = local_device(torch.device("cuda"))
    dev, torch_dtype = resolve_device(device), resolve_dtype(config.dtype)
    group = ProcessGroup.join(dev) if config.distributed else None
    return _build(cls, path, config, dev, torch_dtype, group)


def _build(cls: type["MoEPrefetchEngine"], path: Path, config: EngineConfig, dev: torch.device,
           torch_dtype: torch.dtype, group: ProcessGroup | None) -> "MoEPrefetchEngine":
    budget_bytes = parse_bytes(config.vram_budget) if config.vram_budget is not None else None
    args = load_model_args(path)
    config = resolve_expert_format(config, args)
    reader = CheckpointReader(path)
    int4 = present_int4_weights(reader, args.int4) if args.int4 is not None else None
    tokenizer = _load_tokenizer(path)
    has_mtp = _has_mtp(args, reader)
    if not args.moe_layers and not has_mtp:
        reader.close()
        raise CheckpointError(f"{path} has no MoE layer (all {args.num_hidden_layers} layers are dense): moeprefetch "
                              f"runs Mixture-of-Experts models, and a dense model has no experts to offload")
    # before the weights load: a head of another checkpoint is one sentence, at once
    head = load_predictor(config.predictor_path, path) if config.predictor_path is not None else None
    options = resolve_options(config, args, has_mtp, dev, torch_dtype, head.config if head is not None else None)
    block = (args.quant.block_rows, args.quant.block_cols) if args.quant else (128, 128)
    try:
        # a 4-bit checkpoint's scales keep their own dtype (verbatim); quantised on load, fp16
        fmt = ExpertFormat.build(args.hidden_size, args.moe_intermediate_size, torch_dtype, config.expert_dtype, block,
                                 group_size=config.int4_group_size, symmetric=config.int4_symmetric,
                                 scale_dtype=int4.scale_dtype() if int4 is not None else INT4_SCALE_DTYPE)
    except ValueError as exc:  # e.g. int4 with an odd hidden size
        raise RequestError(str(exc)) from None
    if fmt.quantized:
        logger.info("routed experts as %s: %.2f MB a record (%.2f MB of it scales)", fmt.describe(),
                    fmt.record_bytes / 1e6, fmt.scale_bytes / 1e6)
    expert_layers = list(args.moe_layers) + ([args.mtp_layer_index] if has_mtp else [])
    placement = None
    if group is not None:
        # rank 0's placement for everyone: a profile (or anything else) that differs per rank must not split them
        owner = group.agree(ExpertPlacement.build(expert_layers, args.n_routed_experts, group.world, 0,
                                                  config.placement_profile).owner if group.rank == 0 else None)
        placement = ExpertPlacement(group.rank, group.world, owner)
    # this rank's experts (every expert in one process): what the cache, the host store and the plan are sized by
    total_experts = len(expert_layers) * (placement.local if placement is not None else args.n_routed_experts)
    slots = config.expert_cache_slots
    if config.expert_cache_fraction is not None:
        slots = max(round(config.expert_cache_fraction * total_experts), args.num_experts_per_tok)
    try:
        options, plan, staging = fit_prefill_window(args, reader, options, fmt, total_experts, has_mtp, budget_bytes,
                                                    slots, config.stream_layers, config.stream_ahead,
                                                    window_given=config.prefill_window is not None)
    except RequestError as exc:
        if budget_bytes is None or slots is not None:
            raise
        # the budget is too small: name the working space's share that the user can shrink
        element = torch.tensor([], dtype=options.dtype).element_size()
        window = options.prefill_window if config.prefill_window is not None else options.prefill_chunk
        chunk_bytes = prefill_workspace_bytes(args, options.prefill_chunk, options.max_seq_len, dev, element,
                                              window, grouped_mm_usable(fmt, dev))
        tried = (f"prefill_window={window}" if config.prefill_window is not None
                 else "a window of one chunk, the smallest tried")
        # the chunk is worth shrinking only where it is a real share of the working space beside the fixed slack
        advice = "a shorter prefill_chunk needs less" if chunk_bytes >= WORKSPACE_SLACK_BYTES / 4 else \
            "a shorter chunk would save little: give a larger vram_budget"
        raise RequestError(f"{exc}; of the working space, {WORKSPACE_SLACK_BYTES / 1024**3:.2f} GiB is a fixed "
                           f"allowance (allocator slack, logits) and prefill_chunk={options.prefill_chunk} with "
                           f"{tried} takes {chunk_bytes / 1024**3:.2f} GiB: {advice}") from None
    logger.info(plan.describe())
    for note in plan.notes:
        logger.info(note)
    for warning in plan.warnings:
        logger.warning(warning)
    if group is not None:  # what decides the number and shapes of the collectives must be the same on every rank
        # verify_confidence decides how many tokens a verify step keeps, so how many steps (and collectives) run;
        # draft_experts="auto" agrees on each call's choice (a collective the other ranks must make too)
        group.check_same("the model, the memory plan, the step shapes and the drafts verified", (
            args.model_type, args.num_hidden_layers, args.n_routed_experts, has_mtp, plan.all_resident,
            options.max_seq_len, options.max_batch_size, options.prefill_chunk, options.prefill_window,
            options.dtype, options.expert_dtype, options.cuda_graphs, str(dev.type), options.verify_confidence,
            options.draft_experts, options.draft_tokens, options.verify_rows))

    hot = validate_hot_set(config.hot_set, expert_layers, args.n_routed_experts)
    if hot and config.policy != "static":
        raise RequestError("hot_set is only used by policy='static'")
    # each rank pins its own
    pinned = [key for key in hot if placement is None or placement.owns(expert_layers.index(key[0]), key[1])]
    if not plan.all_resident and len(pinned) > hot_set_room(plan.expert_slots, args.num_experts_per_tok):
        raise RequestError(
            f"the static hot set ({len(pinned)} experts) leaves fewer than top-k ({args.num_experts_per_tok}) of the "
            f"{plan.expert_slots} cache slots free")
    if not plan.all_resident:
        note_step_working_set(len(pinned), plan.expert_slots, args.num_experts_per_tok, options.max_step_rows)
    forced = None
    if options.routing_trace is not None:  # before the weights load: a wrong trace is one sentence, at once
        forced = ForcedRouting.load(options.routing_trace, len(args.moe_layers), args.n_routed_experts,
                                    args.num_experts_per_tok, router_shape(args), dev)
    start = time.perf_counter()
    weights, streamer, residency = _load(reader, args, options, plan, fmt, expert_layers, block, hot,
                                         config.pin_memory, staging, placement, group, int4)
    reader.close()
    if int4 is not None:
        int4.reader.close()
    logger.info("loaded %s in %.1f s", path, time.perf_counter() - start)
    engine = cls(path, args, weights, residency, tokenizer, options, plan, streamer, forced)
    if head is not None:
        # no autograd: the head's outputs go into the table's tensors, which would otherwise grow a graph every step
        engine.runner.learned_head = head.to(device=dev, dtype=torch_dtype).eval().requires_grad_(False)
    return engine


def resolve_expert_format(config: EngineConfig, args: ModelArgs) -> EngineConfig:
    """The expert format's options made concrete: a 4-bit checkpoint keeps its experts 4-bit, in its own groups
    (verbatim), unless the options say otherwise; any other checkpoint's experts default to the compute dtype."""
    checkpoint = args.int4
    expert_dtype = config.expert_dtype or ("int4" if checkpoint is not None else "model")
    given = [name for name in ("int4_group_size", "int4_symmetric") if getattr(config, name) is not None]
    if given and expert_dtype != "int4":  # an option that would shape nothing is a mistake the user should hear of
        names = " and ".join(given)
        raise RequestError(f"{names} {'shapes' if len(given) == 1 else 'shape'} int4 experts, but this engine's "
                           f"experts are {expert_dtype}: add expert_dtype='int4' or leave {names} out")
    group = config.int4_group_size
    if group is None:  # per-channel checkpoints (group 0) have no single group size: the default one
        group = checkpoint.group_size if checkpoint is not None and checkpoint.group_size > 0 else INT4_GROUP_SIZE
        # experts narrower than the default group (small models) take one group a row, as wide as their widest
        group = min(group, max(args.hidden_size, args.moe_intermediate_size))
    symmetric = config.int4_symmetric
    if symmetric is None:
        symmetric = checkpoint.symmetric if checkpoint is not None else False
    return dataclasses.replace(config, expert_dtype=expert_dtype, int4_group_size=group, int4_symmetric=symmetric)


def resolve_options(config: EngineConfig, args: ModelArgs, has_mtp: bool, device: torch.device,
                    dtype: torch.dtype, learned: HeadConfig | None = None) -> ResolvedConfig:
    """The options as the engine uses them, resolved against the checkpoint."""
    # reactive fetching by default: on the H200 no real predictor has yet been faster than it offloaded (the deep
    # model with learned routing, ref17, V2-Lite; BENCHMARKS "Prediction that pays"); predictors are chosen per call
    predictor = config.predictor if config.predictor is not None else "none"
    predictor_spec(predictor, config.lookahead if config.predictor else default_lookahead(predictor, config.lookahead),
                   has_mtp, learned, len(args.moe_layers))
    seq_len = config.max_seq_len or min(args.max_position_embeddings, 4096)
    if seq_len < MIN_SEQ_LEN:
        raise RequestError(f"max_seq_len={seq_len} cannot hold a one-token prompt and one new token: the decode step "
                           f"needs {MIN_SEQ_LEN} positions")
    if seq_len > args.max_position_embeddings:
        raise RequestError(
            f"max_seq_len={seq_len} exceeds the model's max_position_embeddings ({args.max_position_embeddings})")
    chunk = config.prefill_chunk or auto_prefill_chunk(seq_len, device)
    # a decode step with all-reduces is not captured: capturing NCCL collectives in the step's graph is untested
    graphs = bool(config.cuda_graphs) and not (config.distributed and device.type == "cuda")
    # without an MTP layer a step has no draft or shadow rows: its kernels are shaped for the real rows alone
    # (steps of up to 4 sequences stay on the GEMV path; a 16-row step reads host memory with 16-row tiles, not 32),
    # and shared rows would only compute padding
    verify_rows = config.verify_rows if has_mtp else "separate"
    if verify_rows != config.verify_rows:
        logger.info("verify_rows=%r: this checkpoint has no MTP layer, so its steps have no extra rows; computing "
                    "the real rows alone", config.verify_rows)
    return ResolvedConfig(
        device=device, dtype=dtype, policy=config.policy, lrfu_halflife=float(config.lrfu_halflife),
        predictor=predictor, lookahead=config.lookahead,
        prefetch_budget=optional_float(config.prefetch_budget), max_inflight_experts=config.max_inflight_experts,
        max_seq_len=seq_len, max_batch_size=config.max_batch_size,
        prefill_chunk=chunk, prefill_window=auto_prefill_window(seq_len, chunk, device, config.prefill_window),
        expert_dtype=config.expert_dtype, min_confidence=float(config.min_confidence),
        fill_confidence=float(config.fill_confidence), fill_link=config.fill_link,
        reuse_weight=optional_float(config.reuse_weight), bypass=config.bypass,  # checked: True/False/None
        routing_trace=str(config.routing_trace) if config.routing_trace is not None else None,
        spare_recent=config.spare_recent, prefetch_lead=config.prefetch_lead,
        draft_experts=config.draft_experts, verify_confidence=float(config.verify_confidence),
        draft_tokens=config.draft_tokens, extra_rows=max(config.draft_tokens, 1) if has_mtp else 0,
        verify_rows=verify_rows,
        late_prefetch=config.late_prefetch, cuda_graphs=graphs,
        fused_kernels=bool(config.fused_kernels), progress=bool(config.progress))


def _load(reader: CheckpointReader, args: ModelArgs, options: ResolvedConfig, plan: MemoryPlan, fmt: ExpertFormat,
          expert_layers: list[int], block: tuple[int, int], hot: list[ExpertKey], pin_memory: bool, staging_rows: int,
          placement: ExpertPlacement | None, group: ProcessGroup | None, int4: Int4Tensors | None = None):
    """Weights to the device (or the streaming ring), experts to the host store or the pool, the residency table."""
    dev, torch_dtype, policy, progress = options.device, options.dtype, options.policy, options.progress
    weights = load_model_weights(reader, args, torch_dtype, dev, progress, frozenset(plan.streamed_layers),
                                 host_embedding=plan.host_embedding and dev.type == "cuda")
    streamer = None
    if plan.streamed_layers:
        streamer = LayerStreamer([weights.layers[i] for i in plan.streamed_layers], dev, plan.stream_ahead,
                                 pin=pin_memory and dev.type == "cuda")
        for i, layer in zip(plan.streamed_layers, streamer.layers):
            weights.layers[i] = layer
    experts = CheckpointExperts(reader, args, block, int4)

    position = {layer: i for i, layer in enumerate(expert_layers)}
    n_experts = placement.local if placement is not None else args.n_routed_experts

    def pack(layer: int, expert: int, out: torch.Tensor) -> None:
        """The record of (layer, expert) as the table numbers it: a rank's local expert, or zeros for padding."""
        if placement is not None:
            expert = placement.global_expert(position[layer], expert)
            if expert < 0:
                out.zero_()
                return
        experts.pack(fmt, layer, expert, out)

    store = None
    if not plan.all_resident:  # filled (and page-locked) first: whether it is pinned decides the residency's kernels
        store = HostExpertStore(fmt, expert_layers, n_experts, pin=pin_memory and dev.type == "cuda")
        store.fill(pack, progress)
    residency = Residency(fmt, expert_layers, len(args.moe_layers), n_experts, args.num_experts_per_tok,
                          plan.expert_slots, dev, args.hidden_act, store, max_rows=options.max_step_rows,
                          policy=policy, frequency_halflife=options.lrfu_halflife, hot_set=hot, stage_rows=staging_rows,
                          placement=placement, group=group, prefill_chunk=options.prefill_chunk)
    if store is None:
        residency.preload(pack, progress)
    return weights, streamer, residency


PREFILL_CHUNK_CUDA = 2048  # prompt tokens per prefill chunk by default on CUDA (BENCHMARKS.md, "Prefill")
PREFILL_CHUNK_CPU = 512  # the CPU's math attention holds [h, T, S] scores: shorter chunks


def auto_prefill_chunk(seq_len: int, device: torch.device) -> int:
    """Prompt tokens per prefill chunk when none is given. Every expert a chunk touches crosses the link once per
    chunk, so offloaded prefill of long prompts moves fewer bytes with longer chunks (measured on the H200: an
    8,192-token prompt in chunks of 512, 2,048 and 8,192 moved 12.5x, 3.3x and 1x the bytes it touches), and resident
    prefill ran 2.3x faster at 2,048 than at 512; but a chunk's activations come out of the VRAM budget (the plan
    counts them), and the chunk must not depend on the budget: prefill's bits depend on how a prompt is cut, and a
    cache size never changes tokens."""
    return min(seq_len, PREFILL_CHUNK_CUDA if device.type == "cuda" else PREFILL_CHUNK_CPU)


WORKSPACE_SLACK_BYTES = 256 * 1024**2  # every plan's working space holds this beside its counted parts: allocator
# slack, logits, small tensors
PREFILL_WINDOW_CUDA = 8192  # prompt tokens whose chunks run each layer together, by default on CUDA
PREFILL_WINDOW_CPU = 2048


def auto_prefill_window(seq_len: int, chunk: int, device: torch.device, given: int | None = None) -> int:
    """Prompt tokens per prefill window (`given`, or the device's default, within the context): whole chunks, at least
    one. A window's chunks run layer by layer together, so an offloaded expert that several of them use crosses the
    link once per window, not once per chunk; its cost is per-token state (a few hidden-size vectors per token,
    counted by `prefill_workspace_bytes`). It does not change bits (each chunk's kernels keep their shapes), so a
    tight budget may shrink it (`fit_prefill_window`)."""
    window = min(seq_len, given or (PREFILL_WINDOW_CUDA if device.type == "cuda" else PREFILL_WINDOW_CPU))
    return max(window // chunk, 1) * chunk


def prefill_workspace_bytes(args: ModelArgs, chunk: int, seq_len: int, device: torch.device, element: int,
                            window: int | None = None, grouped_mm: bool = False) -> int:
    """Activations of one prefill chunk of T tokens against a cache of S = max_seq_len: the attention's keys and values
    expanded over S (and on the CPU, whose attention is the math kernel, the mask and the [h, T, S] scores), the
    chunk's queries and output; then the larger of a MoE layer (the routed experts' T x top-k pair buffers:
    intermediate, fp32 output and its reordered copy; plus the shared experts) and a dense layer's MLP; plus the hidden
    states; plus the per-token state of a window of `window` tokens (`auto_prefill_window`)."""
    t, s, h = chunk, seq_len, args.num_attention_heads
    n, r, v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    attention = (s * h * (n + v) * element  # kv_b_proj's expansion [S, h, n+v]
                 + s * h * (n + r + v) * element  # the keys [S, h, n+r] and the values [S, h, v] as SDPA reads them
                 + t * h * (2 * (n + r) + v) * element)  # queries (and their parts) and output
    if device.type != "cuda":
        attention += t * s * (h * 4 * 2 + 1)  # the mask, scores and their softmax
    pairs = t * args.num_experts_per_tok
    # gathered inputs, gate/up, intermediate and outputs per pair (the larger of the two grouped paths), and the
    # combine's fp32 products
    routed = (pairs * ((2 * args.hidden_size + 3 * args.moe_intermediate_size) * element + 2 * args.hidden_size * 4)
              + t * args.hidden_size * 4)
    shared = t * args.moe_intermediate_size * args.n_shared_experts * element * 3
    dense = t * args.intermediate_size * element * 3
    per_chunk = attention + max(routed + shared, dense) + t * args.hidden_size * (element + 4) * 4
    # a window's per-token state: residual (the layer's input and output), normed input, routed output (fp32) and
    # shared output per token, and each chunk's routed products held while the staged batches run (as bf16
    # products, or fp32 outputs and intermediates)
    k, hid = args.num_experts_per_tok, args.hidden_size
    per_pair = hid * element if grouped_mm else hid * 4 + args.moe_intermediate_size * element
    return per_chunk + (window or chunk) * (hid * (4 * element + 4) + k * (per_pair + 12))


def fit_prefill_window(args: ModelArgs, reader: CheckpointReader, options: ResolvedConfig, fmt: ExpertFormat,
                       total_experts: int, has_mtp: bool, budget_bytes: int | None, slots: int | None,
                       stream_layers: int | None, stream_ahead: int, window_given: bool
                       ) -> tuple[ResolvedConfig, MemoryPlan, int]:
    """The memory plan, with the largest prefill window (the default, halved down to one chunk) that a budget holds
    without streaming layers; if every window needs streaming, the largest of those that stream the fewest bytes (a
    streamed layer costs link time on every decode token, while a window only saves prefill's expert copies). A
    window never changes bits (`auto_prefill_window`), so unlike the chunk it may follow the budget. A window the
    user gave is kept."""
    windows = [options.prefill_window]
    while not window_given and budget_bytes is not None and windows[-1] > options.prefill_chunk:
        windows.append(max((windows[-1] // 2) // options.prefill_chunk, 1) * options.prefill_chunk)
    fitting: list[tuple[ResolvedConfig, MemoryPlan, int]] = []
    error: RequestError | None = None
    for window in windows:
        candidate = dataclasses.replace(options, prefill_window=window)
        try:
            plan, staging = plan_engine_memory(args, reader, candidate, fmt, total_experts, has_mtp, budget_bytes,
                                               slots, stream_layers, stream_ahead)
        except RequestError as exc:
            error = exc
            continue
        fitting.append((candidate, plan, staging))
        if not plan.streamed_layers or stream_layers:
            break
    if not fitting:
        assert error is not None
        raise error
    chosen = min(fitting, key=lambda f: (f[1].streamed_bytes, -f[0].prefill_window))
    if chosen[0].prefill_window != options.prefill_window:
        chosen[1].notes.append(f"prefill_window {options.prefill_window} -> {chosen[0].prefill_window} tokens to fit "
                               "the budget")
    return chosen


def plan_engine_memory(
    args: ModelArgs,
    reader: CheckpointReader,
    options: ResolvedConfig,
    fmt: ExpertFormat,
    total_experts: int,
    has_mtp: bool,
    budget_bytes: int | None,
    slots: int | None,
    stream_layers: int | None = None,
    stream_ahead: int = 2,
) -> tuple[MemoryPlan, int]:
    """The VRAM plan, and prefill's staging rows: sized from the room a budget leaves beside the resident weights and
    the KV cache (`prefill_staging_rows`), before the workspace and the expert cache take the rest."""
    element = torch.tensor([], dtype=options.dtype).element_size()
    resident, layer_bytes = resident_bytes(reader, args, element)
    kv = KVCaches.bytes_per_token(args, options.dtype, has_mtp) * options.max_seq_len * options.max_batch_size
    room = max(budget_bytes - resident - kv, 0) if budget_bytes is not None else None
    per_layer = total_experts // max(len(args.moe_layers) + int(has_mtp), 1)  # a rank's own, when distributed
    staging_rows = prefill_staging_rows(fmt.record_bytes, per_layer, room)
    rows = options.max_step_rows
    step_workspace = rows * args.num_experts_per_tok * max(rows, 16) * (args.moe_intermediate_size * element
                                                                        + args.hidden_size * 4)
    if options.device.type == "cpu":  # the CPU's caches live in host RAM: one sentence, not the allocator's abort
        check_host_ram(kv + step_workspace, f"the KV cache of max_batch_size={options.max_batch_size} x "
                                            f"max_seq_len={options.max_seq_len} and a decode step's workspace")
    workspace = (
        step_workspace
        + prefill_workspace_bytes(args, options.prefill_chunk, options.max_seq_len, options.device, element,
                                  options.prefill_window, grouped_mm_usable(fmt, options.device))
        + staging_rows * fmt.record_bytes  # prefill's staging rows
        + WORKSPACE_SLACK_BYTES
    )
    if options.fused_kernels and kernels_usable(options.device.type):  # the fused attention's split partials
        workspace += MLADecode.scratch_bytes(args.num_attention_heads, args.kv_lora_rank, options.max_seq_len, rows) \
            if args.attention == "mla" else \
            GQADecode.scratch_bytes(args.num_attention_heads, args.qk_head_dim, options.max_seq_len, rows)
    plan = plan_memory(
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
        embed_bytes=0 if tied_embedding(args, reader) else args.vocab_size * args.hidden_size * element,
    )
    return plan, staging_rows


def tied_embedding(args: ModelArgs, reader: CheckpointReader) -> bool:
    """The LM head is the embedding table (so the table must stay in VRAM)."""
    return bool(args.tie_word_embeddings) and "lm_head.weight" not in reader.tensors
