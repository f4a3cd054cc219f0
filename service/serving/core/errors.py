"""The errors a request can meet, as values every layer raises: :class:`APIError` carries the HTTP status a client
gets, its code and message, and the failure reason it counts under in the metrics. Each protocol gives them its own
shape (:mod:`service.serving.api.errors` for HTTP, the gRPC service its status codes)."""

from __future__ import annotations

from typing import Any

ERROR_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
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
                 reason: str | None = None, details: list[dict[str, Any]] | None = None, why: str | None = None
                 ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code or ERROR_CODES.get(status, "error")
        self.headers, self.details = headers, details
        self.reason = reason or REASONS.get(status)
        self.why = why
        """For a 503: ``overloaded``, ``loading`` or ``draining`` (APIs that tell them apart answer each its way)."""


def unavailable(message: str, why: str) -> APIError:
    """A 503 with the ``Retry-After`` for ``why`` (``overloaded``, ``loading`` or ``draining``), counted as
    ``draining`` when shutting down and ``overloaded`` otherwise."""
    return APIError(503, message, headers=retry_after(why), reason="draining" if why == "draining" else "overloaded",
                    why=why)
