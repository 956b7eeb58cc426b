"""One generate call: prefill, then one graph replay per decode step, and the call's statistics.

A `Session` owns the call's state (tokens, positions, drafts, streamed text) and drives the engine's parts: the
prefill runner, the decode steps (`decode.py`) and the residency table, whose counters it reads twice (after prefill
and at the end). Per decode step the host uploads the inputs, launches the step and reads back the sampled ids: the
step's one synchronisation. Everything else (EOS, lengths, accepting drafts, text) is host bookkeeping on those ids.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, Iterator, Protocol, TypeVar

import torch

from .accounting import LayerCounters, Stats
from .decode import Advance, DecodeStep, RowState, StepShape, decode_rows
from .errors import RequestError
from .predictors import PredictorSpec
from .residency import counters_by_layer
from .residency.state import effective_spare_recent
from .sampling import SamplingParams, TokenLogprob, logprobs_of

if TYPE_CHECKING:
    from .config import ModelArgs
    from .options import EngineConfig
    from .residency import Residency
    from .runner import KVCaches, ModelRunner
    from .sampling import DeviceSampler
    from .speculation import Decision, DraftDecision
    from .streaming import LayerStreamer

logger = logging.getLogger(__name__)
T = TypeVar("T")


class SessionEngine(Protocol):
    """What a session (and the prefill helpers below) sees of its engine: its parts and the few services a call
    needs. `MoEPrefetchEngine` is one; sessions never reach into the engine's other state."""

    args: "ModelArgs"
    options: "EngineConfig"
    device: torch.device
    has_mtp: bool
    tokenizer: Any
    residency: "Residency"
    runner: "ModelRunner"
    sampler: "DeviceSampler"
    streamer: "LayerStreamer | None"
    rows_per_sequence: int  # rows a decode step's kernels are shaped for per sequence (fixed at load)

    def kv_caches(self, batch: int) -> "KVCaches": ...

    def decode_step(self, caches: "KVCaches", shape: StepShape, trace: torch.Tensor | None) -> DecodeStep: ...

    def trace_buffer(self) -> torch.Tensor: ...

    def synchronize(self) -> None: ...

    def decode_text(self, ids: list[int]) -> str: ...


@dataclass
class Request:
    prompts: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams
    predictor: PredictorSpec
    speculative: str | None
    stop_at_eos: bool
    event_log: str | Path | None
    min_confidence: float = 0.0  # predictions below it are neither fetched nor counted
    speculation: Decision | None = None  # how `speculative="auto"` was resolved for this call
    draft_experts: str | None = None  # the MTP head's experts for this call (None: the engine's option)
    draft_choice: DraftDecision | None = None  # how `draft_experts="auto"` was resolved for this call
    draft_tokens: int | None = None  # speculation: the drafts chained per step (None: the engine's option)


@dataclass
class TokenEvent:
    """One generated token, as streamed."""

    sequence: int
    token: int
    text: str | None = None  # the text this token adds, when there is a tokenizer
    logprob: TokenLogprob | None = None  # when the call asked for `logprobs`


@dataclass
class GenerationResult:
    sequences: list[list[int]]  # generated token ids per prompt (prompt excluded)
    texts: list[str] | None
    stats: Stats
    finish_reasons: list[str] = field(default_factory=list)  # "eos" | "length" | "interrupted"
    interrupted: bool = False
    logprobs: list[list[TokenLogprob]] | None = None  # per prompt, one per generated token (`logprobs=` calls)


