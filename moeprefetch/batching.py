"""Continuous batching: requests join a running batch at a token boundary and leave when they finish.

A `ContinuousBatch` holds `max_batch_size` cache rows. Admitting a request prefills its prompt into the lowest free
row (the others wait for that prefill, at a token boundary) and samples its first token; every `step()` decodes one
token for every active row. A step computes only the first rows up to the highest active one, rounded up to a power
of two (`step_rows`), each such shape a decode step of its own (captured as a CUDA graph like any other): one stream
of a batch of 16 costs a one-row step, not a 16-row one. Each row is computed on its own and sampling draws each
request's noise from its own seed and positions (`RowSampler`), so a row's tokens never depend on what the other
rows hold. They may depend on the step's shape on CUDA, where more rows pick other kernels (cuBLAS's, and the expert
kernel's tensor-core tiles above four rows); `batch_invariant=True` keeps every step at `max_batch_size` rows, so a
request's tokens are the same whoever else is served (at the full step's cost). On the CPU, and on CUDA while the
bucket is the one `engine.generate` runs for one prompt, a request's tokens are those of `engine.generate` alone
(tests check it). One `ContinuousBatch` owns the engine while it lives: nothing else may generate meanwhile.

Admitting a request runs its prefill as table steps, which moves the table's step clock; the fills reserved and the
experts protected for the running rows' next decode steps are first deferred by each of those steps
(`Residency.defer_pending`), so the prefill neither releases their prefetches as passed nor evicts what they need.

A long prompt need not stall the running rows for its whole prefill: `begin` reserves a row and `advance` runs one
prefill window at a time (at most `per_window` prompt tokens: whole chunks, so the bits are those of `admit`),
between the running rows' steps (chunked prefill). A row being admitted is computed by a step only when a running
row above it is, masked, at the position its prefill has reached (that entry is written again by a later window or
by its own first step), so the partial prefill is never overwritten.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator

import torch

from .build import predictor_spec
from .predictors import default_lookahead
from .decode import DecodeStep, RowState, decode_rows
from .errors import RequestError
from .requests import unused_learned_options
from .sampling import RowSampler, SamplingParams, TokenLogprob, logprobs_of, row_paths, sample
from .session import (configure_residency, prefill_mtp_row_windows, prefill_row_windows, prefill_rows, run_through,
                      step_shape, window_lengths)

if TYPE_CHECKING:
    from .engine import MoEPrefetchEngine

logger = logging.getLogger(__name__)


def step_rows(top: int, capacity: int, batch_invariant: bool = False) -> int:
    """The rows a step computes when row `top - 1` is the highest active one: the next power of two (at most
    `capacity`), or always `capacity` when the batch is invariant. Powers of two bound the shapes (and graphs) to
    log2(capacity) + 1 while a step computes less than twice the rows it needs."""
    if batch_invariant or top >= capacity:
        return capacity
    return min(1 << max(top - 1, 0).bit_length(), capacity)


@dataclass
class Admission:
    """A request's prefill in progress in its row (`ContinuousBatch.begin`)."""

    windows: Generator[int, None, tuple[RowState, SamplingParams, TokenLogprob | None]]  # a window per `next()`
    windows_left: list[int]  # the prompt tokens of each window still to run (the main layers', then the MTP layer's)
    filled: int = 0  # where a step may write the row's masked entry: what the windows so far have prefilled


