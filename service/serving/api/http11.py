"""The HTTP/1.1 protocol the server speaks: uvicorn's httptools protocol with guards against
hostile or broken clients, answered in the service's one JSON error shape.

What the ASGI app never sees is handled here: requests the HTTP parser rejects (bad framing,
duplicate or invalid Content-Length, raw non-ASCII) get a JSON 400 instead of uvicorn's plain text;
too many or too large headers get 431 as soon as the limit is crossed; a connection whose request
headers do not arrive within ``header_timeout_s`` (idle after connecting, or trickling) gets 408 and
is closed. Every such answer carries an ``X-Request-ID`` and closes the connection.

A response's status line and headers go out with its first body bytes, in one write (uvicorn writes them apart:
two system calls and two TCP segments a response, and two wakeups of the client, where one does); a response to
a HEAD request, which has no body, goes out as uvicorn writes it.
"""

from __future__ import annotations

import json
import logging
import uuid
from asyncio import TimerHandle, Transport
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.serving.core.errors import ERROR_CODES
from service.serving.observe.metrics import Metrics

log = logging.getLogger("service.http")


@dataclass(frozen=True)
class HttpLimits:
    """Limits on a request's head: header count, header bytes (names and values), arrival time."""

    max_headers: int = 100
    max_header_bytes: int = 32768
    header_timeout_s: float = 10.0


class _HeadTooLarge(Exception):
    pass


def error_bytes(status: int, message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 response in the one JSON error shape, closing the connection."""
    body = json.dumps({"error": {"code": ERROR_CODES.get(status, "error"), "message": message}}).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n", f"content-length: {len(body)}\r\n".encode(),
             f"x-request-id: {uuid.uuid4().hex}\r\n".encode(), b"connection: close\r\n", b"\r\n"]
    return b"".join(head) + body


class _HeadWithBody:
    """A connection's transport as one response cycle writes to it: the cycle's first write (the status line and
    headers) is held and goes out with the next (the body's first bytes) as one. What a cycle does not write goes
    to the transport itself."""

    __slots__ = ("_held", "_transport")

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = data  # the head: sent with the body
            return
        if self._held:
            data, self._held = self._held + data, b""
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus head limits, a head timeout and JSON errors.

    Build a configured class with :func:`guarded_protocol`; uvicorn creates one instance per connection.
    """

    limits: ClassVar[HttpLimits] = HttpLimits()
    metrics: ClassVar[Metrics | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: TimerHandle | None = None
        self._head_count = 0
        self._head_bytes = 0
        self._problem: tuple[int, str] | None = None

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # an idle connection must send a request head in time

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_count = self._head_bytes = 0
        if self._head_timer is None:  # the next request on a kept-alive connection
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        # httptools calls this once per header, its name and value complete
        self._head_count += 1
        self._head_bytes += len(name) + len(value)
        lim = self.limits
        if self._head_count > lim.max_headers:
            self._problem = (431, f"more than {lim.max_headers} request headers")
            raise _HeadTooLarge
        if self._head_bytes > lim.max_header_bytes:
            self._problem = (431, f"request headers larger than {lim.max_header_bytes} bytes")
            raise _HeadTooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        before = self.cycle
        super().on_headers_complete()
        # a new response (an interim 100 goes alone; the answer to a HEAD is its head alone: nothing follows it)
        if self.cycle is not before and not self.expect_100_continue and self.scope["method"] != "HEAD":
            self.cycle.transport = _HeadWithBody(self.transport)  # type: ignore[assignment, union-attr]

    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn when the parser rejects the request (or a head limit was crossed)."""
        status, message = self._problem or (400, "invalid HTTP request: the request line, headers or body framing "
                                                 "could not be parsed")
        self._reject(status, message)

    def _reject(self, status: int, message: str) -> None:
        self._cancel_head_timer()
        if self.metrics is not None:
            self.metrics.failures.labels("validation").inc()
        log.info("rejected before the app: %d %s", status, message)
        if not self.transport.is_closing():
            self.transport.write(error_bytes(status, message, self.server_state.default_headers))
            self.transport.close()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered: its head arrived (pipelined data does not count)
        self._reject(408, f"request head not received within {self.limits.header_timeout_s:g} s")


def guarded_protocol(limits: HttpLimits, metrics: Metrics | None = None) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type("GuardedHttp", (GuardedHttpToolsProtocol,), {"limits": limits, "metrics": metrics})
