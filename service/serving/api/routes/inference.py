"""``/v1`` classify and explain: for a named model, the default one, or several in one request. Envelopes
only: the pipeline is :mod:`service.serving.pipeline.inference`. The bodies are plain values encoded by msgspec
(:class:`~service.serving.api.responses.JSONBody`); the response models each route declares document them."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request

from service.serving.api.responses import JSONBody
from service.serving.api.routes.deps import State, client_gone, require_json, require_key
from service.serving.api.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    ErrorResponse,
    ExplainRequest,
    ExplainResponse,
    MultiClassifyResponse,
    MultiExplainResponse,
)
from service.serving.core.errors import APIError
from service.serving.pipeline.render import Body
from service.serving.state import AppState

ERRORS = {s: {"model": ErrorResponse} for s in (401, 404, 413, 415, 422, 503, 504)}
router = APIRouter(prefix="/v1", tags=["inference"], dependencies=[Depends(require_key), Depends(require_json)],
                   responses=ERRORS)


def _one_model(body: ClassifyRequest | ExplainRequest) -> None:
    if body.models is not None:
        raise APIError(422, "models: name several models only on /v1/classify and /v1/explain, not under "
                            "/v1/models/{model}", details=[{"field": "models", "message": "not on a model's path",
                                                            "type": "value_error"}])


def _several(state: AppState, names: list[str] | Literal["all"]) -> list[str]:
    """The models a body's ``models`` names (``"all"``: every loaded one, 404 when there is none)."""
    models = state.inference.resolve(names)
    if not models:
        raise APIError(404, 'models: "all" asks every loaded model, and no model is loaded')
    return models


async def classify(request: Request, state: AppState, models: list[str], body: ClassifyRequest) -> list[Body]:
    """Each model's classify response for ``body`` (a :class:`ClassifyResponse`'s body)."""
    await state.inference.require(models)
    results = await state.inference.classify(models, body.inputs, body.explain, body.method, body.contrast,
                                             body.timeout_s, client_gone(request), body.raw_scores, body.truncation())
    return [{"model": m, "results": r} for m, r in zip(models, results, strict=True)]


async def explain(request: Request, state: AppState, models: list[str], body: ExplainRequest) -> list[Body]:
    """Each model's explain response for ``body`` (an :class:`ExplainResponse`'s body)."""
    inf = state.inference
    await inf.require(models)
    labels = [inf.labels(m) for m in models]
    results = await inf.explain(models, body.inputs, body.target, body.method, body.contrast, body.include_matrix,
                                body.include_phi, body.timeout_s, client_gone(request), body.raw_scores,
                                body.truncation())
    return [{"model": m, "labels": ls, "results": r} for m, ls, r in zip(models, labels, results, strict=True)]


@router.post("/models/{model}/classify", response_model=ClassifyResponse, summary="Classify texts")
async def classify_model(request: Request, state: State, model: str, body: ClassifyRequest) -> JSONBody:
    """Predicted label and probabilities per text; with `explain`, token credit for the predicted label."""
    _one_model(body)
    return JSONBody((await classify(request, state, [model], body))[0])


@router.post("/models/{model}/explain", response_model=ExplainResponse, summary="Credit assignments")
async def explain_model(request: Request, state: State, model: str, body: ExplainRequest) -> JSONBody:
    """Credit per token, word, sentence and depth for the target label(s): by default each token's exact
    contribution to the (contrast) logit through the head, with the baseline it sums to the logit with."""
    _one_model(body)
    return JSONBody((await explain(request, state, [model], body))[0])


@router.post("/classify", response_model=ClassifyResponse | MultiClassifyResponse,
             summary="Classify with the default model, or several")
async def classify_default(request: Request, state: State, body: ClassifyRequest) -> JSONBody:
    """The default model's answer; with `models`, each named model's (or every loaded one's, `"all"`), the
    texts encoded once for the models on one backbone."""
    if body.models is None:
        return JSONBody((await classify(request, state, [state.default()], body))[0])
    models = _several(state, body.models)
    return JSONBody({"models": models, "responses": await classify(request, state, models, body)})


@router.post("/explain", response_model=ExplainResponse | MultiExplainResponse,
             summary="Explain with the default model, or several")
async def explain_default(request: Request, state: State, body: ExplainRequest) -> JSONBody:
    """The default model's credit; with `models`, each named model's (`target`: `"all"` or none, for each)."""
    if body.models is None:
        return JSONBody((await explain(request, state, [state.default()], body))[0])
    models = _several(state, body.models)
    return JSONBody({"models": models, "responses": await explain(request, state, models, body)})
