"""One JSON error shape for every 4xx/5xx: ``{"error": {"code", "message", "details"?}}``, and under
``/v2`` the Open Inference Protocol's own, ``{"error": "message"}`` (same status codes)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("service.errors")

CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
         408: "request_timeout", 413: "payload_too_large", 415: "unsupported_media_type", 422: "validation_error",
         429: "too_many_requests", 431: "request_header_fields_too_large", 499: "client_closed_request",
         500: "internal_error", 503: "service_unavailable", 504: "deadline_exceeded"}

# the failure reason each status counts as in routing_failures_total
REASONS = {401: "auth", 404: "validation", 405: "validation", 408: "validation", 413: "validation", 415: "validation",
           422: "validation", 499: "disconnected", 500: "internal", 504: "deadline"}


RETRY_AFTER_S = {"overloaded": 1, "loading": 5, "draining": 5}  # why a 503: when to come back
SHUTTING_DOWN = "server is shutting down"


def retry_after(why: str) -> dict[str, str]:
    """The ``Retry-After`` header of a 503 for ``why`` (a key of :data:`RETRY_AFTER_S`)."""
    return {"Retry-After": str(RETRY_AFTER_S[why])}


class APIError(Exception):
    """An error with its HTTP status, code, message and optional headers and reason."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None,
                 reason: str | None = None, details: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code or CODES.get(status, "error")
        self.headers, self.details = headers, details
        self.reason = reason or REASONS.get(status)


def is_v2(path: str) -> bool:
    """Whether ``path`` belongs to the Open Inference Protocol v2 routes."""
    return path == "/v2" or path.startswith("/v2/")


def error_response(status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None,
                   details: list[dict[str, Any]] | None = None, path: str = "") -> JSONResponse:
    """The error answer for a request to ``path``."""
    if is_v2(path):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    body: dict[str, Any] = {"code": code or CODES.get(status, "error"), "message": message}
    if details is not None:
        body["details"] = details
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _count(request: Request, reason: str | None) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if reason and metrics is not None:
        metrics.failures.labels(reason).inc()


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    """Register the handlers that give every error the one JSON shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _count(request, exc.reason)
        if exc.reason == "internal":
            log.error("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc.status, exc.message, exc.code, exc.headers, exc.details, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        _count(request, "validation")
        details = [{"field": _field(tuple(e.get("loc", ()))), "message": e.get("msg", ""), "type": e.get("type", "")}
                   for e in exc.errors()]
        message = "; ".join(f"{d['field']}: {d['message']}" for d in details) or "invalid request"
        return error_response(422, message, details=details, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400:  # an unparseable body (e.g. not UTF-8) is an invalid body like any other
            _count(request, "validation")
            return error_response(422, f"body: {message}", path=request.url.path)
        _count(request, REASONS.get(exc.status_code))
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        headers = exc.headers  # Starlette's HTTPException always has them (None when it sets none)
        if exc.status_code == 405 and headers and "Allow" in headers:
            message = not_allowed(request, headers["Allow"])
        return error_response(exc.status_code, message, headers=headers, path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        _count(request, "internal")
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error; the request id identifies it in the server log",
                              path=request.url.path)


def not_allowed(request: Request, allow: str) -> str:
    """A 405's message: the request's method, its path and the methods the route takes (its Allow header)."""
    return f"{request.method} is not allowed on {request.url.path}; use {allow}"


def unavailable(message: str, why: str) -> APIError:
    """A 503 with the ``Retry-After`` for ``why`` (``overloaded``, ``loading`` or ``draining``), counted as
    ``draining`` when shutting down and ``overloaded`` otherwise."""
    return APIError(503, message, headers=retry_after(why), reason="draining" if why == "draining" else "overloaded")