class TextStream:
    """Incremental detokenisation: each token's text from a short window of recent tokens (linear, not quadratic),
    holding back a multi-byte character until it is complete."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = 0  # tokens before this index are already emitted and no longer decoded
        self.read = 0  # tokens before this index are emitted

    def piece(self, ids: list[int], final: bool) -> str:
        decode = lambda part: self.tokenizer.decode(part, skip_special_tokens=True)  # noqa: E731
        emitted = decode(ids[self.prefix : self.read])
        text = decode(ids[self.prefix :])
        if text.endswith("\ufffd") and not final:
            return ""
        self.prefix, self.read = self.read, len(ids)
        return text[len(emitted):] if text.startswith(emitted) else text


class Session:
    """The state of one generate/stream call, and its loop."""

    def __init__(self, engine: SessionEngine, request: Request, trace: torch.Tensor | None = None,
                 record: bool = False, want_text: bool = True):
        self.engine = engine
        self.request = request
        self.res = engine.residency
        self.args = engine.args
        self.batch = len(request.prompts)
        self.spec = request.predictor
        self.speculative = request.speculative == "mtp"
        # drafts the MTP head gave less than this are not verified (their rows read no routed expert)
        self.verify_cut = engine.options.verify_confidence if self.speculative else 0.0
        self.uses_mtp = engine.has_mtp and (self.speculative or self.spec.needs_mtp)
        self.drafts = self.speculative or self.spec.needs_drafts
        # with every expert resident a shadow row predicts nothing worth fetching: skip its compute
        self.shadow = self.spec.shadow and not self.speculative and not self.res.preloaded
        self.trace = trace  # the oracle's recorded routing
        self.record = record  # this call records the routing (the oracle's first pass)
        stop_ids = frozenset(self.args.eos_token_ids) if request.stop_at_eos else frozenset()
        self.rows = [RowState(len(p), request.max_new_tokens, stop_ids=stop_ids) for p in request.prompts]
        self.finish = ["length"] * self.batch
        self.top_logprobs = request.sampling.logprobs  # alternatives kept per token (None: no log-probabilities)
        self.logprobs: list[list[TokenLogprob]] | None = \
            [[] for _ in range(self.batch)] if self.top_logprobs is not None else None
        # per-token text only when a consumer reads it (streaming, callbacks): decoding costs host time per token
        self.texts = [TextStream(engine.tokenizer) for _ in range(self.batch)] \
            if engine.tokenizer and want_text else None
        self.stats = Stats(predictor=self.spec.name, lookahead=self.spec.lookahead, policy=engine.options.policy,
                           lrfu_halflife=engine.options.lrfu_halflife,
                           cache_slots=self.res.n_slots, expert_bytes=self.res.expert_bytes,
                           speculative=self.speculative, sequences=self.batch,
                           prompt_tokens=sum(len(p) for p in request.prompts),
                           main_layers=tuple(self.args.moe_layers))

    @property
    def generated(self) -> list[list[int]]:
        """Each sequence's tokens so far (the rows' own lists)."""
        return [row.generated for row in self.rows]

    # ---- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> Iterator[TokenEvent]:
        started = time.perf_counter()
        engine, res, request = self.engine, self.res, self.request
        configure_residency(engine, self.spec, self.batch * (engine.rows_per_sequence if self.speculative else 1),
                            request.min_confidence)
        res.begin_call()
        if self.record:
            res.trace = engine.trace_buffer()
            res.trace.zero_()
        if self.trace is not None and self.spec.belady:
            res.know_future(self.trace)
        engine.sampler.set_params(request.sampling)
        streamer = engine.streamer
        streamed_before = streamer.bytes_copied if streamer is not None else 0
        caches = engine.kv_caches(self.batch)
        t0 = time.perf_counter()
        first, first_logprobs = self._prefill(caches)
        engine.synchronize()
        self.stats.prefill_seconds = time.perf_counter() - t0
        self.stats.ttft_seconds = time.perf_counter() - started
        prefill_counters = res.st.counters.clone()
        if res.group is not None:  # the call's counters are every rank's together (end_call): so is this snapshot
            res.group.all_reduce_(prefill_counters)
        prefill_counters = prefill_counters.cpu()
        if streamer is not None:
            self.stats.prefill_stream_bytes = streamer.bytes_copied - streamed_before
            self.stats.prefill_stream_stall_seconds = streamer.transfer.collect_stall_seconds()

        for b in range(self.batch):
            yield from self._emit(b, [first[b]], first_logprobs[b : b + 1] if first_logprobs else None)
        t1 = time.perf_counter()
        step = self._step(caches)
        while any(row.active for row in self.rows):
            out, advance = decode_rows(step, self.rows, self.uses_mtp and self.drafts, self.verify_cut)
            self.stats.decode_syncs += 1
            self.stats.decode_steps += 1
            for b, tokens in enumerate(self._tally(advance)):
                yield from self._emit(b, tokens, out.logprobs[b] if out.logprobs is not None else None)
        engine.synchronize()
        self.stats.decode_seconds = time.perf_counter() - t1
        if streamer is not None:
            self.stats.decode_stream_bytes = (streamer.bytes_copied - streamed_before
                                              - self.stats.prefill_stream_bytes)
            self.stats.decode_stream_stall_seconds = streamer.transfer.collect_stall_seconds()
        self._finish(prefill_counters)
        return self.result()

    def _prefill(self, caches) -> tuple[list[int], list[TokenLogprob] | None]:
        """Each prompt in windows of chunks into its cache row -> the first tokens (and their log-probabilities when
        asked); the MTP head's first drafts go into the rows."""
        engine = self.engine
        belady = self.trace is not None and self.spec.belady
        hiddens = prefill_rows(engine, caches, self.request.prompts, belady)
        logits = engine.runner.logits(torch.stack([h[-1] for h in hiddens]))
        rows = torch.arange(self.batch, device=engine.device)
        positions = torch.tensor([len(p) for p in self.request.prompts], device=engine.device)
        chosen = engine.sampler(logits, self.request.sampling, rows, positions)
        first = chosen.tolist()
        first_logprobs = logprobs_of(logits, chosen, self.top_logprobs) if self.top_logprobs is not None else None
        if self.uses_mtp:
            for b, prompt in enumerate(self.request.prompts):
                row = self.rows[b]
                row.set_drafts(*prefill_mtp_row(engine, caches, b, prompt, first[b], hiddens[b], belady))
        return first, first_logprobs

    def _step(self, caches) -> DecodeStep:
        mode = "verify" if self.speculative else ("shadow" if self.shadow else "none")
        shape = step_shape(self.engine, self.batch, self.spec, mode, self.uses_mtp, self.request.sampling,
                           record=self.record, draft_experts=self.request.draft_experts,
                           draft_tokens=self.request.draft_tokens)
        return self.engine.decode_step(caches, shape, self.trace)

    def _tally(self, advance: Advance) -> list[list[int]]:
        """The drafts' counts of a step into the call's statistics -> the tokens each sequence gets."""
        self.stats.mtp_drafts_checked += advance.drafts_checked
        self.stats.mtp_drafts_correct += advance.drafts_correct
        self.stats.count_drafts(advance.offered, advance.proposed, advance.accepted)
        return advance.tokens

    def _emit(self, b: int, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> Iterator[TokenEvent]:
        """A row's new tokens (with their log-probabilities, one per token, when the call asked) as events."""
        state = self.rows[b]
        for i, token in enumerate(tokens):
            if not state.active:
                return
            state.generated.append(token)
            logprob = None
            if self.logprobs is not None and logprobs is not None:
                logprob = logprobs[i].first(self.top_logprobs)
                self.logprobs[b].append(logprob)
            done = state.finished
            if done:
                state.active = False
                self.finish[b] = "eos" if token in state.stop_ids else "length"
            text = self.texts[b].piece(state.generated, final=done) if self.texts else None
            yield TokenEvent(b, token, text, logprob)

    # ---- ends -----------------------------------------------------------------------------------------------------
    def _finish(self, prefill_counters: torch.Tensor) -> None:
        counters = self.res.end_call()
        self.stats.lead_counts = self.res.leads.read(self.spec.max_lead)
        self.stats.extra.update(self.res.prefill_extra)
        self.res.trace = None
        self._fill_counters(counters, prefill_counters)

    def _fill_counters(self, counters: torch.Tensor, prefill_counters: torch.Tensor | None) -> None:
        res = self.res
        chunk = res.cfg.chunk_bytes
        whole = counters_by_layer(counters, res.layers)
        self.stats.per_layer = {layer: LayerCounters.from_row([c[n] for n in c], res.expert_bytes, chunk)
                                for layer, c in whole.items()}
        if prefill_counters is not None:
            before = counters_by_layer(prefill_counters, res.layers)
            self.stats.decode_per_layer = {
                layer: self.stats.per_layer[layer] - LayerCounters.from_row([c[n] for n in c], res.expert_bytes, chunk)
                for layer, c in before.items()}

    def abort(self) -> None:
        """After Ctrl-C or an error mid-call: settle the table (cold cache) and keep whatever counts are readable."""
        self.res.abort()
        self.stats.extra.update(self.res.prefill_extra)
        self.res.trace = None
        self.finish = ["interrupted" if f == "length" and len(g) < self.request.max_new_tokens else f
                       for f, g in zip(self.finish, self.generated)]

    def result(self, interrupted: bool = False) -> GenerationResult:
        self.stats.generated_tokens = sum(len(g) for g in self.generated)
        self.stats.extra["main_moe_layers"] = list(self.args.moe_layers)
        if self.request.event_log is not None:
            try:
                self.stats.write_jsonl(self.request.event_log)
            except OSError as exc:  # the tokens matter more than the log
                logger.error("could not write the event log %s: %s", self.request.event_log, exc)
        texts = [self.engine.decode_text(g) for g in self.generated] if self.engine.tokenizer is not None else None
        return GenerationResult(self.generated, texts, self.stats, self.finish, interrupted, self.logprobs)


# ---- prefill into cache rows: a batch's prompts together, or one row (as a continuous batch admits a request) ------


def prompt_chunks(engine: SessionEngine, tokens: torch.Tensor, offset: int
                  ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(start, tokens [1, T_c], positions [1, T_c]) of each prefill chunk of tokens [1, T], positions from `offset`:
    chunks of the engine's `prefill_chunk` tokens from the prompt's start, whatever windows they then run in."""
    chunk = engine.options.prefill_chunk
    return [(s, tokens[:, s : s + chunk],
             torch.arange(s + offset, s + offset + min(chunk, tokens.shape[1] - s), device=tokens.device)[None])
            for s in range(0, tokens.shape[1], chunk)]


def prefill_windows(engine: SessionEngine, tokens: torch.Tensor, offset: int, per_window: int | None = None):
    """(starts, chunks, positions) of each prefill window of tokens [1, T]; positions start at `offset`. Windows hold
    `per_window` tokens (the engine's by default), in whole chunks: the chunks, and so the bits, are the same
    whatever the window."""
    per_window = window_tokens(engine, per_window)
    chunks = prompt_chunks(engine, tokens, offset)
    for w0 in range(0, tokens.shape[1], per_window):
        inside = [c for c in chunks if w0 <= c[0] < w0 + per_window]
        yield [c[0] for c in inside], [c[1] for c in inside], [c[2] for c in inside]


def window_lengths(engine: SessionEngine, length: int, per_window: int | None = None) -> list[int]:
    """The prompt tokens of each window `prefill_windows` makes of `length` tokens, in order."""
    size = window_tokens(engine, per_window)
    return [min(size, length - w0) for w0 in range(0, length, size)]


def prefill_steps(engine: SessionEngine, length: int) -> int:
    """Table steps (windows) a prompt of `length` tokens takes through the main layers (as many again through the
    MTP layer)."""
    return -(-length // window_tokens(engine))


def window_tokens(engine: SessionEngine, per_window: int | None = None) -> int:
    """Prompt tokens of one prefill window of at most `per_window` tokens, never more than the engine's
    `prefill_window` (which the memory plan sized the prefill's workspace for): whole chunks, at least one."""
    options = engine.options
    wanted = options.prefill_window if per_window is None else min(per_window, options.prefill_window)
    return max(wanted // options.prefill_chunk, 1) * options.prefill_chunk


def run_through(steps: Generator[Any, None, T]) -> T:
    """A window-by-window prefill (`prefill_row_windows`, ...) run to its end -> what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def prefill_row_windows(engine: SessionEngine, caches, row: int, prompt: list[int], belady: bool = False,
                        per_window: int | None = None) -> Generator[int, None, torch.Tensor]:
    """A prompt through the main layers into cache row `row`, one window (one table step) per `next()` -> its final
    hidden [T, H]. Between two windows it yields the prompt tokens in the cache so far: a continuous batch's steps
    may write the row's masked entry there (a later window or the row's own first step writes it again)."""
    tokens = torch.tensor(prompt, device=engine.device)[None]
    parts = []
    for i, (starts, pieces, positions) in enumerate(prefill_windows(engine, tokens, 0, per_window)):
        if i:
            yield starts[0]
        engine.residency.begin_step(decode=False, belady=belady)
        parts += [h[0] for h in engine.runner.forward_window(pieces, positions, caches, row, starts)]
    return torch.cat(parts)


def prefill_rows(engine: SessionEngine, caches, prompts: list[list[int]], belady: bool = False,
                 rows: list[int] | None = None) -> list[torch.Tensor]:
    """Prompts through the main layers, prompt b into cache row b (or rows[b]), their chunks packed in order into
    shared windows of at most the engine's window tokens -> each prompt's final hidden [T_b, H]. A window's experts
    cross the link once for every prompt in it (a row's own windows, `prefill_row_windows`, read them once a prompt);
    each chunk computes the bits it computes alone, so a prompt's tokens do not depend on the prompts beside it."""
    rows = list(range(len(prompts))) if rows is None else rows
    capacity = window_tokens(engine)
    chunks = [(b, *c) for b, prompt in enumerate(prompts)
              for c in prompt_chunks(engine, torch.tensor(prompt, device=engine.device)[None], 0)]
    parts: list[list[torch.Tensor]] = [[] for _ in prompts]
    windows: list[list[tuple]] = [[]]
    filled = 0  # tokens in the last window
    for c in chunks:  # (prompt, start, tokens, positions), filling each window up to its capacity in order
        if windows[-1] and filled + c[2].shape[1] > capacity:
            windows.append([])
            filled = 0
        windows[-1].append(c)
        filled += c[2].shape[1]
    for window in windows:
        engine.residency.begin_step(decode=False, belady=belady)
        prompt_of, starts, pieces, positions = (list(column) for column in zip(*window))
        hidden = engine.runner.forward_window(pieces, positions, caches, [rows[b] for b in prompt_of], starts)
        for b, h in zip(prompt_of, hidden):
            parts[b].append(h[0])
    return [torch.cat(p) for p in parts]


def prefill_mtp_row_windows(engine: SessionEngine, caches, row: int, prompt: list[int], first: int,
                            hidden: torch.Tensor, belady: bool = False, per_window: int | None = None
                            ) -> Generator[int, None, tuple[list[int], list[float]]]:
    """`prefill_mtp_row` one window per `next()`; between two windows it yields the prompt's length (the main cache
    holds the whole prompt; the MTP cache's entries from there on are written again by the row's steps)."""
    nxt = torch.tensor(prompt[1:] + [first], device=engine.device)[None]
    last = None
    for i, (starts, pieces, positions) in enumerate(prefill_windows(engine, nxt, 1, per_window)):
        if i:
            yield len(prompt)
        engine.residency.begin_step(decode=False, belady=belady)
        h = [hidden[s : s + p.shape[1]][None] for s, p in zip(starts, pieces)]
        last = engine.runner.mtp_window(pieces, h, positions, caches.mtp, row, starts)[-1][:, -1:]
    prob, draft = engine.runner.mtp_logits(last)[0, -1].softmax(-1).max(-1)
    return [int(draft)], [float(prob)]


def prefill_mtp_row(engine: SessionEngine, caches, row: int, prompt: list[int], first: int,
                    hidden: torch.Tensor, belady: bool = False) -> tuple[list[int], list[float]]:
    """The MTP layer over every (hidden at i, token i+1) pair of a prompt (the last pair's token is `first`, the
    token sampled after it), into the MTP cache's row -> the first draft and its probability (a chain of one: the
    first verify step checks one draft, the later ones `draft_tokens`)."""
    return run_through(prefill_mtp_row_windows(engine, caches, row, prompt, first, hidden, belady))


# what a call runs where the options leave it to the predictor (None): fills at 1.5 x top-k per (step, layer); the
# learned head alone only protects, ranks victims at weight 0.7 and bypasses, its fastest row measured offloaded
# (BENCHMARKS "Protection and the one-token ceiling on the GPU": 1.08 x reactive in bf16, 1.03 x with FP8 experts;
# its fills from confidence 0.6 wasted 35-38 % and lost time, and 0.7 missed the fewest of the weights tried)
DEFAULT_PREFETCH_BUDGET = 1.5
LEARNED_REUSE_WEIGHT = 0.7


def prefetch_settings(options: "EngineConfig", spec: PredictorSpec) -> tuple[float, float, bool]:
    """(prefetches per (step, layer) as a multiple of top-k, reuse weight, bypass) that a call with `spec` runs: the
    engine's options where given, else the predictor's defaults. Reuse and bypass act only where the head runs."""
    learned_alone = spec.names == ("learned",)
    budget = options.prefetch_budget if options.prefetch_budget is not None else \
        0.0 if learned_alone else DEFAULT_PREFETCH_BUDGET
    if not spec.learned:
        return budget, 0.0, False
    reuse = options.reuse_weight if options.reuse_weight is not None else LEARNED_REUSE_WEIGHT
    return budget, reuse, options.bypass if options.bypass is not None else True


def configure_residency(engine: SessionEngine, spec: PredictorSpec, rows: int, min_confidence: float) -> None:
    """The residency table's per-call settings for a predictor and the rows a step computes."""
    options, top_k = engine.options, engine.args.num_experts_per_tok
    budget_share, reuse_weight, bypass = prefetch_settings(options, spec)
    budget = max(int(math.ceil(budget_share * top_k * rows)), 0)
    inflight = options.max_inflight_experts or max(2 * top_k * rows, 4)
    spare = effective_spare_recent(options.spare_recent, spec.oracle, options.policy)
    engine.residency.configure(ring=spec.ring, budget_per_target=budget, max_inflight=inflight,
                               min_confidence=min_confidence, spare_recent=spare,
                               wait_late=options.late_prefetch == "wait", prefetch_lead=options.prefetch_lead,
                               policy=options.policy, frequency_halflife=options.lrfu_halflife,
                               fill_confidence=options.fill_confidence, fill_idle_link=options.fill_link == "idle",
                               reuse_weight=reuse_weight, bypass=bypass)


def step_shape(engine: SessionEngine, batch: int, spec: PredictorSpec, mode: str, uses_mtp: bool,
               sampling: SamplingParams, record: bool = False, draft_experts: str | None = None,
               draft_tokens: int | None = None) -> StepShape:
    """The decode step a call (or a continuous batch) runs: its rows, predictor signals and sampling paths;
    `draft_experts` is the call's resolved mode (default: the engine's option, "auto" drafting from VRAM) and
    `draft_tokens` its chain (default: the engine's option, at most what the engine was loaded for)."""
    res = engine.residency
    draft = draft_experts or engine.options.draft_experts
    chain = draft_tokens or engine.options.draft_tokens
    if mode == "verify" and 1 + chain > engine.rows_per_sequence:
        raise RequestError(f"draft_tokens={chain} needs {1 + chain} rows a sequence, but this engine was loaded "
                           f"for {engine.rows_per_sequence}: load it with draft_tokens={chain}")
    return StepShape(batch=batch, mode=mode, spec=spec, run_mtp=uses_mtp, draft_tokens=chain,
                     rows_per_sequence=engine.rows_per_sequence,
                     shared_rows=engine.options.verify_rows == "shared",
                     drafts=uses_mtp and (mode != "none" or spec.needs_drafts), greedy=sampling.greedy,
                     top_k=0 < sampling.top_k < engine.args.vocab_size, top_p=sampling.top_p < 1.0,
                     adjust=sampling.adjusts, logprobs=sampling.logprobs is not None,
                     reserve=spec.active and not res.preloaded, record=record,
                     draft_cached=uses_mtp and not res.preloaded and draft in ("cached", "auto"))
