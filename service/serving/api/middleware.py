"""Middleware: every request observed (request id, metrics, 503 while draining, a log line for those answered with
an error, or for every one with ``access_log``), and request bodies guarded (the size limit and the read timeout)
and decompressed.

The whole body is read here, before the framework parses it, so that a body over the limit gets 413
whether it declares its length or streams it in chunks (a limit raised while the framework parses
would surface as a parse error), and a client that trickles its body gets 408 instead of holding a
connection and a worker forever.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
import zlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.serving.api import errors
from service.serving.core.errors import SHUTTING_DOWN, retry_after
from service.serving.observe import tracing
from service.serving.observe.metrics import Metrics
from service.serving.state import AppState

log = logging.getLogger("service.http")
CLIENT_CLOSED = 499  # what a request whose client left before any response is recorded as
_ID_PREFIX = uuid.uuid4().hex[:20]  # a request id: 80 random bits per process, then a 48-bit count (32 hex digits;
_ID_COUNT = itertools.count()  # a uuid4 per request read the OS's random source, 27 us a request here)


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNT) % (1 << 48):012x}"


MAX_REQUEST_ID = 200  # characters of a client's X-Request-ID kept (echoed, and logged with the request's errors)
_UNPRINTABLE = bytes(c for c in range(256) if not 0x21 <= c <= 0x7E)  # left out of a client's X-Request-ID


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-ID`` (printable ASCII, at most ``MAX_REQUEST_ID`` characters; anything else
    is left out), or a new one when it sends none that is usable."""
    given = next((v for k, v in headers if k == b"x-request-id"), b"")
    kept = given[:MAX_REQUEST_ID].translate(None, _UNPRINTABLE).decode("ascii")
    return kept or new_request_id()


PROBES = frozenset({"/metrics", "/healthz", "/readyz", "/health", "/ping"})
"""The routes probes and scrapers call every few seconds: left out of the access log (an error is logged still)."""


