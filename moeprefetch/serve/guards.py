"""What every request passes before a handler sees it: the Host header, the API key on /v1/*, the drain, and for
request bodies the content type, a size limit and a read timeout. Every refusal is an OpenAI-style JSON error."""

from __future__ import annotations

import asyncio
import gc
import hmac
import ipaddress
import json
import logging
import threading
from typing import Any, Callable

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from .protocol import APIError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any context this engine holds, as text or as token ids
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a whole request body to arrive
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class ErrorResponse(JSONResponse):
    """An APIError as JSON; ASCII-escaped, so that no text in a message (a client's, a template's) can fail to
    encode."""

    def __init__(self, exc: APIError):
        super().__init__(exc.body(), status_code=exc.status, headers=exc.headers or None)

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class CollectorPause:
    """Python's cyclic garbage collector held off while request bodies are decoded (re-entrant across the parse
    workers: the last one out turns it back on, if it was on). Decoding a body of many small arrays or objects
    allocates hundreds of thousands of containers, each batch of which triggers a collection that walks every
    object of the process (the engine's too): a 1 MB body of empty lists took 0.39 s to decode beside the
    reference model on the CPU, 0.012 s with the collector off, and held the interpreter, so every stream's tokens
    waited. Reference counting still frees the containers; only cycles wait for the collector's next run."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    def __enter__(self) -> "CollectorPause":
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._was_enabled:
                gc.enable()


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """Host headers a server bound to `bind_host` answers by default: a loopback bind only loopback names (a page in
    a browser cannot reach it by rebinding a DNS name to 127.0.0.1); any other bind, any name (None)."""
    if bind_host in LOOPBACK_HOSTS:
        return list(LOOPBACK_HOSTS)
    try:
        return list(LOOPBACK_HOSTS) if ipaddress.ip_address(bind_host).is_loopback else None
    except ValueError:
        return None


def _host_name(header: str) -> str:
    """A Host header's name without its port: "[::1]:8000" -> "::1", "Example.com:80" -> "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: refuses a foreign Host header (400), a missing or wrong API key on /v1/* (401) and, while the
    server drains, new /v1/* requests (503), each with a JSON body; everything else goes on to the app."""

    def __init__(self, app, api_key: str | None, allowed_hosts: list[str] | None, draining: Callable[[], bool],
                 refused: Callable[[int], None] = lambda status: None):
        self.app = app
        self.refused = refused  # counts each refusal by status (the server's metrics)
        self.key = api_key.encode() if api_key else None
        self.hosts = None if allowed_hosts is None or "*" in allowed_hosts else {h.lower() for h in allowed_hosts}
        self.draining = draining

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                self.refused(refusal.status)
                await ErrorResponse(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> APIError | None:
        headers = Headers(scope=scope)
        if self.hosts is not None and _host_name(headers.get("host", "")) not in self.hosts:
            return APIError(400, f"the Host header {headers.get('host', '')!r} is not one this server answers to "
                                 "(see --allowed-hosts)", code="invalid_host")
        if not scope["path"].startswith("/v1/"):
            return None
        if self.key is not None:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            # compare_digest: the time taken tells nothing about how much of a guess was right
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.key):
                return APIError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if self.draining():
            return APIError(503, "the server is shutting down and takes no new requests", kind="server_error",
                            headers={"Retry-After": "1", "Connection": "close"})
        return None


DRAIN_POLL_SECONDS = 0.1  # how soon a body still arriving notices that the server began to shut down


async def read_body(request: Request, max_bytes: int, timeout: float,
                    limit: str = "this server's limit of {max_bytes} bytes (see --max-body-bytes)",
                    draining: Callable[[], bool] | None = None) -> bytes | None:
    """The request's JSON body, checked: 415 if it is not declared JSON, 413 past `max_bytes` (from Content-Length
    before any byte is read, else as it arrives; `limit` says whose limit that is), 408 if it has not all come within
    `timeout` seconds, 503 once `draining()` says a shutdown began (the request was never taken: the client may
    retry elsewhere, and uvicorn's own shutdown would otherwise cut the upload with a text/plain 500); None if the
    client went away meanwhile (logged in one line: nobody is left to answer)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the request body must be sent as Content-Type: application/json, not "
                            f"{media_type or 'none'!r}", code="unsupported_media_type")
    too_large = APIError(413, f"the request body is larger than {limit.format(max_bytes=max_bytes)}",
                         code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks: list[bytes] = []

    async def arrive() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    task = asyncio.ensure_future(arrive())
    try:
        while not task.done():
            if draining is not None and draining():
                raise APIError(503, "the server is shutting down and takes no new requests", kind="server_error",
                               headers={"Retry-After": "1", "Connection": "close"})
            if loop.time() >= deadline:
                raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
                               headers={"Connection": "close"})
            await asyncio.wait({task}, timeout=min(DRAIN_POLL_SECONDS, max(deadline - loop.time(), 0.0)))
        task.result()  # 413 as it arrived, or the client's disconnect
    except ClientDisconnect:
        logger.info("a client went away while sending its request body to %s (%d bytes received)",
                    request.url.path, sum(map(len, chunks)))
        return None
    finally:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved (413, a disconnect), so asyncio never logs it as lost
        task.cancel()  # done already, or abandoned by a 408, a 503 or the handler's own cancellation
    return b"".join(chunks)
