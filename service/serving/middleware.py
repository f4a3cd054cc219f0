"""Middleware: every request observed (request id, metrics, log line, 503 while draining), and request
bodies guarded (the size limit and the read timeout).

The whole body is read here, before the framework parses it, so that a body over the limit gets 413
whether it declares its length or streams it in chunks (a limit raised while the framework parses
would surface as a parse error), and a client that trickles its body gets 408 instead of holding a
connection and a worker forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from fastapi import Request, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.serving import errors
from service.serving.metrics import Metrics
from service.serving.state import AppState

log = logging.getLogger("service.http")
Handler = Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]


def observe(metrics: Metrics) -> Handler:
    """HTTP middleware: request id (``X-Request-ID``, the client's or a new one), in-flight count, request
    metrics and one log line per request; new inference requests get 503 once the server drains."""

    async def observing(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        state: AppState = request.app.state.app_state
        t0 = time.perf_counter()
        state.in_flight += 1
        metrics.in_flight.inc()
        status = 500
        try:
            path = request.url.path
            if state.status == "draining" and (path.startswith("/v1/") or errors.is_v2(path)):
                # requests that arrived before the drain began finish; new ones are turned away
                metrics.failures.labels("draining").inc()
                response = errors.error_response(503, errors.SHUTTING_DOWN, headers=errors.retry_after("draining"),
                                                 path=path)
            else:
                response = await call_next(request)
            status = response.status_code
        finally:
            state.in_flight -= 1
            metrics.in_flight.dec()
            route = request.scope.get("route")
            endpoint = getattr(route, "path", "unmatched")
            elapsed = time.perf_counter() - t0
            metrics.requests.labels(endpoint, str(status)).inc()
            metrics.request_duration.labels(endpoint).observe(elapsed)
            if endpoint not in ("/metrics", "/healthz", "/readyz") or status >= 400:
                log.info("%s %s %d %.1f ms", request.method, request.url.path, status, 1000 * elapsed,
                         extra={"fields": {"request_id": request_id, "method": request.method,
                                           "path": request.url.path, "status": status,
                                           "duration_ms": round(1000 * elapsed, 2)}})
        response.headers["X-Request-ID"] = request_id
        return response

    return observing


class BodyGuard:
    """413 for bodies over ``max_bytes`` (declared or streamed), 408 for bodies not received within
    ``timeout_s``; the app then gets the body as one message, and later ``receive`` calls (disconnect
    detection) go to the client as before."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._reject(scope, receive, send, 413, f"body larger than {self.max_bytes} bytes")
        chunks: list[bytes] = []
        seen = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client went away: nobody to answer
                    seen += len(message.get("body", b""))
                    if seen > self.max_bytes:
                        return await self._reject(scope, receive, send, 413,
                                                  f"body larger than {self.max_bytes} bytes")
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await self._reject(scope, receive, send, 408, f"body not received within {self.timeout_s:g} s",
                                      headers={"Connection": "close"})
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, status: int, message: str,
                      headers: dict[str, str] | None = None) -> None:
        metrics: Metrics | None = getattr(scope["app"].state, "metrics", None) if "app" in scope else None
        if metrics is not None:
            metrics.failures.labels("validation").inc()
        await errors.error_response(status, message, headers=headers, path=scope["path"])(scope, receive, send)
