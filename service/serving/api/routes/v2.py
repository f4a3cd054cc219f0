"""Open Inference Protocol v2 (KServe V2, Triton's HTTP/REST API), over the same batcher, limits,
deadlines, auth and metrics as ``/v1``. Errors take the protocol's shape, ``{"error": "..."}``.

Tensors of the ``infer`` endpoint: input ``text`` (BYTES ``[n]``, JSON ``data`` or the binary tensor
extension); outputs ``label`` (BYTES ``[n]``), ``probabilities`` (FP32 ``[n, n_classes]``) and, when
credit is asked for (parameter ``explain`` or any credit output named in ``outputs``), ``credit``
(FP32 ``[n, max_tokens, n_targets]``), ``tokens`` (BYTES ``[n, max_tokens]``), ``token_lengths``
(INT32 ``[n]``), ``credit_targets`` (BYTES ``[n, n_targets]``), ``logit`` and ``baseline`` (FP32
``[n, n_targets]``). Outputs are always returned as JSON ``data``. The protocol's tensors and rules, shared
with the gRPC service, are :mod:`service.serving.api.oip`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.serving.api.errors import elsewhere
from service.serving.api.oip import (
    ERRORS,
    LOGGING_INSTEAD,
    SERVER_METADATA,
    SHARED_MEMORY_INSTEAD,
    TRACES_INSTEAD,
    ErrorV2,
    TensorOut,
    check_version,
    infer_tensors,
    metadata_of,
    text_count,
    texts_of,
    unpack_bytes,
)
from service.serving.api.responses import JSONBody
from service.serving.api.routes.deps import State, client_gone, require_key
from service.serving.core.errors import APIError

router = APIRouter(prefix="/v2", tags=["open inference protocol v2"], responses={503: {"model": ErrorV2}})
models = APIRouter(prefix="/v2", tags=["open inference protocol v2"], dependencies=[Depends(require_key)],
                   responses=ERRORS)
unserved = APIRouter(prefix="/v2", include_in_schema=False)
"""Triton's HTTP endpoints this server does not have: 501 with what to do instead (as gRPC's UNIMPLEMENTED), where
any other path is a 404 that names no alternative."""


class TensorIn(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


class OutputWanted(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    """``POST /v2/models/{model}/infer`` (the JSON part, when the binary tensor extension is used)."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    parameters: dict[str, str | bool | int | float] | None = None
    inputs: list[TensorIn] = Field(min_length=1, max_length=1)
    outputs: list[OutputWanted] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str = "1"
    id: str | None = None
    outputs: list[TensorOut]


@router.get("", summary="Server metadata")
async def server_metadata() -> dict[str, Any]:
    return SERVER_METADATA


@router.get("/health/live", summary="Server liveness")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready", summary="Server readiness (400 when not ready)", responses={400: {"model": ErrorV2}})
async def ready(state: State) -> JSONResponse:
    ready = state.lifecycle.ready
    return JSONResponse({"ready": ready}, status_code=200 if ready else 400)


@models.get("/models/{model}", summary="Model metadata")
@models.get("/models/{model}/versions/{version}", summary="Model metadata", include_in_schema=False)
async def model_metadata(state: State, model: str, version: str = "1") -> dict[str, Any]:
    await state.inference.require([model])
    check_version(version)
    return metadata_of(state.inference, model)


@models.get("/models/{model}/ready", summary="Model readiness")
@models.get("/models/{model}/versions/{version}/ready", summary="Model readiness", include_in_schema=False)
async def model_ready(state: State, model: str, version: str = "1") -> dict[str, Any]:
    await state.inference.require([model])
    check_version(version)
    return {"name": model, "ready": True}


_INFER_DOC = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": InferRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


@models.post("/models/{model}/infer", response_model=InferResponse, summary="Inference",
             openapi_extra=_INFER_DOC)
@models.post("/models/{model}/versions/{version}/infer", response_model=InferResponse, summary="Inference",
             include_in_schema=False)
async def infer(request: Request, state: State, model: str, version: str = "1") -> JSONBody:
    inf = state.inference
    inf.check_name(model)
    check_version(version)
    body, binary = await _parse(request)
    await inf.require([model])  # no await from here to the run: its head stays in memory
    texts = _texts(body.inputs[0], binary)
    wanted = [o.name for o in body.outputs] if body.outputs else None
    outputs = await infer_tensors(inf, model, texts, body.parameters or {}, wanted, client_gone(request))
    return JSONBody({"model_name": model, "model_version": "1", "id": body.id,
                     "outputs": [o.model_dump() for o in outputs]})  # an InferResponse's body


