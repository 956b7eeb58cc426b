"""uvicorn's server with the engine's drain put first: on Ctrl-C or SIGTERM the listeners stay open (new requests
get a 503 JSON error, not a refused connection) while the requests in flight finish for `drain_seconds`; those still
running then are answered 503 (a plain request) or an error event and `data: [DONE]` (a stream), and only then does
uvicorn's own shutdown close the connections. A second signal cuts the drain short the same way, joins the
scheduler thread and exits (the CLI's code 130): the engine thread is never left running into interpreter exit,
which aborted the process ('terminate called without an active exception')."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import Server
from .guards import DEFAULT_BODY_TIMEOUT
from .protocol import APIError

logger = logging.getLogger(__name__)

ANSWER_GRACE_SECONDS = 2.0  # after the drain: for the handlers of cut requests to send their 503s and [DONE]s
# an idle keep-alive connection stays open this long. uvicorn's default (5 s) equals httpx's own idle expiry (the
# OpenAI client's), so a pooled connection could be closed by the server just as the client reused it: "Server
# disconnected without sending a response" under load (tests/test_serve.py's load test, once in six CI runs).
# Longer than the clients' expiry, the client always closes first.
KEEP_ALIVE_SECONDS = 75


def freeze_loaded_objects() -> None:
    """Move every object alive now (the loaded engine's, which live as long as a serving process) out of the cyclic
    collector's generations: its full collections, in a decode step's thread or a request's parse, then walk only
    what the requests allocate (the reference model's 342k objects: 0.14 s a full collection on the CPU, none
    frozen). Only for a process that serves one engine until it stops: frozen objects are never collected, so
    `thaw_loaded_objects` gives them back before the process ends (else their finalisers never run: Triton's
    bindings then report dozens of "leaked" objects at exit)."""
    gc.collect()
    gc.freeze()


def thaw_loaded_objects() -> None:
    gc.unfreeze()


def listen_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (in use, an address this machine lacks), or None: checked before
    the engine loads, as uvicorn binds as it does (SO_REUSEADDR), so a busy port is one sentence, not a traceback
    after a success line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: a label the resolver cannot encode ("a..b")
        return f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or 'not a host name'}"
    for family, kind, proto, _, address in infos:  # the server binds every address the name resolves to
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def server_config(app, host: str, port: int, log_level: str = "warning",
                  header_timeout: float = DEFAULT_BODY_TIMEOUT) -> uvicorn.Config:
    """The uvicorn settings of `moeprefetch serve` (and of the tests' live server): HTTP/1.1 by h11, with a request's
    headers given `header_timeout` seconds from their first byte."""
    protocol = type("HeaderDeadlineH11", (HeaderDeadline,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          timeout_keep_alive=KEEP_ALIVE_SECONDS, http=protocol)


REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                   b"content-length: %d\r\n\r\n%s")
BAD_REQUEST = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
               b"content-length: %d\r\n\r\n%s")


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on a request's headers: a client that begins a request and has not
    finished its headers `header_timeout` seconds later is answered 408 and disconnected. uvicorn stops its
    keep-alive timer at a request's first byte and bounds nothing after it, so a client trickling a header a byte at
    a time held its connection (and a worker's memory) for ever; the body has its own deadline (`read_body`)."""

    header_timeout = DEFAULT_BODY_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # the headers are in: a request runs
            self._cancel_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def on_response_complete(self) -> None:
        self._cancel_header_timer()  # a pipelined request's bytes may follow: counted from their next arrival
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def send_400_response(self, msg: str) -> None:
        """What is not HTTP/1.1 (a garbled request line, a Content-Length that is no number, a bad chunk size) gets
        a JSON error as every other refusal does; uvicorn's own answer is text/plain."""
        self._cancel_header_timer()
        if self.cycle is not None and self.cycle.response_started:  # an answer is under way: nothing may follow it
            self.transport.close()
            return
        self._answer_and_close(BAD_REQUEST, APIError(
            400, f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}); the connection closes", code="bad_request"))

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        self._answer_and_close(REQUEST_TIMEOUT, APIError(
            408, f"the request's headers did not arrive within {self.header_timeout:g} s", code="request_timeout"))

    def _answer_and_close(self, response: bytes, error: APIError) -> None:
        """An error written below the app (`response`: its status line and headers), then the connection closed."""
        body = json.dumps(error.body()).encode()
        self.transport.write(response % (len(body), body))
        self.transport.close()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.app_server = server

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal, SIGINT or SIGTERM: stop waiting for the requests in flight
            logger.warning("second signal: cutting the requests in flight")
            self.force_exit = True
            self.app_server.scheduler.cut()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        server = self.app_server
        server.draining = True
        loop = asyncio.get_running_loop()
        logger.info("draining: requests in flight may finish for %g s", server.settings.drain_seconds)
        await loop.run_in_executor(None, server.scheduler.stop, server.settings.drain_seconds)
        deadline = loop.time() + ANSWER_GRACE_SECONDS
        while self.server_state.tasks and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the app's shutdown then; it is quick now that the scheduler stopped
            await self.lifespan.shutdown()
