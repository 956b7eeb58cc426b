"""`MoEPrefetchEngine`, the front door: `from_pretrained`, `generate`, `stream`, `forward`, `close`.

Building lives in `build.py`, one call's loop in `session.py`, a decode step in `decode.py` and the experts' residency
in `residency/`. Every request is validated before any state changes, so a bad request raises a `RequestError` and
the engine serves the next one normally.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from .checkpoint import REFERENCE_MODEL
from .build import (ResolvedConfig, build_engine, hot_set_room, note_step_working_set,
                    validate_routing_profile)
from .options import EngineConfig, check_fraction
from .config import ModelArgs
from .decode import DecodeStep, StepShape
from .errors import RequestError, ResourceError
from .memory_plan import MemoryPlan
from .predictors import PredictorSpec
from .residency import Residency
from .runner import FusedDecodeShape, KVCaches, ModelRunner
from .sampling import DeviceSampler
from .requests import as_batch_tensor, build_request, speculation_unavailable, unused_learned_options
from .session import GenerationResult, Request, Session, TokenEvent
from .speculation import AutoDraftExperts, AutoSpeculation, Decision
from .streaming import LayerStreamer
from .traces import ForcedRouting
from .weights import ModelWeights, weights_nbytes

logger = logging.getLogger(__name__)

# generate's keyword-only sampling arguments that `stream` passes through by name
SAMPLING_EXTRAS = ("logit_bias", "presence_penalty", "frequency_penalty", "logprobs")

ExpertKey = tuple[int, int]
__all__ = ["MoEPrefetchEngine", "GenerationResult", "TokenEvent", "EngineConfig", "ResolvedConfig"]


class MoEPrefetchEngine:
    """A DeepSeek-family MoE model with routed experts in host RAM, a VRAM expert cache and expert prefetching."""

    def __init__(self, path: Path | None = None, args: ModelArgs | None = None, weights: ModelWeights | None = None,
                 residency: Residency | None = None, tokenizer: Any = None, options: ResolvedConfig | None = None,
                 plan: MemoryPlan | None = None, streamer: LayerStreamer | None = None,
                 forced_routing: ForcedRouting | None = None, **unknown: Any):
        if unknown or args is None or weights is None or residency is None or options is None or plan is None:
            # the parts come from from_pretrained: a user's MoEPrefetchEngine("model/") gets the way to load one
            raise RequestError("an engine is loaded with MoEPrefetchEngine.from_pretrained(path, **options) (no path: "
                               "the bundled reference model), not built directly")
        self.path = path
        self.args = args
        self.weights = weights
        self.residency = residency
        self.streamer = streamer
        self.runner = ModelRunner(args, weights, residency, options.device, streamer,
                                  fused_decode=FusedDecodeShape(options.max_seq_len, options.max_step_rows)
                                  if options.fused_kernels else None, forced_routing=forced_routing)
        self.sampler = DeviceSampler(args.vocab_size, options.device, options.max_batch_size)
        self.tokenizer = tokenizer
        self.options = options
        # the rows per sequence every decode step's kernels are sized and shaped for (1 + the most drafts a verify
        # step may chain), fixed at load: options changed later never reshape a step
        self.rows_per_sequence = options.rows_per_sequence
        self.plan = plan
        self._closed = False
        self._active = False  # a generate/stream/forward call is running
        self._kv: dict[int, KVCaches] = {}  # by batch size
        self._steps: dict[tuple, DecodeStep] = {}
        self._trace: torch.Tensor | None = None
        self._speculation = AutoSpeculation()  # `speculative="auto"`: this engine's measurements of both modes
        self._draft_modes = AutoDraftExperts()  # `draft_experts="auto"`: the same for the MTP head's experts
        self._noted: set[str] = set()  # what calls have already logged about this engine's options (once each)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, *, config: EngineConfig | None = None,
                        **options: Any) -> "MoEPrefetchEngine":
        """Load a local Hugging Face checkpoint directory of a DeepSeek-V3/V2 model (or of another supported
        family; no path: the reference model bundled with the package, as the CLI's default).

        `options` are the fields of `EngineConfig` (its defaults apply; `config=` gives a whole one, which `device`,
        `dtype` and `options` then override). Without `expert_cache_slots`, `expert_cache_fraction` or
        `vram_budget` every expert is resident. `expert_cache_slots=N` keeps N routed-expert slots (across all layers)
        in device memory and the experts in page-locked host RAM; `expert_cache_fraction=0.25` sizes them as a share
        of all routed experts; `vram_budget="12GiB"` lets the planner size the slots. `predictor` (default:
        `none`: reactive fetching, the fastest measured offloaded), `lookahead`,
        `min_confidence` are defaults that `generate` may override; `policy` (lru, lrfu, lfu or static) applies from
        the next call when `options` change. `prefetch_budget` caps fills per (step, layer) at that multiple of
        top-k per row (default 1.5; 0, protection only, for `predictor="learned"` alone, whose `reuse_weight` and
        `bypass` also default to 0.7 and on: `session.prefetch_settings`), `max_inflight_experts` the fills in flight.
        `draft_experts="cached"` lets the MTP head draft with the experts already in VRAM (drafts change speed, never
        tokens); `"all"` reads every expert it routes to, from host when missing; `"auto"` runs whichever this
        engine measured faster per token (`speculation.py`). When the non-expert weights do not
        fit the budget, the largest layers stream from host RAM `stream_ahead` layers ahead of the compute;
        `stream_layers=N` asks for N streamed layers explicitly.
        """
        if path is None:
            path = REFERENCE_MODEL
        if not isinstance(path, (str, Path)):
            raise RequestError(f"path must be a checkpoint directory (a str or Path), got {path!r}")
        if isinstance(config, Mapping):
            config = EngineConfig.from_mapping(config)
        elif config is not None and not isinstance(config, EngineConfig):
            raise RequestError(f"config must be an EngineConfig or a mapping of its options, got "
                               f"{type(config).__name__}")
        given = dict(options)
        if device is not None:
            given["device"] = device
        if dtype is not None:
            given["dtype"] = dtype
        return build_engine(cls, path, (config or EngineConfig()).updated(given))

    # ---- properties -----------------------------------------------------------------------------------------------
    @property
    def has_mtp(self) -> bool:
        return self.weights.mtp is not None

    @property
    def device(self) -> torch.device:
        return self.options.device

    def memory_stats(self) -> dict[str, Any]:
        self._check_open()
        stats = dict(self.residency.memory())
        stats.update({
            "vram_resident_bytes": self._resident_weight_bytes(),
            "kv_cache_reserved_bytes": self.plan.kv_bytes,
            "workspace_reserved_bytes": self.plan.workspace_bytes,
            "vram_budget_bytes": self.plan.budget_bytes,
            "planned_vram_bytes": self.plan.planned_vram_bytes,
            "all_resident": self.plan.all_resident,
            "streamed_layers": list(self.plan.streamed_layers),
            "host_streamed_layer_bytes": self.streamer.host.numel() if self.streamer else 0,
            "host_embedding_bytes": self.runner.host_embed.nbytes if self.runner.host_embed else 0,
            # the VRAM ring the streamed layers pass through (part of vram_resident_bytes)
            "stream_ring_slots": self.streamer.ring_size if self.streamer else 0,
            "stream_ring_bytes": self.streamer.ring_bytes if self.streamer else 0,
            "total_experts": self.plan.total_experts,  # this rank's, with distributed=True
        })
        group = self.residency.group
        if group is not None:
            stats.update({"rank": group.rank, "world_size": group.world,
                          "local_experts_per_layer": self.residency.n_experts})
        if self.device.type == "cuda":
            stats["vram_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            stats["vram_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return stats

    def _resident_weight_bytes(self) -> int:
        """Non-expert weights in VRAM: streamed layers count once, as the ring they share."""
        total = weights_nbytes(self.weights)
        if self.runner.host_embed is not None:
            total -= self.runner.host_embed.nbytes
        if self.streamer is not None:
            total += self.streamer.ring_bytes + self.streamer.kept_bytes - sum(weights_nbytes(self.weights.layers[i])
                                                   for i in self.plan.streamed_layers)
        return total

    @property
    def routing_profile(self) -> dict[ExpertKey, int]:
        """How often each (layer, expert) was needed since the engine was loaded (for the `static` policy)."""
        self._check_open()
        res = self.residency
        if res.group is not None:  # every rank's experts (one all-reduce: every rank must ask)
            counts = torch.zeros(len(res.layers), self.args.n_routed_experts, dtype=torch.int64, device=self.device)
            local = res.st.use_count.view(len(res.layers), res.n_experts).long()
            owned = res.local_of >= 0  # [P, E]
            counts[owned] = local.gather(1, res.local_of.clamp(min=0))[owned]
            res.group.all_reduce_(counts)
            return {(res.layers[p], e): c for (p, e), c in zip(torch.nonzero(counts).tolist(),
                                                               counts[counts > 0].tolist())}
        counts = res.st.use_count.tolist()
        return {res.global_key(k): c for k, c in enumerate(counts) if c}

    def set_hot_set_from_profile(self, share: float = 0.5,
                                 profile: Mapping[ExpertKey, int] | None = None) -> list[ExpertKey]:
        """`static` policy: pin the most-used experts of a routing profile (default: what this engine has routed so
        far) in `share` of the cache slots, leaving at least top-k unpinned; the rest stays LRU. Returns the hot
        set."""
        self._check_open()
        if self.options.policy != "static":
            raise RequestError("a hot set is only used by policy='static'")
        check_fraction("share", share)
        res, top_k = self.residency, self.args.num_experts_per_tok
        if profile is None:
            counts = self.routing_profile
        else:
            counts = validate_routing_profile(profile, list(res.layers), self.args.n_routed_experts)
        if res.placement is not None:  # each rank pins the hottest of its own experts
            counts = {key: c for key, c in counts.items() if res.owns(*key)}
        wanted, room = int(share * res.n_slots), hot_set_room(res.n_slots, top_k)
        if wanted and not room:
            raise RequestError(f"the expert cache's {res.n_slots} slots leave no room for a hot set: a row's top-k "
                               f"({top_k}) must stay unpinned; load with more slots")
        if wanted > room:
            logger.warning("static policy: %d of the %d experts asked for fit beside top-k unpinned slots", room,
                           wanted)
        hot = [key for key, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: min(wanted, room)]]
        note_step_working_set(len(hot), res.n_slots, top_k, self.options.max_step_rows)
        res.set_hot_set(hot)
        logger.info("static policy: %d experts pinned from a profile of %d", len(hot), len(counts))
        return hot

    def reset_expert_cache(self, forget_routing: bool = False) -> None:
        """Empty the expert cache (a cold start for the next call); no effect when every expert is resident. The
        routing history that the lfu and lrfu policies rank by (and `routing_profile` reports) is kept unless
        `forget_routing`."""
        self.check_idle()
        self.residency.reset(forget_routing)

    # ---- resources ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free device memory (weights, KV caches, graphs, the expert pool) and unpin host memory, now."""
        if self._closed:
            return
        if self._active:  # from a callback, or with a stream suspended: that call ends here (it raises if resumed)
            logger.warning("close() during a generate/stream call: the call is abandoned")
            self._abort_call()
        self._closed = True
        for step in self._steps.values():
            step.release()
        self._steps.clear()
        self._kv.clear()
        self._trace = None
        if self.options.device.type == "cuda":
            torch.cuda.synchronize(self.options.device)  # nothing may still read what is unpinned below
        self.residency.close()  # a process group stays joined (distributed.py)
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        if self.runner.host_embed is not None:
            self.runner.host_embed.close()
        self.weights = None  # type: ignore[assignment]
        self.runner = None  # type: ignore[assignment]
        self.sampler = None  # type: ignore[assignment]
        self.residency = None  # type: ignore[assignment]
        if self.options.device.type == "cuda":
            torch.cuda.synchronize(self.options.device)
            torch.cuda.empty_cache()

    def __enter__(self) -> "MoEPrefetchEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RequestError("this engine has been closed; load a new one with MoEPrefetchEngine.from_pretrained")

    def check_idle(self) -> None:
        """One `RequestError` sentence when the engine is closed or a call is still running on it (every call, and
        whoever drives the runner directly, asks first)."""
        self._check_open()
        if self._active:
            raise RequestError("another generate/stream/forward call is still running on this engine; finish it or "
                               "close its stream iterator first")

    # ---- uncached forward -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: Any, return_mtp: bool = False):
        """Main-head logits [B, T, vocab] (fp32) of one full, uncached forward; with `return_mtp`, also the MTP
        logits [B, T-1, vocab], where position i predicts token i+2 from the main hidden state at i and token i+1."""
        self.check_idle()
        ids = as_batch_tensor(input_ids, self.args, self.device)
        if return_mtp and not self.has_mtp:
            raise RequestError("return_mtp=True needs an MTP layer, and this checkpoint has none")
        if return_mtp and ids.shape[1] < 2:
            raise RequestError("return_mtp=True needs at least 2 tokens per row")
        b, t = ids.shape
        positions = torch.arange(t, device=self.device).expand(b, t)
        res = self.residency
        res.configure(policy=self.options.policy, frequency_halflife=self.options.lrfu_halflife)
        res.begin_call()
        self._active = True
        try:
            res.begin_step(decode=False)
            hidden = self.runner.forward_block(ids, positions, None, 0, 0)
            logits = self.runner.logits(hidden)
            if not return_mtp:
                return logits
            res.begin_step(decode=False)
            return logits, self.runner.mtp_block(ids[:, 1:], hidden[:, :-1], positions[:, 1:], None, 0, 0)
        except torch.OutOfMemoryError:
            self._abort_call()
            raise ResourceError(
                f"the device ran out of memory in a forward of {b} x {t} tokens; use fewer or shorter rows") from None
        except BaseException:
            self._abort_call()
            raise
        finally:
            if self._active:
                res.end_call()
            self._active = False

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
        min_confidence: float | None = None,
        logit_bias: dict[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: int | None = None,
    ) -> GenerationResult:
        """Generate from a string, a list of strings, a list of token ids or a list of token-id lists.

        Greedy when `temperature` is 0. `predictor`/`lookahead`/`min_confidence` override the engine's defaults for
        this call;
        `speculative="mtp"` verifies the MTP draft in the same forward (two tokens per forward when accepted);
        `speculative="auto"` turns it on for a call when this engine's own measurements say it is faster
        (`speculation.py`; the decision is in the statistics as `speculative_auto`).
        `logit_bias` ({token id: bias in [-100, 100]}) and `presence_penalty` / `frequency_penalty` (in [-2, 2],
        counting this call's generated tokens) change the logits every token is chosen from, greedy included;
        `logprobs=n` (0 to 20) returns each token's log-probability under the model with the n most likely
        alternatives (`GenerationResult.logprobs`, `TokenEvent.logprob`).
        `callback` receives each token as it is produced. Ctrl-C returns the tokens produced so far."""
        request = self.new_request(prompts, max_new_tokens, temperature, top_k, top_p, seed, predictor, lookahead,
                                   speculative, stop_at_eos, event_log, min_confidence, logit_bias=logit_bias,
                                   presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                   logprobs=logprobs)
        if callback is not None and not callable(callback):
            raise RequestError(f"callback must be a function of one TokenEvent, got {type(callback).__name__}")
        events = self._events(request, want_text=callback is not None)
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
        """Iterate over tokens as they are generated (same arguments as `generate`, without `callback`)."""
        if "callback" in kwargs:
            raise RequestError("stream takes no callback: iterate over the events it returns (generate takes one)")
        names = ("temperature", "top_k", "top_p", "seed", "predictor", "lookahead", "speculative", "stop_at_eos",
                 "event_log", "min_confidence")
        defaults = (0.0, 0, 1.0, None, None, None, None, True, None, None)
        values = [kwargs.pop(name, default) for name, default in zip(names, defaults)]
        adjustments = {name: kwargs.pop(name) for name in SAMPLING_EXTRAS if name in kwargs}
        if kwargs:
            raise RequestError(f"unknown argument(s) to stream: {', '.join(kwargs)}")
        return self._streamed(self._events(self.new_request(prompts, max_new_tokens, *values, **adjustments)))

    @staticmethod
    def _streamed(events: Iterator[TokenEvent]) -> Iterator[TokenEvent]:
        """A stream's events. Ctrl-C while the engine computes ends the call cleanly, as in `generate`, and then
        reaches the consumer as KeyboardInterrupt: a stream has no result to mark interrupted, and its loop must not
        end as if the generation had finished."""
        result = yield from events
        if result is not None and result.interrupted:
            raise KeyboardInterrupt
        return result

    def new_request(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, predictor, lookahead,
                    speculative, stop_at_eos, event_log, min_confidence=None, *, logit_bias=None,
                    presence_penalty=0.0, frequency_penalty=0.0, logprobs=None, resolve_auto=True) -> Request:
        """A validated request of this engine (what `generate` and `stream` build; continuous batches and
        analyses build theirs here too). Bad input raises `RequestError` and changes nothing. `resolve_auto=False`
        leaves "auto" choices alone (a continuous batch checks requests it runs its own way)."""
        self.check_idle()
        request = build_request(self.args, self.tokenizer, self.options, self.path, self.has_mtp, prompts,
                                max_new_tokens, temperature, top_k, top_p, seed, predictor, lookahead, speculative,
                                stop_at_eos, event_log, min_confidence, self.runner.learned_config, logit_bias,
                                presence_penalty, frequency_penalty, logprobs)
        self._note_unused_learned_options(request)
        self._note_static_without_hot_set()
        if request.speculative == "auto" and resolve_auto:
            request = self._auto_speculation(request)
        if self.options.draft_experts == "auto" and resolve_auto:
            request = self._auto_draft_experts(request)
        group = self.residency.group
        if group is not None and seed is None:  # every rank samples with rank 0's seed, or their tokens part
            request = replace(request, sampling=replace(request.sampling, seed=group.agree(request.sampling.seed)))
        if group is not None and (request.speculation is not None or request.draft_choice is not None):
            # an auto choice decides the step's shape (and so its collectives): every rank runs rank 0's, whose
            # timings may have come out on the other side of a close call
            agreed = group.agree((request.speculative, request.speculation, request.draft_experts,
                                  request.draft_choice, request.draft_tokens))
            request = replace(request, speculative=agreed[0], speculation=agreed[1], draft_experts=agreed[2],
                              draft_choice=agreed[3], draft_tokens=agreed[4])
        return request

    def _note_unused_learned_options(self, request: Request) -> None:
        """A call whose predictor leaves the engine's bypass / reuse_weight without effect says so, once per
        predictor (comparing predictors on one engine is a normal use: not an error)."""
        unused = unused_learned_options(self.options, request.predictor)
        key = "+".join(request.predictor.names)
        if unused is not None and key not in self._noted:
            self._noted.add(key)
            logger.warning("%s: calls with it decode without them (use predictor='learned')", unused)

    def _note_static_without_hot_set(self) -> None:
        """policy='static' pins a hot set and runs LRU over the rest: before one is pinned it is LRU alone, which
        a call says (once per engine)."""
        res = self.residency
        if self.options.policy != "static" or res.store is None or res.hot_set_size:
            return
        if "static" not in self._noted:
            self._noted.add("static")
            logger.warning("policy='static' has no hot set yet: calls evict as LRU until one is pinned (hot_set= at "
                           "load, or engine.set_hot_set_from_profile() after calls that profile the routing)")

    def _auto_speculation(self, request: Request) -> Request:
        """`speculative="auto"` resolved for this call: on or off, with the reason."""
        why = speculation_unavailable(self.has_mtp, self.options.routing_trace, request.predictor, request.sampling)
        unavailable = why.reason if why is not None else None
        key = (len(request.prompts), "+".join(request.predictor.names), request.sampling.temperature == 0)
        decision = self._speculation.choose(key, unavailable, chains=self.options.draft_tokens)
        return replace(request, speculative="mtp" if decision.mode == "mtp" else None, speculation=decision,
                       draft_tokens=decision.draft_tokens)

    def _auto_draft_experts(self, request: Request) -> Request:
        """`draft_experts="auto"` resolved for this call: the MTP head's routed experts from VRAM only or read
        wherever they are, whichever this engine measured faster in this configuration."""
        drafts = self.has_mtp and (request.speculative == "mtp" or request.predictor.needs_mtp)
        inapplicable = ("no MTP head runs in this call" if not drafts else
                        "every expert is in VRAM" if self.residency.preloaded else None)
        key = (len(request.prompts), "+".join(request.predictor.names), request.sampling.temperature == 0,
               request.speculative)
        decision = self._draft_modes.choose(key, inapplicable)
        return replace(request, draft_experts=decision.mode, draft_choice=decision)

    def decode_text(self, ids: list[int]) -> str:
        """Generated ids as text, special tokens skipped (needs a tokenizer)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _events(self, request: Request, want_text: bool = True) -> Iterator[TokenEvent]:
        """The call as a generator of token events that returns the `GenerationResult`."""
        # asked again when the call starts (its first next()), not only when it was made: a stream made earlier
        # may meet a closed engine, or another stream already running on the same caches
        self.check_idle()
        trace = None
        if request.predictor.oracle:
            trace, recorded = self._record_trace(request)
            if recorded.interrupted:  # Ctrl-C while recording: its tokens are the ones the call would produce
                return recorded
        known = set(self._steps)
        result = yield from self.run_session(Session(self, request, trace=trace, want_text=want_text))
        warm = set(self._steps) <= known  # no new decode graph was captured: the call's time measures decoding
        if request.speculation is not None:
            self._report_speculation(request.speculation, result, warm)
        if request.draft_choice is not None:
            measured = not result.interrupted and self._draft_modes.record(request.draft_choice, result.stats, warm)
            result.stats.extra["draft_experts_auto"] = {**request.draft_choice.as_dict(), "measured": measured}
        return result

    def _report_speculation(self, decision: Decision, result: GenerationResult, warm: bool) -> None:
        """An auto call's measurement folded into the estimates, and the decision into its statistics."""
        measured = not result.interrupted and self._speculation.record(decision, result.stats, warm)
        result.stats.extra["speculative_auto"] = {**decision.as_dict(), "measured": measured}

    def _record_trace(self, request: Request) -> tuple[torch.Tensor, GenerationResult]:
        """The oracle's first pass: the same request with reactive fetching, recording the true routing on the
        device; the cache is then put back as it was, so the measured pass starts from the same state."""
        snapshot = self.residency.snapshot()
        recording = replace(request, predictor=PredictorSpec(("none",)), event_log=None)
        run = self.run_session(Session(self, recording, record=True))
        try:
            while True:
                next(run)
        except StopIteration as stop:
            recorded: GenerationResult = stop.value
        self.residency.restore(snapshot)
        return self.trace_buffer(), recorded

    def run_session(self, session: Session) -> Iterator[TokenEvent]:
        """Run a session to its end as a generator of its token events, returning its `GenerationResult`; Ctrl-C
        returns the tokens so far, running out of device memory raises `ResourceError`, and the engine stays
        usable either way. A call abandoned by `close()` (from a callback, or with its stream suspended) raises one
        sentence if it is resumed."""
        self.check_idle()
        self._active = True
        run = session.run()
        try:
            while True:
                try:
                    event = next(run)
                except StopIteration as stop:
                    return stop.value
                yield event
                if self._closed:  # close() while this call waited on its consumer
                    raise RequestError("this engine was closed during the call; load a new one with "
                                       "MoEPrefetchEngine.from_pretrained")
        except BaseException as exc:
            if self._closed:  # abandoned by close(): nothing of it is left to settle
                raise
            session.abort()
            # Ctrl-C returns the tokens so far, unless the ranks stopped at different layers (no partial result)
            if isinstance(exc, KeyboardInterrupt) and self.residency.group is None:
                logger.warning("generation interrupted; returning the %d tokens produced so far",
                               sum(map(len, session.generated)))
                return session.result(interrupted=True)
            if isinstance(exc, torch.OutOfMemoryError):
                self._free_cuda()
                raise ResourceError(
                    f"the device ran out of memory during generation (batch {session.batch}, max_seq_len "
                    f"{self.options.max_seq_len}); lower the batch, max_seq_len or the expert cache size") from None
            raise
        finally:
            run.close()
            self._active = False

    # ---- what sessions use (`session.SessionEngine`) ---------------------------------------------------------------
    def kv_caches(self, batch: int) -> KVCaches:
        """KV caches kept across calls (captured graphs point at them); only the latest batch size is kept. The MTP
        layer's cache is there whenever the model has the layer (the memory plan counts it), so calls with and
        without the MTP head (`speculative="auto"` switching modes) share the caches and keep their graphs."""
        if batch not in self._kv:
            for step in self._steps.values():
                step.release()
            self._kv.clear()
            self._steps.clear()
            self._kv[batch] = KVCaches.allocate(self.args, batch, self.options.max_seq_len, self.options.dtype,
                                              self.device, self.has_mtp)
        caches = self._kv[batch]
        # Start every call from a clean cache: masked entries are multiplied by exact zeros, which must not meet
        # anything a previous call (a shadow row, an interrupted step) may have left there.
        caches.zero_()
        return caches

    def decode_step(self, caches: KVCaches, shape: StepShape, trace: torch.Tensor | None) -> DecodeStep:
        # the options may change between calls (a captured step belongs to one setting of each)
        key = (shape, self.residency.cfg, trace is not None, self.options.cuda_graphs)
        if key not in self._steps:
            self._steps[key] = DecodeStep(self.runner, caches, self.sampler, shape, self.options.cuda_graphs,
                                          oracle_trace=trace)
        return self._steps[key]

    def trace_buffer(self) -> torch.Tensor:
        """The routing trace of a recorded call: [max_seq_len, MoE positions, experts] on the device."""
        if self._trace is None:
            res = self.residency
            self._trace = torch.zeros((self.options.max_seq_len, len(res.layers), res.n_experts), dtype=torch.uint8,
                                      device=self.device)
        return self._trace

    def _abort_call(self) -> None:
        try:
            self.residency.abort()
            if self.streamer is not None:
                self.streamer.abort()
        finally:  # a failure in settling must not leave the engine busy for every later call
            self._active = False
            self._free_cuda()

    def synchronize(self) -> None:
        """Wait for the device (a session's timing boundaries)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _free_cuda(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
