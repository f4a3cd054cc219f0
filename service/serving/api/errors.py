"""One JSON error shape for every 4xx/5xx of the HTTP API: ``{"error": {"code", "message", "details"?}}``, and on the
routes of the other APIs the service speaks their own: under ``/v2`` the Open Inference Protocol's,
``{"error": "message"}`` (same status codes); on TEI's routes (and Hugging Face's ``POST /``) TEI's,
``{"error", "error_type"}`` with TEI's status codes (429 overloaded, 424 a backend failure); on vLLM's
``/classify`` vLLM's, ``{"error": {"message", "type", "param", "code"}}`` (400 for an invalid request). The handlers
give every error (ours, the framework's, an unexpected one) its route's shape and count it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.serving.core.errors import ERROR_CODES, REASONS, APIError

log = logging.getLogger("service.errors")
INTERNAL_ERROR = "internal error; the request id identifies it in the server log"  # a failure not the client's


Dialect = Literal["ours", "oip", "tei", "vllm"]
TEI_PATHS = ("/predict", "/info", "/", "/health", "/tokenize", "/decode", "/ping", "/invocations")
VLLM_PATHS = ("/classify", "/detokenize")  # and /tokenize for a body of vLLM's (see `spoken`)


def is_v2(path: str) -> bool:
    """Whether ``path`` belongs to the Open Inference Protocol v2 routes."""
    return path == "/v2" or path.startswith("/v2/")


def dialect(path: str) -> Dialect:
    """Whose API the route at ``path`` speaks (whose error shape it answers with; see :func:`spoken` for a path two
    APIs share)."""
    if is_v2(path):
        return "oip"
    if path in TEI_PATHS or path.startswith("/models/"):  # /models/{model}/predict, and Hugging Face's /models/{model}
        return "tei"
    return "vllm" if path in VLLM_PATHS else "ours"


def spoken(request: Request) -> Dialect:
    """Whose API ``request`` speaks: its route's, or at a path two APIs share (TEI's and vLLM's ``/tokenize``) the one
    its body was found to be (``request.state.dialect``, set before its body is validated)."""
    found: Dialect | None = request.scope.get("state", {}).get("dialect")
    return found or dialect(request.url.path)


def _texts(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


_BODIES: list[tuple[str, str, Callable[[dict[str, Any]], bool], frozenset[str]]] = [
    ("vllm", "a body of vLLM's or SGLang's classification API: send it to POST /classify",
     lambda b: "input" in b and "inputs" not in b, frozenset()),
    ("kserve", "a body of KServe V1: send it to POST /v1/models/{model}:predict", lambda b: "instances" in b,
     frozenset()),
    ("oip", "a body of the Open Inference Protocol: send it to POST /v2/models/{model}/infer",
     lambda b: isinstance(b.get("inputs"), list) and any(isinstance(t, dict) and "datatype" in t for t in b["inputs"]),
     frozenset()),
    ("tei", "a body of TEI's or Hugging Face's API: send it to POST /predict or POST /",
     lambda b: isinstance(b.get("inputs"), str) or ("parameters" in b and not isinstance(b.get("inputs"), list)),
     frozenset()),
    ("ours", "a body of this service's own API: send it to POST /v1/classify",
     lambda b: _texts(b.get("inputs")), frozenset({"tei"})),  # TEI's batch of texts is written as ours
]
"""Each API the server speaks: how its bodies look where they differ from the others', where it is served, and the
other APIs whose routes take that shape too."""


def elsewhere(path: str, body: object) -> str:
    """For a body refused at ``path``: `` (<whose body it is: where to send it>)`` when it has the shape of another
    of the server's APIs and not of the route's own (a client at the wrong route), else ``""``."""
    if not isinstance(body, dict):
        return ""
    own = "kserve" if path.startswith("/v1/models/") and ":" in path else dialect(path)
    if any(api == own and looks(body) for api, _, looks, _ in _BODIES):
        return ""
    hint = next((hint for api, hint, looks, also in _BODIES if own not in also and looks(body)), None)
    return f" ({hint})" if hint else ""


TEI_ERRORS = {413: "Validation", 422: "Validation", 400: "Empty", 424: "Backend", 429: "Overloaded", 503: "Unhealthy"}
"""TEI's ``error_type`` for its status codes (the service's other 4xx say ``Validation``)."""


def _tei(status: int, message: str, why: str | None) -> tuple[int, dict[str, Any]]:
    """TEI's status and body for an error the service answers ``status``: overloaded is 429, a failure of the model
    424 (a deadline passed too, as TEI has none)."""
    if status == 503 and why == "overloaded":
        status = 429
    elif status in (500, 504):
        status = 424
    return status, {"error": message, "error_type": TEI_ERRORS.get(status, "Validation")}


def _vllm(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """vLLM's status and body: an invalid request is 400, the type named from the status as vLLM names it."""
    if status == 422:
        status = 400
    try:
        phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:  # 499: a client that left (no one reads it)
        phrase = "ClientClosedRequest"
    kind = phrase if phrase.endswith("Error") else phrase + "Error"
    return status, {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None,
                   details: list[dict[str, Any]] | None = None, path: str = "", why: str | None = None,
                   shape: Dialect | None = None) -> JSONResponse:
    """The error answer for a request to ``path`` in the shape of its API (``shape``, else the route's; ``why``: a
    503's cause, see :attr:`APIError.why`)."""
    shape = shape or dialect(path)
    if shape == "oip":
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    if shape in ("tei", "vllm"):
        status, plain = _tei(status, message, why) if shape == "tei" else _vllm(status, message)
        return JSONResponse(plain, status_code=status, headers=headers)
    body: dict[str, Any] = {"code": code or ERROR_CODES.get(status, "error"), "message": message}
    if details is not None:
        body["details"] = details
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _count(request: Request, reason: str | None) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if reason and metrics is not None:
        metrics.failures.labels(reason).inc()


