"""GET the loaded models and their details."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends

from service.serving.api.routes.deps import State, require_key
from service.serving.api.schemas import ErrorResponse, ModelCard, ModelInfo, ModelList

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_key)],
                   responses={s: {"model": ErrorResponse} for s in (401, 404, 503)})


@router.get("/models", response_model=ModelList, summary="Loaded models")
async def list_models(state: State) -> ModelList:
    default = state.default_model
    inf = state.inference
    models = [ModelInfo(**inf.describe(name), default=name == default) for name in inf.resolve("all")]
    now = int(time.time())
    cards = [ModelCard(id=m.name, created=now, max_model_len=m.max_length)
             for m in sorted(models, key=lambda m: not m.default)]
    return ModelList(default=default, models=models, data=cards)


@router.get("/models/{model}", response_model=ModelInfo, summary="One model")
async def get_model(state: State, model: str) -> ModelInfo:
    await state.inference.require([model])  # with a head cache, a model not in memory is loaded to describe it
    return ModelInfo(**state.inference.describe(model), default=model == state.default_model)