class ContinuousBatch:
    def __init__(self, engine: "MoEPrefetchEngine", predictor: str | None = None,
                 min_confidence: float | None = None, batch_invariant: bool = False):
        options = engine.options
        name = predictor or options.predictor
        spec = predictor_spec(name, default_lookahead(name, options.lookahead), engine.has_mtp,
                              engine.runner.learned_config, len(engine.args.moe_layers))
        if spec.oracle:
            raise RequestError("the oracle predictor needs a recorded run of the same request; it cannot serve")
        if (unused := unused_learned_options(options, spec)) is not None:  # one predictor serves every request
            raise RequestError(f"{unused}: serve with predictor 'learned' (or a combination with it), or without "
                               f"them")
        if engine.residency.group is not None:
            raise RequestError("continuous batching runs in one process: the ranks of distributed=True would need "
                               "one scheduler between them")
        self.engine = engine
        self.rows = options.max_batch_size
        self.spec = spec
        res = engine.residency
        self.uses_mtp = engine.has_mtp and spec.needs_mtp
        self.caches = engine.kv_caches(self.rows)
        self.sampler = RowSampler(engine.args.vocab_size, engine.device, self.rows)
        configure_residency(engine, spec, self.rows,
                            options.min_confidence if min_confidence is None else min_confidence)
        self.batch_invariant = batch_invariant
        self._mode = "shadow" if spec.shadow and not res.preloaded else "none"
        # by (rows computed (`step_rows`), the sampling paths its rows take (`row_paths`)), made when first needed
        self._steps: dict[tuple[int, SamplingParams], DecodeStep] = {}
        self.state: list[RowState | None] = [None] * self.rows
        self.sampling: list[SamplingParams | None] = [None] * self.rows  # each row's request's
        # the latest token's log-probabilities of each row whose request asked (`admit` and `step` refresh it)
        self.logprobs: dict[int, TokenLogprob] = {}
        self.admissions: dict[int, Admission] = {}  # rows whose prefill is under way (`begin`, `advance`)
        res.begin_call()
        self.steps = 0
        self._carried: torch.Tensor | None = None  # counters of the table before a settle

    # ---- rows -------------------------------------------------------------------------------------------------------
    @property
    def free_rows(self) -> list[int]:
        return [r for r, s in enumerate(self.state) if s is None and r not in self.admissions]

    @property
    def active_rows(self) -> list[int]:
        return [r for r, s in enumerate(self.state) if s is not None]

    def check(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None) -> None:
        """Whether a request fits the engine (one sentence if not); nothing is changed."""
        # the engine's own checks: token ids in the vocabulary, the prompt and its new tokens (and chained drafts)
        # within the context
        self.engine.new_request([prompt], max_new_tokens, 0.0, 0, 1.0, None, self.spec.name, self.spec.lookahead,
                                None, False, None, resolve_auto=False)
        if sampling is not None:
            sampling.validate(self.engine.args.vocab_size)

    def admit(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams,
              stop_ids: frozenset[int] = frozenset()) -> tuple[int, int]:
        """Prefill a request into a free row at once -> (row, its first token). The caller decides when (a token
        boundary)."""
        row = self.begin(prompt, max_new_tokens, sampling, stop_ids)
        while (first := self.advance(row)[1]) is None:
            pass
        return row, first

    def begin(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams,
              stop_ids: frozenset[int] = frozenset(), per_window: int | None = None) -> int:
        """Reserve a free row for a request -> the row; its prefill runs in `advance`, a window of at most
        `per_window` prompt tokens (the engine's prefill window by default; whole chunks, at least one) a call."""
        self.check(prompt, max_new_tokens, sampling)
        if not self.free_rows:
            raise RequestError("no free row in the batch")
        row = self.free_rows[0]
        self.caches.zero_(row)  # masked entries meet exact zeros, never an earlier request's keys
        windows = self._prefill(row, prompt, max_new_tokens, sampling, stop_ids, per_window)
        lengths = window_lengths(self.engine, len(prompt), per_window) * (2 if self.uses_mtp else 1)
        self.admissions[row] = Admission(windows, lengths)
        return row

    def advance(self, row: int) -> tuple[int, int | None]:
        """One prefill window of the request admitted into `row` (`begin`) -> (the prompt tokens it ran, the
        request's first token once its prefill is done: the row decodes from the next step on; else None). An error
        releases the row."""
        admission = self.admissions[row]
        ran = admission.windows_left.pop(0)
        # the window does not count against the running rows' prefetches and protections
        self.engine.residency.defer_pending(1)
        try:
            admission.filled = next(admission.windows)
            return ran, None
        except StopIteration as done:
            state, sampling, logprob = done.value
        except BaseException:
            del self.admissions[row]
            raise
        del self.admissions[row]
        self._start(row, state, sampling, logprob)
        return ran, state.generated[0]

    def admit_together(self, requests: list[tuple[list[int], int, SamplingParams, frozenset[int]]]
                       ) -> list[tuple[int, int]]:
        """Prefill requests (prompt, max_new_tokens, sampling, stop_ids) at once into free rows, their prompts
        sharing prefill windows (`session.prefill_rows`: an expert crosses once per window for all of them, and each
        row gets the bits it gets alone) -> [(row, first token)], in order; the rows decode from the next step on.
        Every window stalls the running rows for its whole length: beside them, admit only as many prompt tokens
        together as a step may wait for (the server's --prefill-tokens-per-step)."""
        for prompt, max_new_tokens, sampling, _ in requests:
            self.check(prompt, max_new_tokens, sampling)
        if len(requests) > len(self.free_rows):
            raise RequestError(f"{len(requests)} requests and {len(self.free_rows)} free rows in the batch")
        rows = self.free_rows[: len(requests)]
        for row in rows:
            self.caches.zero_(row)
        started = []
        try:
            hiddens = prefill_rows(self.engine, self.caches, [r[0] for r in requests], rows=rows)
            for row, (prompt, max_new_tokens, sampling, stop_ids), hidden in zip(rows, requests, hiddens):
                state, _, logprob = run_through(self._first_token(row, prompt, max_new_tokens, sampling, stop_ids,
                                                                  hidden, None))
                self._start(row, state, sampling, logprob)
                started.append((row, state.generated[0]))
        except BaseException:
            for row, _ in started:  # all or none: the rows already started are free again
                self.release(row)
            raise
        return started

    def _start(self, row: int, state: RowState, sampling: SamplingParams, logprob: TokenLogprob | None) -> None:
        """A row whose prefill is done decodes from the next step on."""
        self.sampler.set_row(row, sampling)
        self.state[row], self.sampling[row] = state, sampling
        self.logprobs.pop(row, None)
        if logprob is not None:
            self.logprobs[row] = logprob

    def next_window(self, row: int) -> int:
        """Prompt tokens the next `advance` of `row` runs."""
        return self.admissions[row].windows_left[0]

    def _prefill(self, row: int, prompt: list[int], max_new_tokens: int, sampling: SamplingParams,
                 stop_ids: frozenset[int], per_window: int | None
                 ) -> Generator[int, None, tuple[RowState, SamplingParams, TokenLogprob | None]]:
        """The prompt through the main layers (and the MTP layer), one window per `next()` -> the row's state, its
        sampling parameters and its first token's log-probabilities (when asked)."""
        hidden = yield from prefill_row_windows(self.engine, self.caches, row, prompt, per_window=per_window)
        return (yield from self._first_token(row, prompt, max_new_tokens, sampling, stop_ids, hidden, per_window))

    def _first_token(self, row: int, prompt: list[int], max_new_tokens: int, sampling: SamplingParams,
                     stop_ids: frozenset[int], hidden: torch.Tensor, per_window: int | None
                     ) -> Generator[int, None, tuple[RowState, SamplingParams, TokenLogprob | None]]:
        """After the main layers (the prompt's final hidden [T, H]): the first token, then the MTP layer's windows
        -> the row's state, its sampling parameters and its first token's log-probabilities (when asked)."""
        engine = self.engine
        logits = engine.runner.logits(hidden[-1:])
        chosen = sample(logits, sampling, [0], [len(prompt)])
        logprob = logprobs_of(logits, chosen, sampling.logprobs)[0] if sampling.logprobs is not None else None
        state = RowState(len(prompt), max_new_tokens, [int(chosen[0])], stop_ids)
        if self.uses_mtp:
            yield len(prompt)
            state.set_drafts(*(yield from prefill_mtp_row_windows(engine, self.caches, row, prompt,
                                                                  state.generated[0], hidden, per_window=per_window)))
        return state, sampling, logprob

    def finished(self, row: int) -> bool:
        state = self.state[row]
        assert state is not None
        return state.finished

    def release(self, row: int) -> None:
        """The row's request leaves (finished, or gone while it decodes or while its prefill runs)."""
        self.state[row] = self.sampling[row] = None
        self.admissions.pop(row, None)
        self.logprobs.pop(row, None)
        if not any(self.state) and not self.admissions:  # the batch is idle: settle the table as a call's end would
            self.engine.residency.settle()

    # ---- decoding ---------------------------------------------------------------------------------------------------
    @property
    def step_sizes(self) -> list[int]:
        """The step shapes' rows computed, of the steps run so far."""
        return sorted({rows for rows, _ in self._steps})

    @property
    def step_kinds(self) -> list[tuple[int, str, bool, bool]]:
        """The steps run so far: (rows computed, "greedy" | "sampled" | "filtered", bias or penalties on,
        log-probabilities on)."""
        def kind(paths: SamplingParams) -> str:
            return "greedy" if paths.greedy else "filtered" if paths.top_k or paths.top_p < 1.0 else "sampled"

        return sorted((rows, kind(p), p.adjusts, p.logprobs is not None) for rows, p in self._steps)

    @property
    def decode_steps(self) -> list[DecodeStep]:
        """The decode steps made so far (each shape's own, captured as a graph on CUDA)."""
        return list(self._steps.values())

    def decode_step(self, rows: int, paths: SamplingParams = SamplingParams(temperature=1.0, top_k=1, top_p=0.5)
                    ) -> DecodeStep:
        """The step computing the first `rows` rows (their caches and sampling parameters are views of the batch's)
        with the sampling paths `paths` (`row_paths` of its rows; by default every path but bias and
        log-probabilities)."""
        key = (rows, paths)
        if key not in self._steps:
            engine = self.engine
            shape = step_shape(engine, rows, self.spec, self._mode, self.uses_mtp, paths)
            caches = self.caches if rows == self.rows else self.caches.first_rows(rows)
            sampler = self.sampler if rows == self.rows else self.sampler.first_rows(rows)
            self._steps[key] = DecodeStep(engine.runner, caches, sampler, shape, engine.options.cuda_graphs)
        return self._steps[key]

    def step(self) -> dict[int, int]:
        """One decode step of every active row -> {row: its new token}. Rows already finished must be released."""
        live = [s is not None for s in self.state]
        if not any(live):
            return {}
        rows = step_rows(max(r for r, on in enumerate(live) if on) + 1, self.rows, self.batch_invariant)
        states = self.state[:rows]
        paths = row_paths([s for s in self.sampling[:rows] if s is not None], self.engine.args.vocab_size)
        step = self.decode_step(rows, paths)
        out, advance = decode_rows(step, [self._masked(r) if r in self.admissions else s
                                          for r, s in enumerate(states)], check_drafts=False)
        self.steps += 1
        new = {}
        self.logprobs.clear()
        for row, tokens in enumerate(advance.tokens):
            if not tokens:
                continue
            (token,) = tokens  # no verify rows: one token a row
            self.state[row].generated.append(token)
            new[row] = token
            asked = self.sampling[row].logprobs
            if asked is not None:
                self.logprobs[row] = out.logprobs[row][0].first(asked)
        return new

    def _masked(self, row: int) -> RowState:
        """A row being admitted as a step sees it: masked, at the position its prefill has reached (`filled`)."""
        return RowState(self.admissions[row].filled, 1, [0], active=False)

    def counters(self) -> torch.Tensor:
        """The residency's accounting since the batch began (reads the device)."""
        current = self.engine.residency.st.counters.cpu()
        return current + self._carried if self._carried is not None else current.clone()

    def settle(self) -> None:
        """After an engine error in a prefill: the table may hold half-planned entries, so it starts cold (the
        rows' caches are untouched; their requests go on)."""
        res = self.engine.residency
        counters = res.st.counters.cpu()
        self._carried = counters if self._carried is None else self._carried + counters
        res.abort()
        res.begin_call()

    def reset(self) -> None:
        """After an engine error in a step: every row is dropped and the table settled."""
        self.settle()
        self.state = [None] * self.rows
        self.admissions.clear()
