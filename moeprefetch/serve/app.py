"""The HTTP side: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, /health, Prometheus /metrics, and
server-sent events for streaming. Handlers read and check the body (`guards`), parse it into a `Job` in a worker
thread, submit a `Handle` to the scheduler and relay its events. Every error, a route's 404 and 405 included, is an
OpenAI-style JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..sampling import TokenLogprob
from .guards import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, CollectorPause, ErrorResponse, Guard, read_body
from .protocol import FALLBACK_CHAT_END, FALLBACK_CHAT_LINE, APIError, Job, Limits, decode_body, parse_chat, \
    parse_completion
from .logprobs import chat_logprobs, completion_logprobs
from .scheduler import ADMIT_TOKENS, ADMIT_WAIT_SECONDS, Handle, Scheduler

logger = logging.getLogger(__name__)

PARSE_WORKERS = 2  # threads that decode JSON and tokenise prompts, off the event loop


@dataclass(frozen=True)
class Settings:
    """The HTTP side's options (`moeprefetch serve --help` says what each does)."""

    drain_seconds: float = 30.0
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host header
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT


def _choice(job: Job, text: str, reason: str | None, delta: bool, logprobs: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    if job.kind == "chat.completion":
        body = {"role": "assistant", "content": text} if not delta else ({"content": text} if text else {})
        return {"index": 0, "delta" if delta else "message": body, "logprobs": logprobs, "finish_reason": reason}
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}


def _logprobs(job: Job, entries: list[TokenLogprob], offsets: list[int], tokenizer: Any) -> dict[str, Any] | None:
    """The choice's logprobs object for these tokens at these offsets in the completion's text (None when the
    request did not ask); completions' offsets count the echoed prompt too."""
    if job.sampling.logprobs is None:
        return None
    if job.kind == "chat.completion":
        return chat_logprobs(entries, tokenizer)
    return completion_logprobs(entries, [len(job.echo) + o for o in offsets], tokenizer)


def _object(job: Job, chunk: bool) -> str:
    if job.kind == "chat.completion":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def limits_of(engine, scheduler: Scheduler, model_name: str, default_max_tokens: int) -> Limits:
    """What requests may ask of this engine: its context, the positions a decode step adds, the longest token."""
    tokenizer, longest = engine.tokenizer, None
    if tokenizer is not None and hasattr(tokenizer, "get_vocab"):
        longest = max(map(len, tokenizer.get_vocab()), default=None)
    return Limits(model=model_name, context=engine.options.max_seq_len,
                  reserve=1 + max(1, scheduler.batch.spec.chain),  # as the engine's own check counts them
                  max_token_chars=longest, default_max_tokens=default_max_tokens, vocab=engine.args.vocab_size)


