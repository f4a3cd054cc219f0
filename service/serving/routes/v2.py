"""Open Inference Protocol v2 (KServe V2, Triton's HTTP/REST API), over the same batcher, limits,
deadlines, auth and metrics as ``/v1``. Errors take the protocol's shape, ``{"error": "..."}``.

Tensors of the ``infer`` endpoint: input ``text`` (BYTES ``[n]``, JSON ``data`` or the binary tensor
extension); outputs ``label`` (BYTES ``[n]``), ``probabilities`` (FP32 ``[n, n_classes]``) and, when
credit is asked for (parameter ``explain`` or any credit output named in ``outputs``), ``credit``
(FP32 ``[n, max_tokens, n_targets]``), ``tokens`` (BYTES ``[n, max_tokens]``), ``token_lengths``
(INT32 ``[n]``), ``credit_targets`` (BYTES ``[n, n_targets]``), ``logit`` and ``baseline`` (FP32
``[n, n_targets]``). Outputs are always returned as JSON ``data``.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service import __version__
from service.serving.contract import METHODS, SPLITS, CreditSpec
from service.serving.errors import APIError
from service.serving.inference import Gone, Inference, Scored
from service.serving.render import JSONBody
from service.serving.routes.deps import State, require_key
from service.serving.routes.inference import client_gone

BASIC = ("label", "probabilities")
CREDIT = ("credit", "tokens", "token_lengths", "credit_targets", "logit", "baseline")
LAYOUT = ("credit[b, p, t] is the credit of token p of text b for its t-th explained label, credit_targets[b, t], "
          "in logit units (methods contribution and end_to_end; unit-variance shares for method shares). tokens[b, "
          "p] is that token, special tokens included; beyond token_lengths[b] tokens are '' and credit 0. For "
          "methods contribution and end_to_end, sum_p credit[b, p, t] + baseline[b, t] = logit[b, t] (contrast "
          "logits by default).")
PARAMETERS = {
    "explain": "bool: add the credit outputs (also implied by naming one in `outputs`)",
    "target": "string: a label, labels separated by commas, or 'all' (default: the predicted label)",
    "method": "string: 'contribution' (default; over hidden states), 'end_to_end' (over the input tokens, through "
              "the encoder) or 'shares' (eq. 15 routing shares)",
    "contrast": "bool: explain logit_k - mean of the logits (default true) or logit_k",
    "timeout": "int: the request's deadline in microseconds (capped by the server's maximum)",
}

class ErrorV2(BaseModel):
    """The protocol's error shape."""

    error: str


ERRORS = {s: {"model": ErrorV2} for s in (400, 401, 404, 413, 422, 503, 504)}
router = APIRouter(prefix="/v2", tags=["open inference protocol v2"], responses={503: {"model": ErrorV2}})
models = APIRouter(prefix="/v2", tags=["open inference protocol v2"], dependencies=[Depends(require_key)],
                   responses=ERRORS)


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


class TensorOut(BaseModel):
    name: str
    datatype: Literal["BYTES", "FP32", "INT32"]
    shape: list[int]
    data: list[Any]


class InferResponse(BaseModel):
    model_name: str
    model_version: str = "1"
    id: str | None = None
    outputs: list[TensorOut]


def _tensor_meta(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape}


SERVER_METADATA = {"name": "routing-service", "version": __version__,
                   "extensions": ["binary_tensor_data", "model_repository", "statistics"]}


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


def metadata_of(inf: Inference, model: str) -> dict[str, Any]:
    """Model ``model``'s metadata (in memory): its tensors, labels and parameters, over REST and gRPC alike."""
    labels = inf.labels(model)
    n = len(labels)
    return {
        "name": model, "versions": ["1"], "platform": "pytorch_routing_head",
        "inputs": [_tensor_meta("text", "BYTES", [-1])],
        "outputs": [_tensor_meta("label", "BYTES", [-1]), _tensor_meta("probabilities", "FP32", [-1, n]),
                    _tensor_meta("credit", "FP32", [-1, -1, -1]), _tensor_meta("tokens", "BYTES", [-1, -1]),
                    _tensor_meta("token_lengths", "INT32", [-1]), _tensor_meta("credit_targets", "BYTES", [-1, -1]),
                    _tensor_meta("logit", "FP32", [-1, -1]), _tensor_meta("baseline", "FP32", [-1, -1])],
        "parameters": {"labels": labels, "credit_layout": LAYOUT, "request_parameters": PARAMETERS},
    }


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


async def infer_tensors(inf: Inference, model: str, texts: list[str], params: dict[str, Any],
                        wanted: list[str] | None, gone: Gone | None = None) -> list[TensorOut]:
    """The output tensors ``wanted`` (default: label and probabilities, and the credit outputs when asked) of
    ``texts`` on ``model`` (already in memory), with the request's ``parameters``: what ``infer`` answers over
    REST and gRPC alike."""
    labels = inf.labels(model)
    inf.check_limits(texts)
    spec = _credit_spec(inf, model, params)
    available = [*BASIC, *(CREDIT if spec.method in SPLITS else CREDIT[:4])]
    unknown = sorted(set(wanted or []) - set(available))
    if unknown:
        raise APIError(400, f"unknown output(s) {unknown}; with method {spec.method!r} this model gives "
                            f"{available}")
    asked = params.get("explain", False)
    if not isinstance(asked, bool):
        raise APIError(422, "parameters.explain must be a bool")
    explain = asked or any(w in CREDIT for w in wanted or [])
    timeout = params.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        raise APIError(422, "parameters.timeout must be a positive number of microseconds")
    deadline = inf.deadline(timeout / 1e6 if timeout is not None else None)
    (scored,) = await inf.run([model], texts, [spec if explain else None], deadline, gone)
    outputs = _outputs(scored, labels, explain)
    names = wanted or (available if explain else list(BASIC))
    return [outputs[n] for n in names]


