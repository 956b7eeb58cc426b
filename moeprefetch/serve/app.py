"""The HTTP side: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, /health, Prometheus /metrics, and
server-sent events for streaming. Handlers validate, submit a `Handle` to the scheduler and relay its events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .protocol import APIError, Job, parse_chat, parse_completion
from .scheduler import Handle, Scheduler

logger = logging.getLogger(__name__)


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _choice(job: Job, text: str, reason: str | None, delta: bool) -> dict[str, Any]:
    if job.kind == "chat.completion":
        body = {"role": "assistant", "content": text} if not delta else ({"content": text} if text else {})
        return {"index": 0, "delta" if delta else "message": body, "finish_reason": reason}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


def _object(job: Job, chunk: bool) -> str:
    if job.kind == "chat.completion":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


class Server:
    """The application's state: one engine behind one scheduler."""

    def __init__(self, engine, model_name: str, scheduler: Scheduler, default_max_tokens: int = 256):
        self.engine = engine
        self.model_name = model_name
        self.scheduler = scheduler
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    # ---- routes ------------------------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                          "created": self.created, "owned_by": "moeprefetch"}]})

    async def health(self, request: Request) -> Response:
        state = self.scheduler.snapshot()
        ok = state["alive"]
        return JSONResponse({"status": "ok" if ok else "unavailable", "active": state["active"],
                             "queue_depth": state["queue_depth"]}, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus_text(self.scheduler.snapshot(), self.model_name),
                                 media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    # ---- the generation routes ---------------------------------------------------------------------------------------
    async def _generate(self, request: Request, parse) -> Response:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise APIError(400, "the request body is not valid JSON") from None
            job = parse(body, self.engine.tokenizer, self.model_name, self.default_max_tokens)
            handle = Handle(job=job, loop=asyncio.get_running_loop(), events=asyncio.Queue())
            self.scheduler.submit(handle)
        except APIError as exc:
            return _error(exc)
        if job.stream:
            # the first event decides the status: a request that fails before its first token gets its HTTP error
            first = await handle.events.get()
            if first[0] == "error":
                handle.cancelled = True
                return _error(first[1])
            return StreamingResponse(self._stream(handle, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._collect(request, handle)

    async def _collect(self, request: Request, handle: Handle) -> Response:
        job, text = handle.job, []

        async def watch_disconnect() -> None:  # nothing cancels a plain endpoint when its client leaves
            while (await request.receive())["type"] != "http.disconnect":
                pass
            handle.cancelled = True

        watcher = asyncio.create_task(watch_disconnect())
        try:
            while True:
                event = await handle.events.get()
                if event[0] == "text":
                    text.append(event[1])
                elif event[0] == "error":
                    return _error(event[1])
                else:
                    _, reason, usage = event
                    return JSONResponse({"id": job.id, "object": _object(job, False), "created": job.created,
                                         "model": self.model_name,
                                         "choices": [_choice(job, "".join(text), reason, delta=False)],
                                         "usage": usage})
        finally:
            watcher.cancel()
            handle.cancelled = True  # a client that went away frees its row at the next token boundary

    async def _stream(self, handle: Handle, first: tuple) -> AsyncIterator[str]:
        job = handle.job

        def chunk(text: str, reason: str | None) -> str:
            body = {"id": job.id, "object": _object(job, True), "created": job.created, "model": self.model_name,
                    "choices": [_choice(job, text, reason, delta=True)]}
            return f"data: {json.dumps(body)}\n\n"

        try:
            if job.kind == "chat.completion":  # the role first, as OpenAI's chat streams begin
                role = {"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                        "model": self.model_name,
                        "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
                yield f"data: {json.dumps(role)}\n\n"
            event = first
            while True:
                if event[0] == "text":  # one chunk per token, even when its text is held back or empty
                    yield chunk(event[1], None)
                elif event[0] == "error":  # after the stream began: an error event, as OpenAI's API sends
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


def prometheus_text(state: dict[str, Any], model: str) -> str:
    """The scheduler's counters in Prometheus' text format."""
    label = f'model="{model}"'
    lines = ["# HELP moeprefetch_requests_total Requests by outcome.", "# TYPE moeprefetch_requests_total counter"]
    lines += [f'moeprefetch_requests_total{{{label},outcome="{k}"}} {v}' for k, v in state["requests"].items()]
    gauges = {"queue_depth": state["queue_depth"], "active_requests": state["active"],
              "max_batch_size": state["max_batch_size"]}
    counters = {"prompt_tokens_total": state["prompt_tokens"], "completion_tokens_total": state["completion_tokens"],
                "decode_steps_total": state["decode_steps"]}
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
              drain_seconds: float = 30.0, default_max_tokens: int = 256) -> Starlette:
    """The application over a loaded engine; the scheduler starts now and drains on shutdown."""
    scheduler = Scheduler(engine, predictor, max_queue)
    server = Server(engine, model_name, scheduler, default_max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn has already waited for the requests in flight (timeout_graceful_shutdown); the rest is cancelled
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, drain_seconds)

    app = Starlette(routes=[
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.server = server
    return app