class Server:
    """The application's state: one engine behind one scheduler."""

    def __init__(self, engine, model_name: str, scheduler: Scheduler, default_max_tokens: int = 256,
                 settings: Settings | None = None):
        self.engine = engine
        self.model_name = model_name
        self.scheduler = scheduler
        self.settings = settings or Settings()
        self.limits = limits_of(engine, scheduler, model_name, default_max_tokens)
        self.created = int(time.time())
        self.draining = False  # set when a shutdown begins: new /v1 requests get 503
        # requests answered with an error before the scheduler saw them, by HTTP status (the event loop's alone)
        self.refused: Counter[int] = Counter()
        self.workers = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="moeprefetch-parse")
        self.collector_pause = CollectorPause()
        tokenizer = engine.tokenizer
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            logger.warning("the tokenizer has no chat template: /v1/chat/completions renders messages as %r lines "
                           "ending in %r", FALLBACK_CHAT_LINE.strip(), FALLBACK_CHAT_END)

    # ---- routes ------------------------------------------------------------------------------------------------------
    def _card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moeprefetch"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        if not name:  # /v1/models/: the list, as /v1/models
            return await self.models(request)
        if name != self.model_name:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_name!r}",
                           "model", "not_found_error", code="model_not_found")
        return JSONResponse(self._card())

    async def health(self, request: Request) -> Response:
        state = self.scheduler.snapshot()
        status = "draining" if self.draining else "ok" if state["alive"] else "unavailable"
        return JSONResponse({"status": status, "active": state["active"], "queue_depth": state["queue_depth"]},
                            status_code=200 if status == "ok" else 503)

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus_text(self.scheduler.snapshot(), self.model_name, self.refused),
                                 media_type="text/plain; version=0.0.4")

    def count_refusal(self, status: int) -> None:
        self.refused[status] += 1

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    # ---- the generation routes ---------------------------------------------------------------------------------------
    def _parse(self, raw: bytes, parse) -> Job:
        with self.collector_pause:
            body = decode_body(raw)
        return parse(body, self.engine.tokenizer, self.limits)

    async def _generate(self, request: Request, parse) -> Response:
        try:
            handle = await self._submit(request, parse)
        except APIError as exc:
            if exc.status != 429:  # the scheduler counts its own refusals (rejected)
                self.count_refusal(exc.status)
            raise
        if handle is None:  # the client left during its upload: nobody reads an answer
            return Response(status_code=400)
        job = handle.job
        # watched from now on: a queued request whose client left is dropped before its prefill
        watcher = asyncio.create_task(self._watch_disconnect(request, handle))
        streaming = False
        try:
            if not job.stream:
                return await self._collect(handle)
            first = await handle.events.get()  # the first event decides the status
            if first[0] == "error":  # a request that fails before its first token gets its HTTP error
                raise first[1]
            streaming = True
            # the background task runs even when the client leaves before the stream's first chunk
            return StreamingResponse(self._stream(handle, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(self._release, handle))
        finally:
            watcher.cancel()  # a streaming response watches the client itself
            if not streaming:
                handle.cancelled = True  # a client that went away frees its row at the next token boundary

    async def _submit(self, request: Request, parse) -> Handle | None:
        """The request's body read, parsed and queued (None: the client left during its upload)."""
        largest = self.limits.largest_body
        if largest < self.settings.max_body_bytes:
            raw = await read_body(request, largest, self.settings.body_timeout,
                                  f"any request this model could accept ({{max_bytes}} bytes at most: its context is "
                                  f"max_seq_len={self.limits.context} tokens)", draining=lambda: self.draining)
        else:
            raw = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout,
                                  draining=lambda: self.draining)
        if raw is None:
            return None
        loop = asyncio.get_running_loop()
        # JSON decoding and tokenisation off the event loop: a long prompt must not stall every stream
        job = await loop.run_in_executor(self.workers, self._parse, raw, parse)
        handle = Handle(job=job, loop=loop, events=asyncio.Queue())
        self.scheduler.submit(handle)
        return handle

    @staticmethod
    async def _release(handle: Handle) -> None:
        handle.cancelled = True

    @staticmethod
    async def _watch_disconnect(request: Request, handle: Handle) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        handle.cancelled = True

    async def _collect(self, handle: Handle) -> Response:
        job, text, entries, offsets = handle.job, [handle.job.echo], [], []
        while True:
            event = await handle.events.get()
            if event[0] == "text":
                text.append(event[1])
                entries += event[3]
                offsets += event[4]
            elif event[0] == "error":
                raise event[1]
            else:
                _, reason, usage = event
                logprobs = _logprobs(job, entries, offsets, self.engine.tokenizer)
                return JSONResponse({"id": job.id, "object": _object(job, False), "created": job.created,
                                     "model": self.model_name,
                                     "choices": [_choice(job, "".join(text), reason, False, logprobs)],
                                     "usage": usage})

    async def _stream(self, handle: Handle, first: tuple) -> AsyncIterator[str]:
        job = handle.job

        def chunk(text: str, reason: str | None, entries: list[TokenLogprob] = (), offsets: list[int] = ()) -> str:
            # a request that asked gets the object in every chunk, empty while its tokens' text is held back
            logprobs = _logprobs(job, list(entries), list(offsets), self.engine.tokenizer)
            body = {"id": job.id, "object": _object(job, True), "created": job.created, "model": self.model_name,
                    "choices": [_choice(job, text, reason, True, logprobs)]}
            if job.include_usage:  # as OpenAI: every chunk carries the field, null until the last one
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        try:
            if job.kind == "chat.completion":  # the role first, as OpenAI's chat streams begin
                role = {"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                        "model": self.model_name,
                        "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
                yield f"data: {json.dumps(role)}\n\n"
            if job.echo:
                yield chunk(job.echo, None)
            event = first
            while True:
                if event[0] == "text":  # one chunk per token, even when its text is held back or empty
                    yield chunk(event[1], None, event[3], event[4])
                elif event[0] == "error":  # after the stream began (a shutdown's cut too): an error event
                    yield f"data: {json.dumps(event[1].body())}\n\n"
                    break
                else:
                    yield chunk("", event[1])
                    if job.include_usage:
                        usage = {"id": job.id, "object": _object(job, True), "created": job.created,
                                 "model": self.model_name, "choices": [], "usage": event[2]}
                        yield f"data: {json.dumps(usage)}\n\n"
                    break
                event = await handle.events.get()
            yield "data: [DONE]\n\n"
        finally:
            handle.cancelled = True


# ---- errors as JSON ----------------------------------------------------------------------------------------------
async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return ErrorResponse(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    request.app.state.server.count_refusal(exc.status_code)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"there is no route {where}; the API lives under /v1 (/v1/completions, /v1/chat/completions, " \
                  "/v1/models)"
    elif exc.status_code == 405:
        message = f"{where} is not allowed; this path takes {(exc.headers or {}).get('Allow', 'other methods')}"
    else:
        message = f"{where}: {exc.detail}"
    return ErrorResponse(APIError(exc.status_code, message, headers=dict(exc.headers or {})))


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug's 500 (Starlette logs its traceback after this answer)."""
    return ErrorResponse(APIError(500, f"the server failed on this request: {type(exc).__name__}: {exc}",
                                  kind="server_error"))


def prometheus_text(state: dict[str, Any], model: str, refused: dict[int, int] | None = None) -> str:
    """The scheduler's counters in Prometheus' text format; `refused`: requests answered with an error before the
    scheduler saw them, by HTTP status."""
    label = f'model="{model}"'
    lines = ["# HELP moeprefetch_requests_total Requests by outcome (refused: by HTTP status, before the scheduler "
             "saw them).", "# TYPE moeprefetch_requests_total counter"]
    lines += [f'moeprefetch_requests_total{{{label},outcome="{k}"}} {v}' for k, v in state["requests"].items()]
    lines += [f'moeprefetch_requests_total{{{label},outcome="refused",status="{status}"}} {n}'
              for status, n in sorted((refused or {}).items())]
    # admitting: taken off the queue, their prompts' prefill under way (a long one a window between steps)
    gauges = {"queue_depth": state["queue_depth"], "active_requests": state["active"],
              "admitting_requests": state["admitting"], "max_batch_size": state["max_batch_size"]}
    counters = {"prompt_tokens_total": state["prompt_tokens"], "completion_tokens_total": state["completion_tokens"],
                "decode_steps_total": state["decode_steps"], "prefill_seconds_total": state["prefill_seconds"],
                "decode_seconds_total": state["decode_seconds"],
                "requests_admitted_together_total": state["admitted_together"],
                "joint_admissions_total": state["joint_admissions"]}
    experts = state["experts"]  # the residency's counters, refreshed every few steps and when idle
    counters.update({
        "expert_uses_total": experts.get("expert_uses") or 0, "expert_hits_total": experts.get("hits") or 0,
        "expert_misses_total": experts.get("misses") or 0,
        "prefetch_issued_total": experts.get("prefetch_issued") or 0,
        "prefetch_useful_total": experts.get("prefetch_useful") or 0,
        "prefetch_wasted_total": experts.get("prefetch_wasted") or 0,
        "link_bytes_total": experts.get("bytes_h2d") or 0})
    gauges["expert_hit_rate"] = experts.get("hit_rate") or 0.0
    for name, value in gauges.items():
        lines += [f"# TYPE moeprefetch_{name} gauge", f"moeprefetch_{name}{{{label}}} {value}"]
    for name, value in counters.items():
        lines += [f"# TYPE moeprefetch_{name} counter", f"moeprefetch_{name}{{{label}}} {value}"]
    return "\n".join(lines) + "\n"


def build_app(engine, model_name: str, predictor: str | None = None, max_queue: int = 64,
              drain_seconds: float = 30.0, default_max_tokens: int = 256, *, api_key: str | None = None,
              allowed_hosts: list[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              body_timeout: float = DEFAULT_BODY_TIMEOUT, batch_invariant: bool = False,
              prefill_tokens_per_step: int = ADMIT_TOKENS, admit_wait: float = ADMIT_WAIT_SECONDS) -> Starlette:
    """The application over a loaded engine; the scheduler starts now and drains on shutdown (a `DrainingServer`
    drains it earlier, while the listeners still answer 503)."""
    scheduler = Scheduler(engine, predictor, max_queue, batch_invariant, prefill_tokens_per_step, admit_wait)
    settings = Settings(drain_seconds, api_key, tuple(allowed_hosts) if allowed_hosts is not None else None,
                        max_body_bytes, body_timeout)
    server = Server(engine, model_name, scheduler, default_max_tokens, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.draining = True
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, drain_seconds)
        server.workers.shutdown(wait=False, cancel_futures=True)

    app = Starlette(routes=[
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ], middleware=[Middleware(Guard, api_key=api_key, allowed_hosts=settings.allowed_hosts,
                              draining=lambda: server.draining, refused=server.count_refusal)],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan)
    # a path with a trailing slash is not redirected (a 307 with an empty body reads as no answer to a POST): it is
    # served where a route takes it (/v1/models/), else it is a JSON 404
    app.router.redirect_slashes = False
    app.state.server = server
    return app