class Observe:
    """Every HTTP request: a request id (``X-Request-ID``, the client's or a new one; the routes read it as
    ``request.state.request_id``), the in-flight count and
    request metrics; one log line for a request answered with an error (4xx, 5xx), or with ``access_log`` for every
    request but the probes; new inference requests get 503 once the server drains; a request the app fails on
    unexpectedly, before answering, gets its route's 500 here (logged with its request id).
    Plain ASGI (no per-request task or stream, unlike ``BaseHTTPMiddleware``): it runs on every request, and a
    request answered well costs it two counters and a histogram, no log record."""

    def __init__(self, app: ASGIApp, metrics: Metrics, access_log: bool = False) -> None:
        self.app, self.metrics, self.access_log = app, metrics, access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        m = self.metrics
        request_id = request_id_of(scope["headers"])
        scope.setdefault("state", {})["request_id"] = request_id  # the server's copy of its lifespan state
        state: AppState = scope["app"].state.app_state
        path, method = scope["path"], scope["method"]
        status: int | None = None  # until the app starts a response
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("ascii"))]
            await send(message)

        life = state.lifecycle
        life.in_flight += 1
        m.in_flight.inc()
        traced = tracing.start_request(scope["headers"], method, path, request_id)  # None: tracing is off
        try:
            if life.draining and (path.startswith("/v1/") or (errors.dialect(path) != "ours"
                                                             and (path != "/" or method == "POST"))):
                # requests that arrived before the drain began finish; new ones are turned away
                m.failures.labels("draining").inc()
                response = errors.error_response(503, SHUTTING_DOWN, headers=retry_after("draining"),
                                                 path=path)
                await response(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception:
            if status is not None:  # it failed while answering: the framework's server closes the connection
                raise
            # it failed before answering: answered here, where the answer gets the request id and is recorded as
            # sent (a TEI route's 424), and the connection stays open (an error escaping to the framework's server
            # makes it log the traceback again and drop the connection, which the client's next request met)
            log.exception("unhandled error on %s %s (request %s)", method, path, request_id,
                          extra={"fields": {"request_id": request_id}})
            m.failures.labels("internal").inc()
            await errors.internal_error(path, scope["state"].get("dialect"))(scope, receive, send_with_id)
        finally:
            life.in_flight -= 1
            m.in_flight.dec()
            if status is None:  # no response was started: the client went away first (nginx's 499), no 500
                status = CLIENT_CLOSED
                m.failures.labels("disconnected").inc()
            endpoint = getattr(scope.get("route"), "path", "unmatched")
            tracing.end_request(traced, endpoint if endpoint != "unmatched" else None, status)
            elapsed = time.perf_counter() - t0
            m.served(endpoint, status, elapsed)
            if status >= 400 or (self.access_log and endpoint not in PROBES):
                log.info("%s %s %d %.1f ms (request %s)", method, path, status, 1000 * elapsed, request_id,
                         extra={"fields": {"request_id": request_id, "method": method, "path": path,
                                           "status": status, "duration_ms": round(1000 * elapsed, 2)}})


DECODED = (b"gzip", b"x-gzip", b"deflate")
"""The ``Content-Encoding``s a body may come in (as Triton takes them, and tritonclient's
``request_compression_algorithm`` sends them); ``deflate`` is the zlib format (RFC 9110 §8.4.1.2)."""


class TooLarge(Exception):
    """A compressed body that decompresses to more than the limit."""


def inflate(data: bytes, limit: int) -> bytes:
    """A gzip or zlib stream (its header says which) decompressed, never past ``limit`` bytes (a small body that
    would decompress to gigabytes is stopped there).

    Raises:
        TooLarge: it decompresses to more than ``limit`` bytes.
        zlib.error: it is not one whole stream of either format.
    """
    stream = zlib.decompressobj(wbits=32 + zlib.MAX_WBITS)
    out = stream.decompress(data, limit + 1)
    if len(out) > limit:
        raise TooLarge
    if not stream.eof:
        raise zlib.error("the stream ends before its end")
    if stream.unused_data:
        raise zlib.error("data after the end of the stream")
    return out


class BodyGuard:
    """413 for bodies over ``max_bytes`` (declared or streamed, and once decompressed), 408 for bodies not received
    within ``timeout_s``; a body in gzip or deflate (:data:`DECODED`) is decompressed (400 when it is not valid),
    another ``Content-Encoding`` is a 415 (RFC 9110 §15.5.16, with ``Accept-Encoding``). The app then gets the body
    as one message, uncompressed and its ``Content-Encoding`` gone, and later ``receive`` calls (disconnect
    detection) go to the client as before."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-length"), None)
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
        data = b"".join(chunks)
        coding = next((v for k, v in scope["headers"] if k == b"content-encoding"), b"identity").strip().lower()
        if coding not in (b"identity", b""):  # read first: the connection serves on
            name = coding.decode("latin-1")
            if coding not in DECODED:
                return await self._reject(scope, receive, send, 415, f"Content-Encoding {name!r} is not supported: "
                                          "send the body in gzip or deflate, or uncompressed",
                                          headers={"Accept-Encoding": "gzip, deflate"})
            try:
                data = inflate(data, self.max_bytes)
            except TooLarge:
                return await self._reject(scope, receive, send, 413,
                                          f"body larger than {self.max_bytes} bytes once decompressed")
            except zlib.error as e:
                return await self._reject(scope, receive, send, 400, f"body: not valid {name} ({e})")
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                          if k not in (b"content-encoding", b"content-length")]}
        body = {"type": "http.request", "body": data, "more_body": False}
        await self.app(scope, given_first(body, receive), send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, status: int, message: str,
                      headers: dict[str, str] | None = None) -> None:
        metrics: Metrics | None = getattr(scope["app"].state, "metrics", None) if "app" in scope else None
        if metrics is not None:
            metrics.failures.labels("validation").inc()
        await errors.error_response(status, message, headers=headers, path=scope["path"])(scope, receive, send)


def given_first(first: Message, receive: Receive) -> Receive:
    """``receive`` with ``first`` (a message already read: the whole body) given once before it."""
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()

    return again
