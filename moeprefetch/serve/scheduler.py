"""The one thread that drives the engine for the server: queue, continuous batching, stops, cancellation, failures.

HTTP handlers `submit()` a `Handle` and read its events from an asyncio queue; the scheduler thread admits queued
requests into free batch rows at token boundaries, runs one decode step for every active row, turns tokens into
text, applies stop strings, end-of-sequence and max_tokens, and hands each event to the handler's event loop. A
handler whose client went away sets `cancelled`; its row is freed at the next token boundary. A request the engine
refuses (too long, bad ids) fails alone with 400; an engine error inside a step fails the requests of that step with
500, settles the engine and the server carries on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..accounting import LayerCounters, Stats
from ..batching import ContinuousBatch
from ..errors import MoEPrefetchError
from ..residency import counters_by_layer
from ..sampling import TokenLogprob
from ..session import TextStream
from .protocol import APIError, Job

logger = logging.getLogger(__name__)
# prompt tokens prefilled between two decode steps of running rows by default (one prefill window always; `serve
# --prefill-tokens-per-step`): short chat prompts join together, a long one is prefilled a window of this many
# tokens (whole chunks) at a time between their steps (chunked prefill), so a stream stalls for about one window's
# prefill at a time, whatever the prompts' length
ADMIT_TOKENS = 512
# seconds an idle server waits after a request arrives for others (`serve --admit-wait-ms`): clients that send
# together (a UI's parallel calls, a benchmark's wave) arrive a few ms apart, and the first one's prefill would
# otherwise run alone while the rest queue behind it (V2-Lite at 12 GiB, bf16, H100: 4 streams sent within 0.6 ms
# had a TTFT p50 of 3.25 s against 0.92 s for the engine prefilling them together)
ADMIT_WAIT_SECONDS = 0.002
ADMIT_WAIT_ROUNDS = 8  # each arrival opens another wait, up to this many waits in all (a steady stream of requests
# must not hold the first one back for long)

METRICS_EVERY_STEPS = 32  # the residency's counters are read (a device sync) this often, and when idle
RECENT_STEPS = 4096  # step durations kept for the median a benchmark reads
RETRY_AFTER_SECONDS = 1  # what a 429 or a draining 503 tells the client to wait


@dataclass
class Handle:
    """One request in flight: what the handler waits on."""

    job: Job
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: bool = False  # set by the handler (client gone); read by the scheduler at a token boundary
    cut: APIError | None = None  # set with `cancelled` by a shutdown: what the client hears instead of "closed"
    row: int | None = None
    tokens: list[int] = field(default_factory=list)
    text: TextStream | None = None
    pending_text: str = ""  # decoded but held back: it could be the start of a stop string
    # the log-probabilities (when asked) of tokens whose text is still held back, each with where its text begins
    # in the completion (its text_offset): sent once that text is, dropped when it turns out to be a stop string's
    held: list[tuple[TokenLogprob, int]] = field(default_factory=list)
    chars: int = 0  # characters of text the tokens so far produced (stop strings not yet cut)

    def send(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is closed (the server stopped): nobody is waiting
            pass


@dataclass
class ServerCounters:
    requests: dict[str, int] = field(default_factory=lambda: {"ok": 0, "stopped": 0, "failed": 0, "rejected": 0,
                                                               "cancelled": 0})
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_steps: int = 0
    # the scheduler thread's time in prompts' prefills and in decode steps: every active stream waits for both
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # requests whose prefill shared windows with others (admitted together), and those groups: how well arrivals
    # were gathered (a request admitted alone beside others waiting stalls their streams for its own prefill)
    admitted_together: int = 0
    joint_admissions: int = 0
    # the latest steps' durations: a benchmark compares their median with the engine's own batched steps
    recent_step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    experts: dict[str, Any] = field(default_factory=dict)


class Scheduler:
    def __init__(self, engine, predictor: str | None = None, max_queue: int = 64, batch_invariant: bool = False,
                 admit_tokens: int = ADMIT_TOKENS, admit_wait: float = ADMIT_WAIT_SECONDS):
        self.engine = engine
        self.admit_tokens = admit_tokens  # prompt tokens prefilled between two steps of running rows
        self.admit_wait = admit_wait  # seconds an idle server waits for requests sent with the first
        self.batch = ContinuousBatch(engine, predictor, batch_invariant=batch_invariant)
        self.tokenizer = engine.tokenizer
        self.stop_ids = frozenset(engine.args.eos_token_ids)
        self.max_queue = max_queue
        self.queue: deque[Handle] = deque()
        self.rows: dict[int, Handle] = {}
        self.counters = ServerCounters()
        self._cond = threading.Condition()
        self._stopping = False
        self._admitting: list[Handle] = []  # taken off the queue, not yet decoding (`row` set: prefill begun)
        self._cut = threading.Event()  # set by `cut()`: a draining `stop()` stops waiting
        self._thread = threading.Thread(target=self._run, name="moeprefetch-scheduler", daemon=True)
        self._thread.start()

    # ---- the handlers' side ----------------------------------------------------------------------------------------
    def submit(self, handle: Handle) -> None:
        """Queue a request, or refuse it at once (429 when the queue is full, 503 while shutting down)."""
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise APIError(503, "the server is shutting down or its engine thread has stopped",
                               kind="server_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            self._drop_cancelled_queue()  # clients gone while they waited do not hold places
            # the queue holds requests on their way into free rows too: only those beyond the free rows wait
            free_rows = max(self.batch.rows - len(self.rows) - len(self._admitting), 0)
            if len(self.queue) - free_rows >= self.max_queue:
                self.counters.requests["rejected"] += 1
                raise APIError(429, f"the request queue is full ({self.max_queue} waiting); retry later",
                               kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            try:
                self.batch.check(handle.job.prompt_ids, handle.job.max_tokens, handle.job.sampling)
            except MoEPrefetchError as exc:  # too long, ids outside the vocabulary: this request fails now
                # (max_tokens was clamped to the context when parsed, so what does not fit is the prompt)
                raise APIError(400, str(exc), "messages" if handle.job.kind == "chat.completion" else "prompt") \
                    from None
            self.queue.append(handle)
            self._cond.notify()

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return {"queue_depth": len(self.queue), "active": len(self.rows), "admitting": len(self._admitting),
                    "alive": self._thread.is_alive(),
                    "requests": dict(self.counters.requests), "prompt_tokens": self.counters.prompt_tokens,
                    "completion_tokens": self.counters.completion_tokens, "decode_steps": self.counters.decode_steps,
                    "prefill_seconds": self.counters.prefill_seconds, "decode_seconds": self.counters.decode_seconds,
                    "admitted_together": self.counters.admitted_together,
                    "joint_admissions": self.counters.joint_admissions,
                    "recent_step_seconds": list(self.counters.recent_step_seconds),
                    "experts": dict(self.counters.experts), "max_batch_size": self.batch.rows}

    def stop(self, drain_seconds: float) -> None:
        """Refuse new requests, let those in flight finish for up to `drain_seconds` (or until `cut()`), answer the
        rest 503 and stop the thread. Calling it again is harmless."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        deadline = time.monotonic() + drain_seconds
        while time.monotonic() < deadline and self._thread.is_alive() and not self._cut.is_set():
            with self._cond:
                if not self.queue and not self.rows and not self._admitting:
                    break
            self._cut.wait(0.02)
        error = APIError(503, "the server shut down before this request finished", kind="server_error",
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        with self._cond:
            left = list(self.queue) + list(self._admitting) + list(self.rows.values())
            for handle in left:  # the cut first: the scheduler thread, dropping a cancelled row, sends it too
                handle.cut = error
                handle.cancelled = True
            self._cond.notify()
        for handle in left:  # whoever still waits hears why (a second error event is ignored)
            handle.send(("error", error))
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            logger.warning("the scheduler thread did not stop within 10 s (a long prefill?)")

    def cut(self) -> None:
        """Stop a draining `stop()` from waiting: what is still in flight is answered 503 now (a second signal)."""
        self._cut.set()

    # ---- the scheduler thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the engine thread must not die silently: every waiting request hears it
            logger.exception("the scheduler stopped")
            error = APIError(500, f"the server's engine thread stopped: {type(exc).__name__}: {exc}",
                             kind="server_error")
            with self._cond:
                self._stopping = True
                left = list(self.queue) + list(self._admitting) + list(self.rows.values())
                self.queue.clear()
                self.rows.clear()
            for handle in left:
                handle.send(("error", error))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self.queue and not self.rows and not self._admitting and not self._stopping:
                    self._refresh_expert_metrics()
                    self._cond.wait(timeout=1.0)
                if self._stopping and not self.queue and not self.rows and not self._admitting:
                    return
                room = self.batch.rows - len(self.rows) - len(self._admitting)
                if not self.rows and not self._admitting:
                    self._gather(room)
                self._drop_cancelled_queue()  # a queued client that left is never prefilled
                while self.queue and room > 0:
                    self._admitting.append(self.queue.popleft())
                    room -= 1
            self._admit_some()
            self._drop_cancelled()
            if self.rows:
                self._step()

    def _gather(self, room: int) -> None:
        """With nothing running, wait `admit_wait` seconds for more requests, and again after each that arrives
        (at most ADMIT_WAIT_ROUNDS waits, until `room` are queued), so that requests sent together, which arrive a
        few ms apart, are prefilled together; a lone request waits once. Called holding the condition."""
        started = time.monotonic()
        deadline, seen = started + self.admit_wait, len(self.queue)
        while len(self.queue) < room and not self._stopping:
            if len(self.queue) > seen:  # another arrived: wait for the rest of its wave
                seen = len(self.queue)
                deadline = min(time.monotonic() + self.admit_wait, started + ADMIT_WAIT_ROUNDS * self.admit_wait)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(timeout=left)

    def _admit_some(self) -> None:
        """Prefill windows of the requests being admitted, oldest first. While rows are decoding, the windows run
        between two of their steps hold at most `admit_tokens` prompt tokens (one window always): every prefill
        window stalls them, and a long prompt's whole prefill would stall them for seconds; with none decoding,
        every request waiting is admitted whole first. Requests whose prefill has not begun are admitted together
        where two or more fit what is left of that budget (all of them with none decoding)."""
        budget = self.admit_tokens if self.rows else None
        spent = 0
        gone = [h for h in self._admitting[1:] if h.cancelled and h.row is None]
        if gone:  # clients that left while waiting behind a long prefill: answered now, their places freed
            with self._cond:
                self._admitting = [h for h in self._admitting if h not in gone]
            for handle in gone:
                self._cancelled(handle)
        joint = True  # until a group is refused (its requests are then admitted one by one, each answered)
        while self._admitting:
            handle = self._admitting[0]
            if handle.cancelled:  # its client left (or a shutdown cut it) before or during its prefill
                self._release(handle)
                self._cancelled(handle)
            elif handle.row is None and joint and len(group := self._joinable(budget, spent)) > 1:
                joint = self._admit_together(group)
                spent += sum(len(h.job.prompt_ids) for h in group) if joint else 0
                continue  # admitted (or failed, answered) and off the list, or refused: one by one now
            elif handle.row is None and not self._begin(handle, budget):
                pass  # refused or failed: answered
            else:
                ahead = self.batch.next_window(handle.row)
                if budget is not None and spent and spent + ahead > budget:
                    return
                spent += ahead
                if not self._advance(handle):
                    continue  # more windows to go
            with self._cond:
                self._admitting.pop(0)

    def _joinable(self, budget: int | None, spent: int) -> list[Handle]:
        """The requests at the front of the admission list whose prefill has not begun, in order, as many as fit
        the prompt tokens left of `budget` between two steps (every one with no budget)."""
        group, tokens = [], 0
        for handle in self._admitting:
            tokens += len(handle.job.prompt_ids)
            if handle.row is not None or handle.cancelled or (budget is not None and spent + tokens > budget):
                break
            group.append(handle)
        return group

    def _admit_together(self, group: list[Handle]) -> bool:
        """Requests whose prefill has not begun, prefilled together: their prompts share windows (an offloaded
        expert crosses once for all of them; each gets the bits it gets alone) -> False where the engine refused
        the group (they are then admitted one by one, each answered for itself); an engine error fails them all."""
        jobs = [(h.job.prompt_ids, h.job.max_tokens, h.job.sampling, self._stop_ids(h.job)) for h in group]
        started = time.perf_counter()
        try:
            rows = self.batch.admit_together(jobs)
        except MoEPrefetchError:
            return False
        except Exception as exc:
            error = self._prefill_failed(exc)
            with self._cond:
                self._admitting = [h for h in self._admitting if h not in group]
            for handle in group:
                self._fail(handle, error)
            return True
        with self._cond:
            self.counters.prefill_seconds += time.perf_counter() - started
            self.counters.joint_admissions += 1
            self.counters.admitted_together += len(group)
            self._admitting = [h for h in self._admitting if h not in group]
        for handle, (row, first) in zip(group, rows):
            handle.row = row
            self._started(handle, first)
        return True

    def _begin(self, handle: Handle, per_window: int | None) -> bool:
        """Reserve a row for the request (False: it was refused, and answered)."""
        job = handle.job
        ok, row = self._admission_call(handle, lambda: self.batch.begin(
            job.prompt_ids, job.max_tokens, job.sampling, self._stop_ids(job), per_window=per_window))
        handle.row = row if ok else None
        return ok

    def _advance(self, handle: Handle) -> bool:
        """One prefill window of a request being admitted -> whether its admission is over (its row decodes from
        the next step on, or it failed and was answered)."""
        row = handle.row
        started = time.perf_counter()
        ok, ran = self._admission_call(handle, lambda: self.batch.advance(row))
        if not ok:
            return True
        with self._cond:
            self.counters.prefill_seconds += time.perf_counter() - started
        first = ran[1]
        if first is None:
            return False
        self._started(handle, first)
        return True

    def _started(self, handle: Handle, first: int) -> None:
        """A request's prefill is done: its row decodes from the next step on; its first token goes out."""
        handle.text = TextStream(self.tokenizer) if self.tokenizer is not None else None
        with self._cond:
            self.rows[handle.row] = handle
            self.counters.prompt_tokens += len(handle.job.prompt_ids)
        self._token(handle, first, self.batch.logprobs.get(handle.row))

    def _admission_call(self, handle: Handle, call: Callable[[], Any]) -> tuple[bool, Any]:
        """`call()` for a request being admitted -> (True, what it returned), or (False, None) once an error has
        answered the request: the engine's refusal 400; any other error 500, the request failing alone (the table
        starts cold, the running rows go on)."""
        try:
            return True, call()
        except MoEPrefetchError as exc:
            self._fail(handle, APIError(400, str(exc)))
        except Exception as exc:
            self._fail(handle, self._prefill_failed(exc))
        return False, None

    def _prefill_failed(self, exc: Exception) -> APIError:
        """An engine error in a prefill: logged, the table started cold (the running rows go on) -> the 500 that
        the requests being prefilled get."""
        logger.exception("prefill failed")
        self.batch.settle()
        return APIError(500, f"the engine failed on this request: {type(exc).__name__}: {exc}", kind="server_error")

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            new = self.batch.step()
        except Exception as exc:
            logger.exception("a decode step failed")
            error = APIError(500, f"the engine failed during decoding: {type(exc).__name__}: {exc}",
                             kind="server_error")
            for handle in list(self.rows.values()):
                self._fail(handle, error)
            self.batch.reset()
            for handle in self._admitting:  # their prefills were dropped with the table: they begin again
                handle.row = None
            return
        with self._cond:
            self.counters.decode_steps += 1
            took = time.perf_counter() - started
            self.counters.decode_seconds += took
            self.counters.recent_step_seconds.append(took)
        for row, token in new.items():
            handle = self.rows.get(row)
            if handle is not None:
                self._token(handle, token, self.batch.logprobs.get(row))
        if self.batch.steps % METRICS_EVERY_STEPS == 0:
            self._refresh_expert_metrics()

    def _token(self, handle: Handle, token: int, logprob: TokenLogprob | None = None) -> None:
        """A row's new token (with its log-probabilities when asked): text, stop strings, end of sequence,
        max_tokens."""
        handle.tokens.append(token)
        if logprob is not None:
            handle.held.append((logprob, self._text_offset(handle)))
        with self._cond:
            self.counters.completion_tokens += 1
        eos = token in self._stop_ids(handle.job)
        done = self.batch.finished(handle.row)  # end of sequence (unless ignored) or max_tokens
        if handle.text is not None:
            piece = handle.text.piece(handle.tokens, final=done)
            handle.pending_text += piece
            handle.chars += len(piece)
        stop_at = self._stop_index(handle)
        if stop_at is not None:
            # tokens whose text begins inside the stop string are cut with it, log-probabilities and all
            self._flush(handle, everything=True, stop_at=stop_at)
            self._complete(handle, "stop")
            return
        self._flush(handle, everything=done)
        if done:
            self._complete(handle, "stop" if eos else "length")

    def _text_offset(self, handle: Handle) -> int:
        """Where the latest token's text begins in the completion: the characters emitted so far, plus those of the
        tokens still held back before it: the held tokens and this one decoded together, less this one's own text,
        so a token that completes a character begins where that character does, and one after a byte that never
        completes one begins after its U+FFFD."""
        if handle.text is None:
            return 0
        unread = handle.tokens[handle.text.read :]  # the held-back tokens, then this one
        if len(unread) < 2:
            return handle.chars
        together = self.tokenizer.decode(unread, skip_special_tokens=True)
        alone = self.tokenizer.decode(unread[-1:], skip_special_tokens=True)
        return handle.chars + max(len(together) - len(alone), 0)

    def _stop_ids(self, job: Job) -> frozenset[int]:
        return frozenset() if job.ignore_eos else self.stop_ids

    @staticmethod
    def _stop_index(handle: Handle) -> int | None:
        found = [handle.pending_text.find(s) for s in handle.job.stop]
        found = [i for i in found if i >= 0]
        return min(found) if found else None

    @staticmethod
    def _held_back(handle: Handle) -> int:
        """Characters at the end of the pending text that could still become a stop string."""
        text = handle.pending_text
        for length in range(min(len(text), max((len(s) for s in handle.job.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-length:]) for s in handle.job.stop):
                return length
        return 0

    def _flush(self, handle: Handle, everything: bool, stop_at: int | None = None) -> None:
        """Send the pending text that can no longer become a stop string (all of it when `everything`; up to a stop
        string found at `stop_at`, which ends the text), with the log-probabilities of the tokens it begins."""
        emitted = handle.chars - len(handle.pending_text)  # characters already sent
        keep = 0 if everything or stop_at is not None else self._held_back(handle)
        piece = handle.pending_text[:stop_at] if stop_at is not None else \
            handle.pending_text[: len(handle.pending_text) - keep]
        handle.pending_text = handle.pending_text[len(piece):]
        # a token goes with the text it begins; one whose text has not begun yet (a byte of a character still
        # incomplete, or text held back) waits for it, unless the completion ends here without a stop string
        end = None if (everything and stop_at is None) or handle.text is None else emitted + len(piece)
        count = next((i for i, h in enumerate(handle.held) if end is not None and h[1] >= end), len(handle.held))
        sent, handle.held = handle.held[:count], ([] if stop_at is not None else handle.held[count:])
        # one event per token (streams time them), text or not, with the log-probabilities of the tokens it begins
        handle.send(("text", piece, len(handle.tokens), [h[0] for h in sent], [h[1] for h in sent]))

    def _complete(self, handle: Handle, reason: str) -> None:
        self._release(handle)
        usage = {"prompt_tokens": len(handle.job.prompt_ids), "completion_tokens": len(handle.tokens),
                 "total_tokens": len(handle.job.prompt_ids) + len(handle.tokens)}
        handle.send(("done", reason, usage))
        self._finish_counts("ok" if reason == "length" else "stopped")

    def _fail(self, handle: Handle, error: APIError) -> None:
        self._release(handle)
        handle.send(("error", error))
        self._finish_counts("failed")

    def _release(self, handle: Handle) -> None:
        if handle.row is not None:
            with self._cond:
                self.rows.pop(handle.row, None)
            self.batch.release(handle.row)
            handle.row = None

    def _drop_cancelled(self) -> None:
        for handle in [h for h in self.rows.values() if h.cancelled]:
            self._release(handle)
            self._cancelled(handle)

    def _drop_cancelled_queue(self) -> None:
        """Under the lock: queued requests whose client left leave the queue unprefilled."""
        if any(h.cancelled for h in self.queue):
            gone = [h for h in self.queue if h.cancelled]
            self.queue = deque(h for h in self.queue if not h.cancelled)
            for handle in gone:
                handle.send(("error", handle.cut or APIError(499, "the client closed the request", kind="cancelled")))
                self.counters.requests["cancelled"] += 1

    def _cancelled(self, handle: Handle) -> None:
        """A request whose client left (or that a shutdown cut): its handler, if still waiting, ends too."""
        handle.send(("error", handle.cut or APIError(499, "the client closed the request", kind="cancelled")))
        self._finish_counts("cancelled")

    def _finish_counts(self, outcome: str) -> None:
        with self._cond:
            self.counters.requests[outcome] += 1

    def _refresh_expert_metrics(self) -> None:
        """Expert cache and link figures of everything served so far (reads the device's counters once)."""
        res = self.batch.engine.residency
        by_layer = counters_by_layer(self.batch.counters(), res.layers)
        stats = Stats(per_layer={layer: LayerCounters.from_row([c[n] for n in c], res.expert_bytes,
                                                               res.cfg.chunk_bytes)
                                 for layer, c in by_layer.items()}, expert_bytes=res.expert_bytes)
        totals = stats.totals.as_dict()
        self.counters.experts = {k: totals.get(k) for k in ("expert_uses", "hits", "misses", "hit_rate",
                                                               "prefetch_issued", "prefetch_useful",
                                                               "prefetch_wasted", "bytes_h2d")}
