"""Triton's model repository extension (``/v2/repository``: index, load, unload; admin key) and statistics
extension (``/v2/models/stats``; inference key), over the engine client's model control
(:class:`~service.serving.models.control.Control`) and the inference layer's statistics. Errors take the v2
protocol's shape."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request

from service.serving.api.oip import ERRORS, ErrorV2, check_version, controlled, parameters_of, unload_parameters
from service.serving.api.routes.deps import State, require_admin, require_key
from service.serving.core.errors import APIError

repository = APIRouter(prefix="/v2/repository", tags=["model repository (v2 extension)"],
                       dependencies=[Depends(require_admin)],
                       responses={s: {"model": ErrorV2} for s in (400, 401, 403, 404, 503)})
stats = APIRouter(prefix="/v2", tags=["statistics (v2 extension)"], dependencies=[Depends(require_key)],
                  responses=ERRORS)


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object; an empty body is ``{}`` (tritonclient sends none to the index)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"body: not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError(400, "body: expected a JSON object")
    return body


@repository.post("/index", summary="Every model folder of the repository, with its state")
async def index(request: Request, state: State) -> list[dict[str, str]]:
    ready = (await _body(request)).get("ready", False)
    if not isinstance(ready, bool):
        raise APIError(400, "ready must be a bool")
    return await state.control.entries(ready_only=ready)


@repository.post("/models/{model}/load", summary="Load a model from its folder, or reload it")
async def load(request: Request, state: State, model: str) -> dict[str, Any]:
    parameters_of(await _body(request), "load", why=": a model loads from its folder in the repository")
    controlled(state)
    await state.control.load(model)
    return {}


@repository.post("/models/{model}/unload", summary="Unload a model (what it accepted is answered first)")
async def unload(request: Request, state: State, model: str) -> dict[str, Any]:
    unload_parameters(await _body(request))
    controlled(state)
    await state.control.unload(model)
    return {}


@stats.get("/models/stats", summary="Inference statistics of every model")
async def all_stats(state: State) -> dict[str, Any]:
    return await state.control.statistics(state.inference.resolve("all"))


@stats.get("/models/{model}/stats", summary="Inference statistics of one model")
@stats.get("/models/{model}/versions/{version}/stats", summary="Inference statistics of one model",
           include_in_schema=False)
async def model_stats(state: State, model: str, version: str = "1") -> dict[str, Any]:
    state.inference.group_of(model)
    check_version(version)
    return await state.control.statistics([model])
