"""The process around the app: its address checked first, uvicorn with guarded HTTP parsing, draining on
SIGTERM, exit codes (1: the models could not be loaded; 3: the address cannot be listened on)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from service.collector import settle
from service.config import Settings
from service.serving.api.app import create_app
from service.serving.api.http11 import HttpLimits, guarded_protocol
from service.serving.listen import check_ports
from service.serving.observe.logs import setup_logging, warn_unknown_variables
from service.serving.observe.metrics import record_frozen
from service.serving.state import AppState
from service.threads import serial_tokenizer

log = logging.getLogger("service.http")
WRITE_GRACE_S = 2  # after the drain: time for handlers to write their last answers
ACCEPT_PAUSE_S = 0.001  # a front holding connections waits this long before it takes another queued one


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: readiness goes 503 and new requests get 503 while every accepted
    request is answered; then uvicorn shuts down. A second signal exits at once. With ``shared`` (a front's), its
    connections come from a listening socket every front accepts from, one connection at a time (see
    :meth:`_accept`)."""

    def __init__(self, config: uvicorn.Config, state: AppState, shared: socket.socket | None = None) -> None:
        super().__init__(config)
        self.app_state = state
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shared = shared
        self._acceptor: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self._shared is None:
            return await super().startup(sockets)
        await super().startup(sockets=[])  # the app's lifespan, and no listener of uvicorn's own
        if not self.should_exit:
            self._acceptor = asyncio.get_running_loop().create_task(self._accept(self._shared))

    async def _accept(self, sock: socket.socket) -> None:
        """Take connections from the socket every front shares, one at a time: uvloop's own server accepts every
        queued connection when it wakes, so the first front to wake took a burst of clients nearly whole (64
        connections opened at once: 58 and 6 on two fronts here; 32 queued while both were stopped: 32 and 0), and
        the fronts woken with it stayed idle. A front that holds connections already waits ``ACCEPT_PAUSE_S`` after
        taking one that was queued (a burst), so that the others take the next ones; a connection that had to be
        waited for is not followed by a pause. Each connection is served by uvicorn's protocol, as its server
        would."""
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        config = self.config
        protocol = functools.partial(config.http_protocol_class, config=config, server_state=self.server_state,
                                     app_state=self.lifespan.state)
        while True:
            try:
                try:
                    conn, _ = sock.accept()  # queued already
                    queued = True
                except BlockingIOError:
                    conn, _ = await loop.sock_accept(sock)
                    queued = False
                try:
                    await loop.connect_accepted_socket(protocol, conn, ssl=config.ssl)
                except Exception:
                    conn.close()
                    raise
            except Exception as e:  # out of file descriptors, a client gone already...: as uvicorn's server, go on
                log.warning("accepting a connection failed: %s: %s", type(e).__name__, e)
                await asyncio.sleep(0.1 if isinstance(e, OSError) and e.errno == errno.EMFILE else 0)
                continue
            if queued and len(self.server_state.connections) >= 2:
                await asyncio.sleep(ACCEPT_PAUSE_S)  # the other fronts' turn at the queue

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._acceptor is not None:  # no new connection; the front's copy of the shared socket closed
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._acceptor
        if self._shared is not None:
            self._shared.close()
        await super().shutdown(sockets)

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining or self._loop is None:
            return super().handle_exit(sig, frame)
        self._draining = True
        log.info("signal %s: draining (at most %.0f s)", sig, self.app_state.settings.drain_timeout_s)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        state = self.app_state
        state.start_draining()
        end = time.monotonic() + state.settings.drain_timeout_s
        await asyncio.sleep(0.05)  # let requests already being parsed reach the batcher
        while not state.idle and time.monotonic() < end:
            await asyncio.sleep(0.02)
        if not state.idle:
            # the deadline passed first: what has not been computed is answered 503 now (Retry-After),
            # then the handlers get a moment to write their answers
            n = state.abort("the server's drain deadline passed before this text was computed")
            log.warning("drain deadline passed: %d texts answered 503", n)
            grace = time.monotonic() + WRITE_GRACE_S
            while state.lifecycle.in_flight and time.monotonic() < grace:
                await asyncio.sleep(0.02)
        log.info("drained (%s); shutting down", "idle" if state.idle else "deadline")
        self.should_exit = True


def tune_garbage_collector() -> None:
    """Once the models have loaded: the objects alive then (the libraries' modules, the tokenizers, the app: about
    75,000 tracked here) out of the garbage collector's collections, young ones collected less often (see
    :mod:`service.collector`), and the frozen objects counted for ``routing_process_gc_frozen_objects``."""
    record_frozen(settle())


def run_server(settings: Settings) -> None:
    """Serve until SIGTERM; exit 1 if the models could not be loaded, 3 if the address cannot be bound (with several
    fronts, see :mod:`service.serving.supervisor`)."""
    if settings.workers > 1:
        from service.serving import supervisor

        supervisor.serve(settings)
    setup_logging(settings)
    warn_unknown_variables()
    check_ports(settings)
    if _serve(settings, create_app(settings)):
        sys.exit(1)


def run_front(settings: Settings, k: int, host: Path, fd: int) -> int:
    """Front ``k`` of several: the app over the engine host at ``host``, accepting from the listening socket ``fd``
    that every front shares; the exit code (1: the host's models cannot be served here)."""
    setup_logging(settings)
    return 1 if _serve(settings, create_app(settings, host=host), socket.socket(fileno=fd)) else 0


def _serve(settings: Settings, app: FastAPI, sock: socket.socket | None = None) -> bool:
    """Serve ``app`` until SIGTERM (on ``sock`` when given, else on the settings' address); True if its models could
    not be loaded."""
    serial_tokenizer()  # (read at each call of the tokenizer)
    state: AppState = app.state.app_state
    limits = HttpLimits(max_headers=settings.max_headers, max_header_bytes=settings.max_header_bytes,
                        header_timeout_s=settings.header_timeout_s)
    # the drain has answered every request before uvicorn's own graceful shutdown starts, so that one
    # only closes idle connections: a short timeout, not the drain timeout a second time
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                            http=guarded_protocol(limits, app.state.metrics), timeout_graceful_shutdown=WRITE_GRACE_S)
    server = DrainingServer(config, state, sock)

    async def main() -> None:
        async def after_loading() -> None:  # exit if the models could not load; else freeze what the start made
            while state.lifecycle.loading:
                await asyncio.sleep(0.1)
            if state.lifecycle.failed:
                server.should_exit = True
            else:
                tune_garbage_collector()

        watcher = asyncio.create_task(after_loading())
        await server.serve()
        watcher.cancel()

    # uvicorn's loop choice (uvloop where installed: less CPU per request, left to the model's threads)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(main())
    if state.lifecycle.failed:
        log.error("exiting: %s", state.lifecycle.error)
        return True
    return False
