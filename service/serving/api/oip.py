"""The Open Inference Protocol v2 as the REST routes (:mod:`service.serving.api.routes.v2`,
:mod:`service.serving.api.routes.repository`) and the gRPC service (:mod:`service.serving.api.grpc_service`) both
speak it: a model's metadata, the ``text`` input tensor read and checked, the output tensors of ``infer`` computed
and laid out, the request parameters, and the repository extension's rules. Errors are
:class:`~service.serving.core.errors.APIError` with the status each protocol maps to its own code."""

from __future__ import annotations

import math
import struct
from typing import Any, Literal

from pydantic import BaseModel

from service import __version__
from service.modeling.encoding import Truncation
from service.serving.api.schemas import json_kind
from service.serving.core.errors import APIError
from service.serving.core.work import METHODS, SPLITS, CreditSpec
from service.serving.pipeline.inference import Gone, Inference, Scored
from service.serving.state import AppState

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
    "raw_scores": "bool: the head's logits in `probabilities` instead of probabilities (default false)",
    "truncate": "bool: cut a text longer than the model's chunk length to one chunk (default false: read whole)",
    "truncation_direction": "string: with truncate, 'right' (default: keep the beginning) or 'left' (keep the end)",
}


class ErrorV2(BaseModel):
    """The protocol's error shape."""

    error: str


ERRORS = {s: {"model": ErrorV2} for s in (400, 401, 404, 413, 422, 503, 504)}

# What to do instead of the protocol's trace settings, log settings and shared memory, which neither REST nor gRPC
# serves (REST answers them 501, gRPC UNIMPLEMENTED, both with these words)
TRACES_INSTEAD = "traces are set with the OTEL_* environment variables"
LOGGING_INSTEAD = "logging is set with ROUTING_LOG_LEVEL and ROUTING_LOG_JSON"
SHARED_MEMORY_INSTEAD = "shared memory is not supported: send the tensors in the request"


class TensorOut(BaseModel):  # an output tensor, its data as JSON (no docstring: /openapi.json stays as it was)
    name: str
    datatype: Literal["BYTES", "FP32", "INT32"]
    shape: list[int]
    data: list[Any]


def _tensor_meta(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape}


SERVER_METADATA = {"name": "routing-service", "version": __version__,
                   "extensions": ["binary_tensor_data", "model_repository", "statistics"]}


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
    raw = params.get("raw_scores", False)
    if not isinstance(raw, bool):
        raise APIError(422, "parameters.raw_scores must be a bool")
    (scored,) = await inf.run([model], texts, [spec if explain else None], deadline, gone, _truncation(params))
    outputs = _outputs(scored, labels, explain, raw)
    names = wanted or (available if explain else list(BASIC))
    return [outputs[n] for n in names]


def check_version(version: str) -> None:
    if version != "1":
        raise APIError(404, f"unknown model version {version!r}; the only version is '1'")


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


def unpack_bytes(blob: bytes) -> list[bytes]:
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


def _truncation(params: dict[str, Any]) -> Truncation | None:
    """The request's ``truncate`` and ``truncation_direction`` parameters (422 for another kind of value)."""
    truncate, side = params.get("truncate", False), params.get("truncation_direction", "right")
    if not isinstance(truncate, bool):
        raise APIError(422, "parameters.truncate must be a bool")
    if side not in ("right", "left"):
        raise APIError(422, f"parameters.truncation_direction must be 'right' or 'left', not {side!r}")
    return Truncation(side) if truncate else None


def _outputs(scored: list[Scored], labels: list[str], explain: bool, raw: bool = False) -> dict[str, TensorOut]:
    results = [s.result for s in scored]
    n = len(results)
    out = {
        "label": TensorOut(name="label", datatype="BYTES", shape=[n], data=[r.label for r in results]),
        "probabilities": TensorOut(name="probabilities", datatype="FP32", shape=[n, len(labels)],
                                   data=[v for r in results for v in r.logits] if raw else
                                   [r.scores[lab] for r in results for lab in labels]),
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


def controlled(state: AppState) -> None:
    """400 unless models may be loaded and unloaded through the API (``model_control=explicit``)."""
    mode = state.settings.model_control
    if mode != "explicit":
        raise APIError(400, f"explicit model load and unload is not allowed with model_control={mode} "
                            "(set ROUTING_MODEL_CONTROL=explicit)" + (": the repository folder is polled"
                                                                      if mode == "poll" else ""))
    if not state.lifecycle.ready:
        raise APIError(503, f"models are {state.lifecycle.describe()}")


def parameters_of(body: dict[str, Any], verb: str, accepted: frozenset[str] = frozenset(), why: str = ""
                ) -> dict[str, Any]:
    """The request's ``parameters`` (Triton's repository extension: a JSON object), or a 400 for another kind of
    value or a parameter ``verb`` does not take (``why``: what the message adds)."""
    params = body.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise APIError(400, f"parameters must be a JSON object, not {json_kind(params)}")
    unsupported = sorted(params.keys() - accepted)
    if unsupported:
        raise APIError(400, f"{verb} parameters {unsupported} are not supported{why}")
    return params


def unload_parameters(body: dict[str, Any]) -> None:
    """400 unless an unload's parameters are at most Triton's ``unload_dependents``, a bool (no model here has
    dependents to unload)."""
    params = parameters_of(body, "unload", frozenset({"unload_dependents"}))
    if not isinstance(params.get("unload_dependents", False), bool):
        raise APIError(400, "parameters.unload_dependents must be a bool")
