"""The FastAPI app: routes, error handlers, middleware, and a lifespan that loads the models in the
background and, at shutdown, answers whatever is left and stops the batchers (state: ``AppState``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from service import __version__
from service.config import Settings
from service.serving.api import errors, grpc_service
from service.serving.api.direct import DirectRoutes
from service.serving.api.middleware import BodyGuard, Observe
from service.serving.api.routes import health, inference, kserve, models, page, repository, tei, tokens, v2, vllm
from service.serving.observe import tracing
from service.serving.observe.metrics import Metrics
from service.serving.state import AppState

CORS_HEADERS = ["Authorization", "Content-Type", "X-Request-ID", "traceparent", "tracestate"]
"""The request headers a page on an allowed origin may send: a key, a JSON body, its own request id, its trace."""


def warm_routes(app: FastAPI) -> None:
    """Build, at start, what the first request to each route would otherwise build: the OpenAPI document, and on
    the way each route's parameters and validators (FastAPI 0.16x builds an included router's routes at their first
    match). Measured here (medians of 5 starts): the first request to /v2/models/{model}/infer, /predict and /classify
    took 75, 48 and 30 ms against 10-12 ms for the next; after this 13, 12 and 14 ms; the first GET /openapi.json
    260 ms, then 5 ms."""
    app.openapi()


def create_app(settings: Settings | None = None, host: Path | None = None) -> FastAPI:
    """Build the app; models load in the background once it starts (see /readyz). ``host``: the engine host's
    socket, for a front of several (see :mod:`service.serving.remote.client`): its models are served there."""
    settings = settings or Settings()
    metrics = Metrics(lambda: app.state.app_state.device_memory(),  # both read at scrape time
                      lambda: app.state.app_state.backbone_processes())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state: AppState = app.state.app_state
        tracing.configure()  # before the models load: their batches' observers are traced from the start
        loader = asyncio.create_task(state.load())
        app.state.loader = loader
        await asyncio.sleep(0)  # the load started first: its backbone's process imports while this one warms up
        warm_routes(app)
        if state.host is not None:  # a front of several: it accepts once it serves (its models are the host's)
            await loader
            if state.lifecycle.failed:
                raise RuntimeError(f"the engine host's models cannot be served here: {state.lifecycle.error}")
        try:
            async with grpc_service.serving(state):
                yield
        finally:
            state.start_draining()
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            state.abort("server stopped")  # nothing is left after a drain; after a forced stop, answer the rest
            await state.close(timeout_s=1.0)
            tracing.shutdown()  # the spans still held are exported

    app = FastAPI(title="routing-service", version=__version__, lifespan=lifespan,
                  description="Text classification with routing heads (Heinsen 2022) and end-to-end credit "
                              "assignment: which tokens, at which depth, earned each class score.")
    app.state.app_state = AppState(settings=settings, metrics=metrics, host=host)
    app.state.metrics = metrics
    errors.install(app)
    app.include_router(inference.router)
    app.include_router(kserve.router)
    app.include_router(kserve.verbs)  # before /v1/models/{model}, which would take "x:verb" for a name
    app.include_router(models.router)
    app.include_router(health.router)
    app.include_router(v2.router)
    app.include_router(repository.stats)  # before /v2/models/{model}, which would take "stats" for a name
    app.include_router(repository.repository)
    app.include_router(v2.models)
    app.include_router(v2.unserved)
    app.include_router(tei.router)
    app.include_router(tei.info)
    app.include_router(vllm.router)
    app.include_router(tokens.router)
    app.include_router(page.router)
    app.mount("/static", page.static, name="static")

    # the first added, the innermost: inside the body guard (the whole body in one message), before the router
    app.add_middleware(DirectRoutes)
    # added before `Observe`, so it runs inside it: its 413s get a request id and are counted
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    if settings.cors_origins:  # outside the body guard: a preflight has no body; inside Observe: counted
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_credentials=False,
                           allow_methods=["GET", "POST"], allow_headers=CORS_HEADERS,
                           expose_headers=["X-Request-ID", "Retry-After"], max_age=600)

    # added last: the outermost, it sees every answer
    app.add_middleware(Observe, metrics=metrics, access_log=settings.access_log)
    return app