def _parsed(raw: bytes) -> object:
    """``raw`` as JSON, None where it is not (a body already refused, for :func:`elsewhere`)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


async def _parse(request: Request) -> tuple[InferRequest, bytes]:
    """The JSON part of the body and the binary part after it (binary tensor extension: the JSON is the
    first Inference-Header-Content-Length bytes)."""
    raw = await request.body()
    header = request.headers.get("inference-header-content-length")
    if header is not None and (not header.isdigit() or int(header) > len(raw)):
        raise APIError(400, f"Inference-Header-Content-Length {header!r} does not fit a body of {len(raw)} bytes")
    cut = int(header) if header is not None else len(raw)
    try:  # pydantic's JSON parser refuses what no str may hold (half a surrogate pair: '\ud800'), as /v1's does
        return InferRequest.model_validate_json(raw[:cut]), raw[cut:]
    except ValidationError as e:
        errors = e.errors()
        if errors[0]["type"] == "json_invalid":
            raise APIError(422, f"body: not valid JSON ({errors[0]['msg'].removeprefix('Invalid JSON: ')})") from None
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in errors)
        raise APIError(422, problems + elsewhere(request.url.path, _parsed(raw[:cut]))) from None


def _texts(tensor: TensorIn, binary: bytes) -> list[str]:
    """The input tensor's strings, from JSON ``data`` or from the binary tensor extension."""
    n = text_count(tensor.name, tensor.datatype, tensor.shape)
    size = (tensor.parameters or {}).get("binary_data_size")
    if tensor.data is not None:
        items: list[Any] = _flattened(tensor.data, tensor.shape)
    elif isinstance(size, int) and 0 <= size <= len(binary):
        items = unpack_bytes(binary[:size])
    else:
        raise APIError(400, "input 'text' has neither 'data' nor a binary_data_size that fits the body")
    return texts_of(items, n, tensor.shape, "inputs.0.data")


def _flattened(data: list[Any], shape: list[int]) -> list[Any]:
    """The elements of JSON tensor ``data`` in row-major order: the protocol lets a client send them flat or nested
    as the tensor's dimensions (``[["a"], ["b"]]`` for shape ``[2, 1]``); nested data must nest exactly so."""
    if not any(isinstance(item, list) for item in data):
        return data

    def walk(level: list[Any], dims: list[int]) -> list[Any]:
        if len(level) != dims[0]:
            raise APIError(400, f"input 'text' has nested data that does not match its shape {shape}")
        if len(dims) == 1:
            if any(isinstance(item, list) for item in level):
                raise APIError(400, f"input 'text' has data nested deeper than its shape {shape}")
            return level
        if not all(isinstance(item, list) for item in level):
            raise APIError(400, f"input 'text' has nested data that does not match its shape {shape}")
        return [x for item in level for x in walk(item, dims[1:])]

    return walk(data, shape)


_SHARED_MEMORY = [f"/{kind}sharedmemory{tail}" for kind in ("system", "cuda")
                  for tail in ("/status", "/region/{name}/status", "/region/{name}/register",
                               "/region/{name}/unregister", "/unregister")]
NOT_SERVED: list[tuple[str, list[str], list[str], str]] = [
    ("a model's configuration", ["GET"], ["/models/{model}/config", "/models/{model}/versions/{version}/config"],
     "a model here has no Triton model configuration; GET /v2/models/{model} gives its inputs and outputs"),
    ("generation", ["POST"], [f"/models/{{model}}{v}/{verb}" for v in ("", "/versions/{version}")
                              for verb in ("generate", "generate_stream")],
     "the models here classify text: POST /v2/models/{model}/infer"),
    ("trace setting", ["GET", "POST"], ["/trace/setting", "/models/{model}/trace/setting"], TRACES_INSTEAD),
    ("log setting", ["GET", "POST"], ["/logging"], LOGGING_INSTEAD),
    ("shared memory", ["GET", "POST"], _SHARED_MEMORY, SHARED_MEMORY_INSTEAD),
]
"""Each function of Triton's HTTP API this server does not serve: its name, methods, paths and what to do instead."""


def _not_served(what: str, instead: str) -> Callable[[], Coroutine[Any, Any, NoReturn]]:
    async def endpoint() -> NoReturn:
        raise APIError(501, f"{what} is not served by this server: {instead}")
    return endpoint


for _what, _methods, _paths, _instead in NOT_SERVED:
    for _path in _paths:
        unserved.add_api_route(_path, _not_served(_what, _instead), methods=_methods, response_model=None)
