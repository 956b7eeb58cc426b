"""`MoEPrefetchEngine`: load a DeepSeek-V2/V3 checkpoint, plan memory, and generate.

Per decode step: predict -> prefetch -> compute layer by layer (reactive fetch for misses) -> sample -> MTP draft.
Every request is validated before any state changes, so a bad request raises a `RequestError` and the engine serves
the next one normally.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .accounting import Accounting, Stats
from .cache import POLICIES, ExpertKey
from .checkpoint import CheckpointReader
from .config import ModelArgs, load_model_args
from .errors import CheckpointError, RequestError, ResourceError
from .experts import EXPERT_DTYPES, CheckpointExperts, ExpertFormat
from .planner import MemoryPlan, parse_bytes, plan_memory
from .predictors import PredictorContext, Trace, make_predictor, parse_predictor
from .decode import DecodeStep, GraphRunner, MTPStep
from .runner import KVCaches, ModelRunner
from .runtime import ExpertRuntime, prefetch_budget
from .sampling import SamplingParams, sample
from .store import HostExpertStore
from .streaming import LayerStreamer
from .weights import ModelWeights, load_model_weights, weights_nbytes

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
SPECULATIVE_MODES = (None, "mtp")


@dataclass
class TokenEvent:
    """One generated token, as streamed."""

    sequence: int
    token: int
    text: str | None = None  # the text this token adds, when there is a tokenizer


@dataclass
class GenerationResult:
    sequences: list[list[int]]  # generated token ids per prompt (prompt excluded)
    texts: list[str] | None
    stats: Stats
    finish_reasons: list[str] = field(default_factory=list)  # "eos" | "length" | "interrupted"
    interrupted: bool = False


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
    pin_memory: bool
    progress: bool
    cuda_graphs: bool = True


@dataclass
class _Request:
    prompts: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams
    predictor: str
    lookahead: int
    speculative: str | None
    stop_at_eos: bool
    event_log: str | Path | None


def _resolve_device(device: str | torch.device) -> torch.device:
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


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise RequestError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise RequestError(f"dtype {dtype!r} is not supported; use float32, bfloat16 or float16")


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


class MoEPrefetchEngine:
    """A DeepSeek-family MoE model with routed experts in host RAM, a VRAM expert cache and expert prefetching."""

    def __init__(
        self,
        path: Path,
        args: ModelArgs,
        weights: ModelWeights,
        runtime: ExpertRuntime,
        tokenizer: Any,
        options: EngineOptions,
        plan: MemoryPlan,
        streamer: LayerStreamer | None = None,
    ):
        self.path = path
        self.args = args
        self.weights = weights
        self.runtime = runtime
        self.streamer = streamer
        self.runner = ModelRunner(args, weights, runtime, options.device, streamer)
        self.tokenizer = tokenizer
        self.options = options
        self.plan = plan
        self._closed = False
        # streamed layers are copied in by the host between layers, which a CUDA graph cannot contain
        self._graphs = GraphRunner(options.cuda_graphs and options.device.type == "cuda" and streamer is None)
        self._active = False  # a generate/stream/forward call is running (the runtime holds per-call state)
        self._kv: dict[tuple[int, bool], KVCaches] = {}
        self._steps: dict[tuple, DecodeStep | MTPStep] = {}

    # ---- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = torch.float32,
        *,
        expert_cache_slots: int | None = None,
        vram_budget: str | int | float | None = None,
        policy: str = "lru",
        predictor: str | None = None,
        lookahead: int = 1,
        prefetch_budget: float = 1.5,
        max_inflight_experts: int | None = None,
        max_seq_len: int | None = None,
        max_batch_size: int = 8,
        prefill_chunk: int = 512,
        expert_dtype: str = "model",
        pin_memory: bool = True,
        hot_set: Sequence[ExpertKey] | None = None,
        cuda_graphs: bool = True,
        stream_layers: int | None = None,
        stream_ahead: int = 2,
        progress: bool = True,
    ) -> "MoEPrefetchEngine":
        """Load a local Hugging Face checkpoint directory of a DeepSeek-V3/V2 model.

        Without `expert_cache_slots` or `vram_budget` every expert is resident. `expert_cache_slots=N` keeps N
        routed-expert slots (across all layers) in device memory and the experts in (page-locked) host RAM;
        `vram_budget="12GiB"` lets the planner size the slots. `predictor` (default: `mtp+next_layer_gate` when the
        checkpoint has an MTP layer, else `next_layer_gate`), `lookahead` and `policy` are defaults that `generate` may override.
        When the non-expert weights do not fit the budget, the largest layers stream from host RAM `stream_ahead`
        layers ahead of the compute; `stream_layers=N` asks for N streamed layers explicitly.
        """
        path = Path(path)
        dev = _resolve_device(device)
        torch_dtype = _resolve_dtype(dtype)
        if policy not in POLICIES:
            raise RequestError(f"unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if expert_dtype not in EXPERT_DTYPES:
            raise RequestError(f"expert_dtype must be one of {', '.join(EXPERT_DTYPES)}, got {expert_dtype!r}")
        _check_positive_int("lookahead", lookahead)
        _check_positive_int("max_batch_size", max_batch_size)
        _check_positive_int("prefill_chunk", prefill_chunk)
        if max_inflight_experts is not None:
            _check_positive_int("max_inflight_experts", max_inflight_experts)
        _check_positive_int("stream_ahead", stream_ahead)
        if stream_layers is not None:
            _check_positive_int("stream_layers", stream_layers)
        if (
            not isinstance(prefetch_budget, (int, float))
            or isinstance(prefetch_budget, bool)
            or not math.isfinite(prefetch_budget)
            or prefetch_budget < 0
        ):
            raise RequestError(f"prefetch_budget must be a number >= 0 (a multiple of top-k), got {prefetch_budget!r}")
        budget_bytes = parse_bytes(vram_budget) if vram_budget is not None else None

        args = load_model_args(path)
        reader = CheckpointReader(path)
        tokenizer = _load_tokenizer(path)
        has_mtp = _has_mtp(args, reader)
        # measured best recall, precision and hit rate of the predictors (BENCHMARKS.md, experiments/results)
        default_predictor = "mtp+next_layer_gate" if has_mtp else "next_layer_gate"
        predictor = predictor or default_predictor
        _validate_predictor(predictor, has_mtp)
        seq_len = max_seq_len or min(args.max_position_embeddings, 4096)
        _check_positive_int("max_seq_len", seq_len)
        if seq_len > args.max_position_embeddings:
            raise RequestError(
                f"max_seq_len={seq_len} exceeds the model's max_position_embeddings ({args.max_position_embeddings})"
            )
        options = EngineOptions(
            device=dev,
            dtype=torch_dtype,
            policy=policy,
            predictor=predictor,
            lookahead=lookahead,
            prefetch_budget=float(prefetch_budget),
            max_inflight_experts=max_inflight_experts,
            max_seq_len=seq_len,
            max_batch_size=max_batch_size,
            prefill_chunk=prefill_chunk,
            expert_dtype=expert_dtype,
            pin_memory=pin_memory,
            progress=progress,
            cuda_graphs=bool(cuda_graphs),
        )
        block = (args.quant.block_rows, args.quant.block_cols) if args.quant else (128, 128)
        fmt = ExpertFormat.build(args.hidden_size, args.moe_intermediate_size, torch_dtype, expert_dtype, block)
        expert_layers = list(args.moe_layers) + ([args.mtp_layer_index] if has_mtp else [])
        total_experts = len(expert_layers) * args.n_routed_experts
        plan = _plan(args, reader, options, fmt, total_experts, has_mtp, budget_bytes, expert_cache_slots,
                     stream_layers, stream_ahead)
        logger.info(plan.describe())
        for note in plan.notes:
            logger.info(note)

        start = time.perf_counter()
        weights = load_model_weights(reader, args, torch_dtype, dev, progress, frozenset(plan.streamed_layers))
        streamer = None
        if plan.streamed_layers:
            streamer = LayerStreamer([weights.layers[i] for i in plan.streamed_layers], dev, plan.stream_ahead,
                                     pin=pin_memory and dev.type == "cuda")
            for i, layer in zip(plan.streamed_layers, streamer.layers):
                weights.layers[i] = layer
        if has_mtp and weights.mtp is None:
            has_mtp = False
        experts = CheckpointExperts(reader, args, block)
        hot = _validate_hot_set(hot_set, expert_layers, args.n_routed_experts)
        if hot and policy != "static":
            raise RequestError("hot_set is only used by policy='static'")
        if not plan.all_resident and len(hot) > plan.expert_slots - args.num_experts_per_tok:
            raise RequestError(
                f"the static hot set ({len(hot)} experts) leaves fewer than top-k ({args.num_experts_per_tok}) of the "
                f"{plan.expert_slots} cache slots free"
            )
        store = None
        if not plan.all_resident:
            store = HostExpertStore(fmt, expert_layers, args.n_routed_experts, pin=pin_memory and dev.type == "cuda")
        runtime = ExpertRuntime(
            fmt,
            expert_layers,
            args.n_routed_experts,
            args.num_experts_per_tok,
            plan.expert_slots,
            dev,
            args.hidden_act,
            store,
            policy,
            hot,
        )
        def pack(layer: int, expert: int, out: torch.Tensor) -> None:
            experts.pack(fmt, layer, expert, out)

        if store is None:
            runtime.preload(pack, progress)
        else:
            store.fill(pack, progress)
        reader.close()
        logger.info("loaded %s in %.1f s", path, time.perf_counter() - start)
        return cls(path, args, weights, runtime, tokenizer, options, plan, streamer)

    # ---- properties -----------------------------------------------------------------------------------------------
    @property
    def has_mtp(self) -> bool:
        return self.weights.mtp is not None

    @property
    def device(self) -> torch.device:
        return self.options.device

    def memory_stats(self) -> dict[str, Any]:
        stats = dict(self.runtime.memory())
        stats.update(
            {
                "vram_resident_bytes": weights_nbytes(self.weights),
                "kv_cache_reserved_bytes": self.plan.kv_bytes,
                "workspace_reserved_bytes": self.plan.workspace_bytes,
                "vram_budget_bytes": self.plan.budget_bytes,
                "planned_vram_bytes": self.plan.planned_vram_bytes,
                "all_resident": self.plan.all_resident,
                "streamed_layers": list(self.plan.streamed_layers),
                "host_streamed_layer_bytes": self.streamer.host.numel() if self.streamer else 0,
                "total_experts": self.plan.total_experts,
            }
        )
        if self.device.type == "cuda":
            stats["vram_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            stats["vram_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return stats

    @property
    def routing_profile(self) -> dict[ExpertKey, int]:
        """How often each (layer, expert) was needed since the engine was loaded (for the `static` policy)."""
        return dict(self.runtime.use_counts)

    def set_hot_set_from_profile(
        self, share: float = 0.5, profile: dict[ExpertKey, int] | None = None
    ) -> list[ExpertKey]:
        """`static` policy: pin the most-used experts of a routing profile (default: what this engine has routed so
        far) in `share` of the usable cache slots; the rest stays LRU. Returns the hot set."""
        if self.options.policy != "static":
            raise RequestError("a hot set is only used by policy='static'")
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share < 1:
            raise RequestError(f"share must be a number in [0, 1), got {share!r}")
        counts = profile if profile is not None else self.routing_profile
        room = max(self.runtime.n_slots - self.args.num_experts_per_tok * self.options.max_batch_size * 2, 0)
        size = min(int(share * self.runtime.n_slots), room)
        hot = [key for key, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
        self.runtime.cache.policy.hot_set = set(hot)  # type: ignore[union-attr]
        logger.info("static policy: %d experts pinned from a profile of %d", len(hot), len(counts))
        return hot

    def reset_expert_cache(self) -> None:
        """Empty the expert cache (a cold start for the next call); no effect when every expert is resident."""
        self.runtime.reset()

    def close(self) -> None:
        if not self._closed and self.runtime.store is not None:
            self.runtime.store.close()
        if not self._closed and self.streamer is not None:
            self.streamer.close()
        self._closed = True

    def __enter__(self) -> "MoEPrefetchEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- uncached forward -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: Any, return_mtp: bool = False):
        """Main-head logits [B, T, vocab] (fp32) of one full, uncached forward; with `return_mtp`, also the MTP
        logits [B, T-1, vocab], where position i predicts token i+2 from the main hidden state at i and token i+1."""
        ids = self._as_batch_tensor(input_ids)
        if return_mtp and not self.has_mtp:
            raise RequestError("return_mtp=True needs an MTP layer, and this checkpoint has none")
        if return_mtp and ids.shape[1] < 2:
            raise RequestError("return_mtp=True needs at least 2 tokens per row")
        self._check_idle()
        b, t = ids.shape
        positions = torch.arange(t, device=self.device).expand(b, t)
        accounting = Accounting()
        self.runtime.begin_call(accounting, make_predictor("none"), 0, 1, None)
        self._active = True
        try:
            self.runtime.begin_step(0, "prefill")
            hidden = self.runner.forward_block(ids, positions, None, 0, 0)
            logits = self.runner.logits(hidden)
            if not return_mtp:
                return logits
            self.runtime.begin_step(1, "prefill")
            mtp_logits = self.runner.mtp_block(ids[:, 1:], hidden[:, :-1], positions[:, 1:], None, 0, 0)
            return logits, mtp_logits
        except torch.OutOfMemoryError:
            self._abort()
            self._free_cuda()
            raise ResourceError(
                f"the device ran out of memory in a forward of {b} x {t} tokens; use fewer or shorter rows"
            ) from None
        except BaseException:
            self._abort()
            raise
        finally:
            self.runtime.end_call()
            self._active = False

    def _as_batch_tensor(self, input_ids: Any) -> torch.Tensor:
        if isinstance(input_ids, torch.Tensor):
            ids = input_ids
        else:
            try:
                ids = torch.tensor(input_ids)
            except (TypeError, ValueError):
                raise RequestError("input_ids must be a [B, T] tensor or a list of equal-length token-id lists") from None
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
            raise RequestError(f"input_ids must have shape [B, T] with B, T >= 1, got {tuple(ids.shape)}")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise RequestError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        self._check_token_range(ids.flatten().tolist())
        if ids.shape[1] > self.args.max_position_embeddings:
            raise RequestError(
                f"input of {ids.shape[1]} tokens exceeds the model's {self.args.max_position_embeddings} positions"
            )
        return ids.to(device=self.device, dtype=torch.long)

    def _check_token_range(self, tokens: list[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.args.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")

    # ---- generation -----------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        predictor: str | None = None,
        lookahead: int | None = None,
        speculative: str | None = None,
        stop_at_eos: bool = True,
        callback: Callable[[TokenEvent], None] | None = None,
        event_log: str | Path | None = None,
    ) -> GenerationResult:
        """Generate from a string, a list of strings, a list of token ids or a list of token-id lists.

        Greedy when `temperature` is 0. `predictor`/`lookahead` override the engine's defaults for this call;
        `speculative="mtp"` verifies the MTP draft in the same forward (two tokens per forward when accepted).
        `callback` receives each token as it is produced. Ctrl-C returns the tokens produced so far."""
        events = self._generate_events(
            self._request(prompts, max_new_tokens, temperature, top_k, top_p, seed, predictor, lookahead, speculative,
                          stop_at_eos, event_log)
        )
        try:
            while True:
                try:
                    event = next(events)
                except StopIteration as stop:
                    return stop.value
                if callback is None:
                    continue
                try:
                    callback(event)
                except KeyboardInterrupt:
                    # Ctrl-C while the callback ran: hand it to the generation loop, which cleans up and returns the
                    # tokens produced so far
                    try:
                        events.throw(KeyboardInterrupt())
                    except StopIteration as stop:
                        return stop.value
        finally:
            events.close()  # a callback that raised must not leave the call open

    def stream(self, prompts: Any, max_new_tokens: int = 32, **kwargs: Any) -> Iterator[TokenEvent]:
        """Iterate over tokens as they are generated (same arguments as `generate`)."""
        kwargs.pop("callback", None)
        request = self._request(
            prompts,
            max_new_tokens,
            kwargs.pop("temperature", 0.0),
            kwargs.pop("top_k", 0),
            kwargs.pop("top_p", 1.0),
            kwargs.pop("seed", None),
            kwargs.pop("predictor", None),
            kwargs.pop("lookahead", None),
            kwargs.pop("speculative", None),
            kwargs.pop("stop_at_eos", True),
            kwargs.pop("event_log", None),
        )
        if kwargs:
            raise RequestError(f"unknown argument(s) to stream: {', '.join(kwargs)}")
        return self._generate_events(request)

    def _check_idle(self) -> None:
        if self._closed:
            raise RequestError("this engine has been closed")
        if self._active:
            raise RequestError(
                "another generate/stream/forward call is still running on this engine; finish it or close its "
                "stream iterator first"
            )

    def _request(
        self, prompts, max_new_tokens, temperature, top_k, top_p, seed, predictor, lookahead, speculative,
        stop_at_eos, event_log,
    ) -> _Request:
        self._check_idle()
        if event_log is not None:
            parent = Path(event_log).expanduser().resolve().parent
            if not parent.is_dir() or not os.access(parent, os.W_OK):
                raise RequestError(f"event_log {event_log!r} cannot be written: {parent} is not a writable directory")
        token_prompts = self._tokenize(prompts)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise RequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        sampling.validate()
        predictor = predictor if predictor is not None else self.options.predictor
        try:
            parse_predictor(predictor)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        _validate_predictor(predictor, self.has_mtp)
        lookahead = self.options.lookahead if lookahead is None else lookahead
        _check_positive_int("lookahead", lookahead)
        if speculative not in SPECULATIVE_MODES:
            raise RequestError(f"speculative must be None or 'mtp', got {speculative!r}")
        if speculative == "mtp" and not self.has_mtp:
            raise RequestError("speculative='mtp' needs an MTP layer, and this checkpoint has none")
        if len(token_prompts) > self.options.max_batch_size:
            raise RequestError(
                f"{len(token_prompts)} prompts exceed max_batch_size={self.options.max_batch_size} set at load time"
            )
        for i, prompt in enumerate(token_prompts):
            if len(prompt) > self.args.max_position_embeddings:
                raise RequestError(
                    f"prompt {i} has {len(prompt)} tokens, more than the model's {self.args.max_position_embeddings} "
                    f"positions"
                )
            # +2: the decode step writes the shadow/draft row one position ahead, and an accepted draft one more
            needed = len(prompt) + max_new_tokens + 2
            if needed > self.options.max_seq_len:
                raise RequestError(
                    f"prompt {i} ({len(prompt)} tokens) plus max_new_tokens={max_new_tokens} needs {needed} positions, "
                    f"more than max_seq_len={self.options.max_seq_len}"
                )
        return _Request(token_prompts, max_new_tokens, sampling, predictor, lookahead, speculative, stop_at_eos,
                        event_log)

    def _tokenize(self, prompts: Any) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise RequestError("prompts must be a string, a non-empty list of strings or a list of token-id lists")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            prompts = [list(prompts)]
        out: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise RequestError(
                        f"prompt {i} is text but {self.path} has no tokenizer (no tokenizer.json); pass token ids"
                    )
                if not prompt:
                    raise RequestError(f"prompt {i} is empty")
                ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = list(prompt)
            else:
                raise RequestError(f"prompt {i} must be a string or a list of integer token ids")
            if not ids:
                raise RequestError(f"prompt {i} is empty")
            self._check_token_range(ids)
            out.append(ids)
        return out

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _generate_events(self, request: _Request) -> Iterator[TokenEvent]:
        names = parse_predictor(request.predictor)
        trace: Trace = {}
        if "oracle" in names:
            trace, recorded = self._record_trace(request)
            if recorded.interrupted:  # Ctrl-C while recording: its tokens are the ones the call would produce
                return recorded
        result = yield from self._run(request, trace)
        return result

    def _record_trace(self, request: _Request) -> tuple[Trace, GenerationResult]:
        """The oracle's first pass: the same request with reactive fetching, recording the true routing; the cache is
        then put back as it was, so the measured pass starts from the same state as any other predictor."""
        snapshot = self.runtime.snapshot()
        # Keep the MTP head running if the measured pass runs it: its prefill chunks count as steps, and the trace's
        # step numbers must line up with the measured pass. Routing does not depend on the predictor.
        recorder = "mtp_router" if {"mtp", "mtp_router"} & set(parse_predictor(request.predictor)) else "none"
        recording = replace(request, predictor=recorder, event_log=None)
        trace: Trace = {}
        self.runtime.trace = trace
        run = self._run(recording, {})
        try:
            while True:
                next(run)
        except StopIteration as stop:
            recorded: GenerationResult = stop.value
        finally:
            self.runtime.trace = None
        self.runtime.restore(snapshot)
        return trace, recorded

    def _run(self, request: _Request, trace: Trace) -> Iterator[TokenEvent]:
        args, runner, runtime = self.args, self.runner, self.runtime
        batch = len(request.prompts)
        names = parse_predictor(request.predictor)
        predictor = make_predictor(request.predictor)
        uses_mtp = self.has_mtp and (request.speculative == "mtp" or "mtp" in names or "mtp_router" in names)
        speculative = request.speculative == "mtp"
        # with every expert resident a shadow row predicts nothing worth fetching: skip its compute
        shadow = predictor.uses_shadow and not speculative and not runtime.preloaded
        rows_per_step = batch * (2 if speculative else 1)
        working_set = rows_per_step * args.num_experts_per_tok
        if not runtime.preloaded and working_set > runtime.working_set_capacity():
            raise RequestError(
                f"the expert cache ({runtime.working_set_capacity()} usable slots) cannot hold one decode step's "
                f"working set of {working_set} experts ({rows_per_step} rows x top-{args.num_experts_per_tok}); "
                f"use more slots or a smaller batch"
            )
        budget = prefetch_budget(self.options.prefetch_budget, args.num_experts_per_tok, rows_per_step)
        width = max(args.num_experts_per_tok, math.ceil(self.options.prefetch_budget * args.num_experts_per_tok))
        part_width = width if len(names) == 1 else args.num_experts_per_tok  # CombinedPredictor narrows each part
        gate_targets = _gate_targets(list(args.moe_layers), request.lookahead) if "next_layer_gate" in names else {}
        router_width = part_width if "mtp_router" in names else 0
        predictor.reset(PredictorContext(list(args.moe_layers), args.num_experts_per_tok, width, request.lookahead, trace))
        accounting = Accounting(keep_events=request.event_log is not None)
        stats = accounting.stats
        stats.predictor, stats.lookahead, stats.policy = request.predictor, request.lookahead, self.options.policy
        stats.cache_slots, stats.expert_bytes, stats.speculative = runtime.n_slots, runtime.expert_bytes, speculative
        stats.prompt_tokens = sum(len(p) for p in request.prompts)
        stats.extra["sequences"] = batch
        inflight = self.options.max_inflight_experts or max(2 * args.num_experts_per_tok * rows_per_step, 4)
        runtime.begin_call(accounting, predictor, budget, inflight, runner.score_layer)
        self._active = True

        stream_bytes_before = self.streamer.bytes_copied if self.streamer is not None else 0
        generated: list[list[int]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        texts_so_far = [""] * batch
        interrupted = False
        step = 0
        try:
            caches = self._caches(batch, uses_mtp)
            sync = self._sync
            t0 = time.perf_counter()
            hidden_last = torch.empty(batch, args.hidden_size, dtype=self.options.dtype, device=self.device)
            prefill_hidden: list[torch.Tensor] = []
            first_logits = []
            for b, prompt in enumerate(request.prompts):
                hidden_b, step = self._prefill(caches, b, prompt, step)
                prefill_hidden.append(hidden_b)
                hidden_last[b] = hidden_b[-1]
                first_logits.append(runner.logits(hidden_b[-1:]))
            positions = [len(p) for p in request.prompts]
            first = sample(torch.cat(first_logits), request.sampling, list(range(batch)), positions).tolist()
            drafts = None
            if uses_mtp:
                drafts, step = self._mtp_prefill(caches, request.prompts, prefill_hidden, first, step)
            sync()
            stats.prefill_seconds = time.perf_counter() - t0
            stats.prefill_stall_seconds = runtime.transfer.collect_stall_seconds()
            del prefill_hidden

            active = torch.ones(batch, dtype=torch.bool)
            for b in range(batch):
                generated[b].append(first[b])
                done = self._finished(b, first[b], generated, request)
                if done:
                    active[b] = False
                    finish[b] = "eos" if first[b] in args.eos_token_ids else "length"
                yield self._token_event(b, first[b], generated, texts_so_far, final=done)
            pos = torch.tensor(positions, dtype=torch.long)  # position of each sequence's next input token
            t1 = time.perf_counter()
            while bool(active.any()):
                runtime.begin_step(step, "decode")
                tokens_in = torch.tensor([g[-1] for g in generated])
                extra = torch.tensor(drafts)[:, None] if (speculative or shadow) else None
                mode = "verify" if speculative else ("shadow" if shadow else "none")
                out = self._decode_step(caches, batch, 1 if extra is not None else 0, mode, gate_targets,
                                        part_width)(tokens_in, pos.clone(), active, extra)
                next_tok = sample(out.logits, request.sampling, list(range(batch)), (pos + 1).tolist()).tolist()
                new_tokens: list[list[int]] = [[] for _ in range(batch)]
                accepted = [False] * batch
                second = None
                if speculative:
                    second = sample(out.draft_logits, request.sampling, list(range(batch)), (pos + 2).tolist()).tolist()
                for b in range(batch):
                    if not active[b]:
                        continue
                    if drafts is not None:
                        stats.mtp_drafts_checked += 1
                        stats.mtp_drafts_correct += int(drafts[b] == next_tok[b])
                    new_tokens[b].append(next_tok[b])
                    if speculative:
                        stats.draft_proposed += 1
                        if drafts[b] == next_tok[b] and not self._would_finish(b, next_tok[b], generated, request):
                            stats.draft_accepted += 1
                            accepted[b] = True
                            new_tokens[b].append(second[b])
                if uses_mtp:
                    drafts = self._draft(caches, out, pos, next_tok, second, accepted, active, drafts, speculative,
                                         router_width)
                stats.decode_steps += 1
                step += 1
                for b in range(batch):
                    for token in new_tokens[b]:
                        if not active[b]:
                            break
                        generated[b].append(token)
                        pos[b] += 1
                        done = self._finished(b, token, generated, request)
                        if done:
                            active[b] = False
                            finish[b] = "eos" if token in args.eos_token_ids and request.stop_at_eos else "length"
                        yield self._token_event(b, token, generated, texts_so_far, final=done)
            sync()
            stats.decode_seconds = time.perf_counter() - t1
        except KeyboardInterrupt:
            interrupted = True
            self._abort()
            finish = ["interrupted" if f == "length" and len(g) < request.max_new_tokens else f
                      for f, g in zip(finish, generated)]
            logger.warning("generation interrupted; returning the %d tokens produced so far", sum(map(len, generated)))
        except torch.OutOfMemoryError:
            self._abort()
            self._free_cuda()
            raise ResourceError(
                f"the device ran out of memory during generation (batch {batch}, max_seq_len "
                f"{self.options.max_seq_len}); lower the batch, max_seq_len or the expert cache size"
            ) from None
        except BaseException:
            self._abort()
            raise
        finally:
            self._active = False
            stats.decode_stall_seconds = runtime.end_call()
            stats.stall_seconds = stats.prefill_stall_seconds + stats.decode_stall_seconds
            if self.streamer is not None:
                stats.extra["layer_stream_bytes"] = self.streamer.bytes_copied - stream_bytes_before
                stats.extra["layer_stream_stall_seconds"] = self.streamer.transfer.collect_stall_seconds()
        stats.generated_tokens = sum(len(g) for g in generated)
        stats.extra.update(stats.main_layer_prediction(set(args.moe_layers)))
        stats.extra["main_moe_layers"] = list(args.moe_layers)
        if request.event_log is not None:
            try:
                accounting.write_jsonl(request.event_log)
            except OSError as exc:  # the tokens matter more than the log
                logger.error("could not write the event log %s: %s", request.event_log, exc)
        texts = [self._decode_text(g) for g in generated] if self.tokenizer is not None else None
        return GenerationResult(generated, texts, stats, finish, interrupted)

    # ---- generation pieces ----------------------------------------------------------------------------------------
    def _prefill(self, caches: KVCaches, row: int, prompt: list[int], step: int) -> tuple[torch.Tensor, int]:
        """Prefill one prompt in chunks into cache row `row`; returns (final hidden [T, H], next step number)."""
        tokens = torch.tensor(prompt, device=self.device)[None]
        hidden = []
        chunk = self.options.prefill_chunk
        for start in range(0, len(prompt), chunk):
            self.runtime.begin_step(step, "prefill")
            piece = tokens[:, start : start + chunk]
            positions = torch.arange(start, start + piece.shape[1], device=self.device)[None]
            hidden.append(self.runner.forward_block(piece, positions, caches, row, start)[0])
            step += 1
        return torch.cat(hidden), step

    def _mtp_prefill(
        self, caches: KVCaches, prompts: list[list[int]], hidden: list[torch.Tensor], first: list[int], step: int
    ) -> tuple[list[int], int]:
        """Run the MTP layer over every (hidden at i, token i+1) pair of each prompt; returns the first drafts."""
        drafts = []
        chunk = self.options.prefill_chunk
        for b, prompt in enumerate(prompts):
            nxt = torch.tensor(prompt[1:] + [first[b]], device=self.device)[None]
            logits = None
            for start in range(0, nxt.shape[1], chunk):
                self.runtime.begin_step(step, "prefill")
                piece = nxt[:, start : start + chunk]
                positions = torch.arange(start + 1, start + 1 + piece.shape[1], device=self.device)[None]
                h = hidden[b][start : start + piece.shape[1]][None]
                logits = self.runner.mtp_block(piece, h, positions, caches.mtp, b, start)
                step += 1
            drafts.append(int(logits[0, -1].argmax()))
        return drafts, step

    def _caches(self, batch: int, with_mtp: bool) -> KVCaches:
        """KV caches kept across calls (captured graphs point at them); only the latest batch size is kept."""
        key = (batch, with_mtp)
        if key not in self._kv:
            self._kv.clear()
            self._steps.clear()
            self._graphs.clear()
            self._kv[key] = KVCaches.allocate(
                self.args, batch, self.options.max_seq_len, self.options.dtype, self.device, with_mtp
            )
        caches = self._kv[key]
        # Start every call from a clean cache: masked entries are multiplied by exact zeros, which must not meet
        # anything a previous call (a shadow row, an interrupted step) may have left there.
        for kv in caches.layers + ([caches.mtp] if caches.mtp is not None else []):
            kv.latent.zero_()
            kv.rope.zero_()
        return caches

    def _decode_step(
        self, caches: KVCaches, batch: int, extra: int, mode: str, gate_targets: dict[int, list[int]], width: int
    ) -> DecodeStep:
        key = ("decode", batch, extra, mode, tuple(sorted((k, tuple(v)) for k, v in gate_targets.items())), width)
        if key not in self._steps:
            self._steps[key] = DecodeStep(self.runner, caches, batch, extra, mode, self._graphs, gate_targets, width)
        return self._steps[key]  # type: ignore[return-value]

    def _mtp_step(self, caches: KVCaches, batch: int, rows: int, router_width: int) -> MTPStep:
        key = ("mtp", batch, rows, router_width)
        if key not in self._steps:
            self._steps[key] = MTPStep(self.runner, caches, batch, rows, self._graphs, router_width)
        return self._steps[key]  # type: ignore[return-value]

    def _draft(self, caches, out, pos, next_tok, second, accepted, active, drafts, speculative,
               router_width: int) -> list[int]:
        """Draft the token after the next input: MTP over (H_q, t_{q+1}) [and (H_{q+1}, t_{q+2}) when verifying]."""
        b = len(next_tok)
        if speculative:
            toks = torch.tensor([[next_tok[i], second[i]] for i in range(b)])
            hid = torch.stack((out.hidden, out.draft_hidden), dim=1)
            positions = pos[:, None] + torch.arange(1, 3)
        else:
            toks = torch.tensor(next_tok)[:, None]
            hid = out.hidden[:, None]
            positions = pos[:, None] + 1
        logits = self._mtp_step(caches, b, toks.shape[1], router_width)(toks, hid, positions, active)
        choice = logits.argmax(-1).tolist()  # [B, M]
        new = list(drafts)
        for i in range(b):
            if active[i]:
                new[i] = choice[i][1] if accepted[i] else choice[i][0]
        return new

    def _finished(self, b: int, token: int, generated: list[list[int]], request: _Request) -> bool:
        return (request.stop_at_eos and token in self.args.eos_token_ids) or len(generated[b]) >= request.max_new_tokens

    def _would_finish(self, b: int, token: int, generated: list[list[int]], request: _Request) -> bool:
        """Whether appending `token` ends sequence b (then a verified second token must not be used)."""
        return (request.stop_at_eos and token in self.args.eos_token_ids) or len(generated[b]) + 1 >= request.max_new_tokens

    def _token_event(
        self, b: int, token: int, generated: list[list[int]], texts: list[str], final: bool = False
    ) -> TokenEvent:
        """The text a token adds. A token can end inside a multi-byte character (decoded as U+FFFD until the rest
        arrives), so such text is held back until it is complete or the sequence ends."""
        piece = None
        if self.tokenizer is not None:
            text = self._decode_text(generated[b])
            if text.endswith("\ufffd") and not final:
                return TokenEvent(b, token, "")
            common = 0
            for a, c in zip(text, texts[b]):
                if a != c:
                    break
                common += 1
            piece = text[common:]
            texts[b] = text
        return TokenEvent(b, token, piece)

    def _abort(self) -> None:
        self.runtime.abort()
        if self.streamer is not None:
            self.streamer.abort()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _free_cuda(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _validate_hot_set(hot_set: Any, layers: list[int], n_experts: int) -> list[ExpertKey]:
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


def _gate_targets(moe_layers: list[int], depth: int) -> dict[int, list[int]]:
    """next_layer_gate: MoE layer -> the next `depth` MoE layers whose routers look at its router input."""
    return {layer: moe_layers[i + 1 : i + 1 + depth] for i, layer in enumerate(moe_layers)}


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RequestError(f"{name} must be a positive integer, got {value!r}")


def _validate_predictor(spec: str, has_mtp: bool) -> None:
    try:
        names = parse_predictor(spec)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    if ("mtp" in names or "mtp_router" in names) and not has_mtp:
        raise RequestError(f"predictor {spec!r} needs an MTP layer, and this checkpoint has none")


def _plan(
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
        numel = 1
        for d in info.shape:
            numel *= d
        nbytes = numel * (4 if ".mlp.gate." in name else element)
        resident += nbytes
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer < args.num_hidden_layers:  # the MTP layer stays resident
                layer_bytes[layer] = layer_bytes.get(layer, 0) + nbytes
    kv = KVCaches.bytes_per_token(args, options.dtype, has_mtp) * options.max_seq_len * options.max_batch_size
    rows = options.max_batch_size * 2
    workspace = (
        2 * rows * args.num_experts_per_tok * fmt.record_bytes  # gathered expert weights of one decode layer
        + options.prefill_chunk * options.max_seq_len * args.num_attention_heads * 4 * 2  # prefill scores
        + options.prefill_chunk * args.num_attention_heads * (args.qk_nope_head_dim + args.v_head_dim) * element * 4
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
