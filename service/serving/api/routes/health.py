"""Liveness, readiness (and TEI's and vLLM's health check, which is readiness) and the Prometheus endpoint."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.serving.api.auth import check_key
from service.serving.api.routes.deps import State
from service.serving.api.routes.tei import TEIError
from service.serving.api.schemas import Health
from service.serving.core.errors import APIError, retry_after

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness")
async def healthz(state: State) -> Health:
    """200 while the process runs, whatever its state (loading, ok, draining, failed)."""
    return Health(status=state.lifecycle.status, models=sorted(state.inference.models))


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}}, summary="Readiness")
async def readyz(state: State) -> JSONResponse:
    """200 once every model is loaded and warm; 503 while loading, draining, or after a failed load."""
    life = state.lifecycle
    body = Health(status=life.status, models=sorted(state.inference.models))
    headers = None if life.ready else retry_after("draining" if life.draining else "loading")
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if life.ready else 503, headers=headers)


@router.get("/health", response_class=Response, summary="Health, as TEI and vLLM answer it",
            responses={200: {"description": "Ready: no body"}, 503: {"model": TEIError}})
async def health(state: State) -> Response:
    """TEI's and vLLM's health check, which their deployments probe: 200 with no body once every model is loaded and
    warm, 503 (TEI's error) while loading, draining, or after a failed load (`/readyz` says which)."""
    life = state.lifecycle
    if not life.ready:
        why = "draining" if life.draining else "loading"
        raise APIError(503, f"unhealthy: models are {life.describe()}", headers=retry_after(why), why=why)
    return Response(status_code=200)


# a probe or load balancer that checks with HEAD gets the same status and headers, no body (not in the schema:
# the contract documents the GET)
router.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/readyz", readyz, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
# SageMaker's health check of a container, as TEI answers it: `/health`'s answer
router.add_api_route("/ping", health, methods=["GET"], summary="SageMaker's health check (as /health)",
                     response_class=Response, responses={200: {"description": "Ready: no body"},
                                                         503: {"model": TEIError}})
router.add_api_route("/ping", health, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(state: State, authorization: Annotated[str | None, Header(include_in_schema=False)] = None
                  ) -> Response:
    if state.settings.protect_metrics:
        check_key(state, authorization)
    body = state.metrics.exposition() + await state.client.scrape()  # a front of several: the engine host's too
    return Response(body, media_type=CONTENT_TYPE_LATEST)
