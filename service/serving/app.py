"""The FastAPI app, its middleware and lifespan, and the uvicorn server that drains on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response

from service import __version__
from service.config import Settings
from service.serving import errors
from service.serving.engine import device_memory
from service.serving.metrics import Metrics
from service.serving.middleware import BodyGuard
from service.serving.protocol import HttpLimits, guarded_protocol
from service.serving.routes import health, inference, kserve, models, page, v2
from service.serving.state import AppState

log = logging.getLogger("service.http")
WRITE_GRACE_S = 2  # after the drain: time for handlers to write their last answers


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if settings.log_json else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; models load in the background once it starts (see /readyz)."""
    settings = settings or Settings()
    metrics = Metrics(device_memory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state: AppState = app.state.app_state
        loader = asyncio.create_task(state.load())
        app.state.loader = loader
        try:
            yield
        finally:
            state.start_draining()
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            state.abort("server stopped")  # nothing is left after a drain; after a forced stop, answer the rest
            await state.close(timeout_s=1.0)

    app = FastAPI(title="routing-service", version=__version__, lifespan=lifespan,
                  description="Text classification with routing heads (Heinsen 2022) and end-to-end credit "
                              "assignment: which tokens, at which depth, earned each class score.")
    app.state.app_state = AppState(settings=settings, metrics=metrics)
    app.state.metrics = metrics
    errors.install(app)
    app.include_router(inference.router)
    app.include_router(kserve.router)
    app.include_router(models.router)
    app.include_router(health.router)
    app.include_router(v2.router)
    app.include_router(v2.models)
    app.include_router(page.router)
    app.mount("/static", page.static, name="static")

    # added before `observe`, so it runs inside it: its 413s get a request id and are counted
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)

    @app.middleware("http")
    async def observe(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        state: AppState = request.app.state.app_state
        t0 = time.perf_counter()
        state.in_flight += 1
        metrics.in_flight.inc()
        status = 500
        try:
            path = request.url.path
            if state.status == "draining" and (path.startswith("/v1/") or errors.is_v2(path)):
                # requests that arrived before the drain began finish; new ones are turned away
                metrics.failures.labels("draining").inc()
                response = errors.error_response(503, "server is shutting down", headers={"Retry-After": "5"},
                                                 path=path)
            else:
                response = await call_next(request)
            status = response.status_code
        finally:
            state.in_flight -= 1
            metrics.in_flight.dec()
            route = request.scope.get("route")
            endpoint = getattr(route, "path", "unmatched")
            elapsed = time.perf_counter() - t0
            metrics.requests.labels(endpoint, str(status)).inc()
            metrics.request_duration.labels(endpoint).observe(elapsed)
            if endpoint not in ("/metrics", "/healthz", "/readyz") or status >= 400:
                log.info("%s %s %d %.1f ms", request.method, request.url.path, status, 1000 * elapsed,
                         extra={"fields": {"request_id": request_id, "method": request.method,
                                           "path": request.url.path, "status": status,
                                           "duration_ms": round(1000 * elapsed, 2)}})
        response.headers["X-Request-ID"] = request_id
        return response

    return app


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: readiness goes 503 and new requests get 503 while every accepted
    request is answered; then uvicorn shuts down. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self.app_state = state
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

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
            while state.in_flight and time.monotonic() < grace:
                await asyncio.sleep(0.02)
        log.info("drained (%s); shutting down", "idle" if state.idle else "deadline")
        self.should_exit = True


def run_server(settings: Settings) -> None:
    """Serve until SIGTERM; exit 1 if the models could not be loaded."""
    setup_logging(settings)
    app = create_app(settings)
    state: AppState = app.state.app_state
    limits = HttpLimits(max_headers=settings.max_headers, max_header_bytes=settings.max_header_bytes,
                        header_timeout_s=settings.header_timeout_s)
    # the drain has answered every request before uvicorn's own graceful shutdown starts, so that one
    # only closes idle connections: a short timeout, not the drain timeout a second time
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                            http=guarded_protocol(limits, app.state.metrics), timeout_graceful_shutdown=WRITE_GRACE_S)
    server = DrainingServer(config, state)

    async def main() -> None:
        async def exit_if_load_fails() -> None:
            while state.status == "loading":
                await asyncio.sleep(0.1)
            if state.status == "failed":
                server.should_exit = True

        watcher = asyncio.create_task(exit_if_load_fails())
        await server.serve()
        watcher.cancel()

    asyncio.run(main())
    if state.status == "failed":
        log.error("exiting: %s", state.error)
        sys.exit(1)
