"""The guarded HTTP/1.1 protocol on its own (uvicorn with a plain ASGI app): what it writes to a connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx
import pytest
import uvicorn

from service.bench.server import free_port
from service.serving.api.http11 import GuardedHttpToolsProtocol, HttpLimits


class Recorded:
    """A connection's transport that records every write."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Recording(GuardedHttpToolsProtocol):
    writes: ClassVar[list[bytes]] = []
    limits = HttpLimits()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(Recorded(transport, self.writes))


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers ``/one`` with one body message, ``/two`` with two."""
    assert scope["type"] == "http"
    length = b"10" if scope["path"] == "/two" else b"4"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", length)]})
    if scope["path"] == "/two":
        await send({"type": "http.response.body", "body": b"first ", "more_body": True})
    await send({"type": "http.response.body", "body": b"body"})


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=Recording, lifespan="off",
                                           log_config=None, access_log=False))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_a_head_request_is_answered_with_the_head_alone() -> None:
    """A HEAD's response has no body, so its head is not held for one (it was, and the client waited for ever)."""
    Recording.writes.clear()
    async with serving() as url, httpx.AsyncClient(base_url=url, timeout=5) as client:
        for _ in range(2):  # on one kept-alive connection
            r = await client.head("/one")
            assert r.status_code == 200 and r.headers["content-length"] == "4" and r.content == b""
        assert (await client.get("/one")).text == "body"  # and then a GET on it, as before
    assert [w.startswith(b"HTTP/1.1 200 OK\r\n") for w in Recording.writes] == [True] * 3
    assert Recording.writes[-1].endswith(b"\r\n\r\nbody") and not Recording.writes[0].endswith(b"body")


@pytest.mark.parametrize("path, writes", [("/one", 1), ("/two", 2)])
async def test_the_head_goes_out_with_the_first_body_bytes(path: str, writes: int) -> None:
    Recording.writes.clear()
    async with serving() as url, httpx.AsyncClient(base_url=url) as client:
        for _ in range(3):  # on one kept-alive connection
            r = await client.get(path)
            assert r.status_code == 200 and r.text == ("first body" if path == "/two" else "body")
    assert len(Recording.writes) == 3 * writes
    assert all(w.startswith(b"HTTP/1.1 200 OK\r\n") and w.endswith(b"first " if path == "/two" else b"body")
               for w in Recording.writes[::writes])
