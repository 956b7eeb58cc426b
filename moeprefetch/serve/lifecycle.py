"""uvicorn's server with the engine's drain put first: on Ctrl-C or SIGTERM the listeners stay open (new requests
get a 503 JSON error, not a refused connection) while the requests in flight finish for `drain_seconds`; those still
running then are answered 503 (a plain request) or an error event and `data: [DONE]` (a stream), and only then does
uvicorn's own shutdown close the connections. A second signal cuts the drain short the same way, joins the
scheduler thread and exits (the CLI's code 130): the engine thread is never left running into interpreter exit,
which aborted the process ('terminate called without an active exception')."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from .app import Server

logger = logging.getLogger(__name__)

ANSWER_GRACE_SECONDS = 2.0  # after the drain: for the handlers of cut requests to send their 503s and [DONE]s
# an idle keep-alive connection stays open this long. uvicorn's default (5 s) equals httpx's own idle expiry (the
# OpenAI client's), so a pooled connection could be closed by the server just as the client reused it: "Server
# disconnected without sending a response" under load (tests/test_serve.py's load test, once in six CI runs).
# Longer than the clients' expiry, the client always closes first.
KEEP_ALIVE_SECONDS = 75


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


def server_config(app, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn settings of `moeprefetch serve` (and of the tests' live server)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          timeout_keep_alive=KEEP_ALIVE_SECONDS)


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