def _detail(error: dict[str, Any]) -> dict[str, str]:
    """A validation error as the error body's ``details`` hold it. A body that is not JSON: the framework's error
    says where (``loc``: the character) and the parser's reason (``ctx``), in a message as OIP's routes word it."""
    if error.get("type") == "json_invalid":
        at = next((p for p in error.get("loc", ()) if isinstance(p, int)), None)
        why = (error.get("ctx") or {}).get("error") or error.get("msg", "")
        why = why.removesuffix(" at")  # "Unterminated string starting at": the position follows
        return {"field": "body", "message": f"not valid JSON ({why}{'' if at is None else f' at character {at}'})",
                "type": "json_invalid"}
    return {"field": _field(tuple(error.get("loc", ()))), "message": error.get("msg", ""),
            "type": error.get("type", "")}


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def api_error(request: Request, exc: APIError) -> JSONResponse:
    """The answer to an :class:`APIError` a request met (counted under its reason; an internal one logged)."""
    _count(request, exc.reason)
    if exc.reason == "internal":
        log.error("%s %s: %s", request.method, request.url.path, exc.message)
    return error_response(exc.status, exc.message, exc.code, exc.headers, exc.details, request.url.path, exc.why,
                          spoken(request))


def install(app: FastAPI) -> None:
    """Register the handlers that give every error the one JSON shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return api_error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        _count(request, "validation")
        details = [_detail(e) for e in exc.errors()]
        message = "; ".join(f"{d['field']}: {d['message']}" for d in details) or "invalid request"
        message += elsewhere(request.url.path, exc.body)
        return error_response(422, message, details=details, path=request.url.path, shape=spoken(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400:  # an unparseable body (e.g. not UTF-8) is an invalid body like any other
            _count(request, "validation")
            why = f" ({exc.__cause__})" if exc.__cause__ is not None else ""  # not UTF-8, nested too deep, ...
            return error_response(422, f"body: {message}{why}", path=request.url.path, shape=spoken(request))
        _count(request, REASONS.get(exc.status_code))
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        headers = exc.headers  # Starlette's HTTPException always has them (None when it sets none)
        if exc.status_code == 405 and headers and "Allow" in headers:
            message = not_allowed(request, headers["Allow"])
        return error_response(exc.status_code, message, headers=headers, path=request.url.path, shape=spoken(request))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # the framework's last resort, for a failure outside the middleware that answers the app's own (`Observe`)
        _count(request, "internal")
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error(request.url.path, spoken(request))


def internal_error(path: str, shape: Dialect | None = None) -> JSONResponse:
    """The answer to a request to ``path`` that failed unexpectedly (the failure logged by the caller)."""
    return error_response(500, INTERNAL_ERROR, path=path, shape=shape)


def not_allowed(request: Request, allow: str) -> str:
    """A 405's message: the request's method, its path and the methods the route takes (its Allow header)."""
    return f"{request.method} is not allowed on {request.url.path}; use {allow}"