def check_version(version: str) -> None:
    if version != "1":
        raise APIError(404, f"unknown model version {version!r}; the only version is '1'")


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
        raise APIError(422, problems) from None


def text_count(name: str, datatype: str, shape: list[int]) -> int:
    """The number of texts of an input tensor, which must be ``text``, BYTES, of shape ``[n]`` or ``[n, 1]``
    (over REST and gRPC alike)."""
    if name != "text" or datatype != "BYTES":
        raise APIError(400, f"expected one input named 'text' of datatype BYTES, got {name!r} {datatype}")
    n = math.prod(shape) if shape else 0
    if not shape or any(d < 0 for d in shape) or n < 1 or any(d != 1 for d in shape[1:]):
        raise APIError(400, f"input 'text' must have shape [n] (n >= 1), got {shape}")
    return n


def texts_of(items: list[Any], n: int, shape: list[int], where: str) -> list[str]:
    """The ``n`` texts of an input tensor's elements (strings, or UTF-8 bytes), each non-blank; ``where`` names the
    elements in an error (``inputs.0.data``)."""
    if len(items) != n:
        raise APIError(400, f"input 'text' has {len(items)} elements but shape {shape}")
    texts = []
    for k, item in enumerate(items):
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError:
                raise APIError(400, f"text {k} is not valid UTF-8") from None
        if not isinstance(item, str) or not item.strip():
            raise APIError(422, f"{where}.{k}: a text must be a non-blank string")
        texts.append(item)
    return texts


def _texts(tensor: TensorIn, binary: bytes) -> list[str]:
    """The input tensor's strings, from JSON ``data`` or from the binary tensor extension."""
    n = text_count(tensor.name, tensor.datatype, tensor.shape)
    size = (tensor.parameters or {}).get("binary_data_size")
    if tensor.data is not None:
        items: list[Any] = _flattened(tensor.data, tensor.shape)
    elif isinstance(size, int) and 0 <= size <= len(binary):
        items = _unpack_bytes(binary[:size])
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


def _unpack_bytes(blob: bytes) -> list[bytes]:
    """Triton's BYTES serialisation: each element is a 4-byte little-endian length, then its bytes."""
    out, k = [], 0
    while k < len(blob):
        if k + 4 > len(blob):
            raise APIError(400, "binary BYTES tensor is truncated")
        (length,) = struct.unpack_from("<I", blob, k)
        k += 4
        if k + length > len(blob):
            raise APIError(400, "binary BYTES tensor is truncated")
        out.append(blob[k : k + length])
        k += length
    return out


def _credit_spec(inf: Inference, model: str, params: dict[str, Any]) -> CreditSpec:
    method = params.get("method", "contribution")
    if method not in METHODS:
        raise APIError(422, f"parameters.method must be one of {', '.join(map(repr, METHODS))}, not {method!r}")
    contrast = params.get("contrast", True)
    if not isinstance(contrast, bool):
        raise APIError(422, "parameters.contrast must be a bool")
    target = params.get("target")
    if target is not None and not isinstance(target, str):
        raise APIError(422, "parameters.target must be a string: a label, labels separated by commas, or 'all'")
    wanted = None if target is None else target if target == "all" else [t.strip() for t in target.split(",")]
    return inf.credit_spec(model, wanted, method, contrast)


def _outputs(scored: list[Scored], labels: list[str], explain: bool) -> dict[str, TensorOut]:
    results = [s.result for s in scored]
    n = len(results)
    out = {
        "label": TensorOut(name="label", datatype="BYTES", shape=[n], data=[r.label for r in results]),
        "probabilities": TensorOut(name="probabilities", datatype="FP32", shape=[n, len(labels)],
                                   data=[r.scores[lab] for r in results for lab in labels]),
    }
    if not explain:
        return out
    credits = [r.credit for r in results if r.credit is not None]
    names = [[tok.token for tok in s.tokens or []] for s in scored]
    width = max(len(toks) for toks in names)
    t = len(credits[0].targets)  # the same count for every text of a request
    credit, tokens = [], []
    for c, toks in zip(credits, names, strict=True):
        tokens += toks + [""] * (width - len(toks))
        columns = [target.tokens for target in c.targets]
        for p in range(width):
            credit += [col[p] if p < len(col) else 0.0 for col in columns]
    out["credit"] = TensorOut(name="credit", datatype="FP32", shape=[n, width, t], data=credit)
    out["tokens"] = TensorOut(name="tokens", datatype="BYTES", shape=[n, width], data=tokens)
    out["token_lengths"] = TensorOut(name="token_lengths", datatype="INT32", shape=[n],
                                     data=[len(toks) for toks in names])
    out["credit_targets"] = TensorOut(name="credit_targets", datatype="BYTES", shape=[n, t],
                                      data=[target.label for c in credits for target in c.targets])
    if credits[0].method in SPLITS:
        out["logit"] = TensorOut(name="logit", datatype="FP32", shape=[n, t],
                                 data=[target.logit for c in credits for target in c.targets])
        out["baseline"] = TensorOut(name="baseline", datatype="FP32", shape=[n, t],
                                    data=[target.baseline for c in credits for target in c.targets])
    return out
