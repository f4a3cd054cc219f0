"""A request whose handling fails unexpectedly (a bug, not a client's error): answered 500 in its route's error
shape (TEI's 424) with its request id, logged once with that id, recorded as the status the client got, and the
client's kept-alive connection still serves its next request; over gRPC, INTERNAL with the same message (no
internals) and the request id in the trailing metadata."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import grpc
import httpx
import pytest
import uvicorn
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from service.config import Settings
from service.serving.api.app import create_app
from service.serving.api.errors import INTERNAL_ERROR
from service.serving.api.http11 import HttpLimits, guarded_protocol
from service.serving.pipeline.inference import Inference
from tests.serving.server import free_port, metric


async def fails(*args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError("a bug in the pipeline")


@contextlib.asynccontextmanager
async def serving(repo: Path, grpc_port: int = 0) -> AsyncIterator[str]:
    """The app over ``repo`` in this process, served by uvicorn with the server's HTTP/1.1 protocol (its models
    loaded), and over gRPC on ``grpc_port`` unless it is 0."""
    port = free_port()
    app = create_app(Settings(model_repository=repo, default_model="tiny", model_process=False, grpc_port=grpc_port,
                              max_wait_ms=0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False,
                                           http=guarded_protocol(HttpLimits(), app.state.metrics)))
    task = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for _ in range(600):
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        await task


async def on_one_connection(url: str, requests: list[tuple[str, bytes, str]]) -> list[tuple[int, bytes]]:
    """Each (path, JSON body, request id) posted in turn on one HTTP/1.1 connection: its statuses and bodies (a
    request the server closed the connection before answering: status 0)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    out = []
    for path, body, rid in requests:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nX-Request-ID: "
                     f"{rid}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            out.append((0, b""))
            continue
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (x.partition(": ") for x in lines[1:]) if k.lower() == "content-length")
        out.append((int(lines[0].split()[1]), await reader.readexactly(length)))
    writer.close()
    return out


async def test_an_unexpected_failure_is_answered_with_its_request_id_and_the_connection_kept(
        tiny_repo: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(Inference, "score", fails)  # TEI's /predict
    monkeypatch.setattr(Inference, "classify", fails)  # /v1/classify
    caplog.set_level(logging.INFO)
    async with serving(tiny_repo) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        for k, (path, body, status) in enumerate([("/predict", {"inputs": "a text"}, 424),
                                                  ("/v1/classify", {"inputs": ["a text"]}, 500)]):
            rid = f"failing-{k}"
            r = await client.post(path, json=body, headers={"X-Request-ID": rid})
            assert r.status_code == status and r.headers["x-request-id"] == rid, (path, r.text)
            message = r.json()["error"] if status == 424 else r.json()["error"]["message"]
            assert message == "internal error; the request id identifies it in the server log"
            logged = [rec for rec in caplog.records if rec.levelno >= logging.ERROR and rid in rec.getMessage()]
            assert len(logged) == 1 and logged[0].exc_info and "a bug in the pipeline" in str(logged[0].exc_info[1])
        good = b'{"inputs": ["a text"]}'
        statuses = [s for s, _ in await on_one_connection(url, [("/predict", good, "a"), ("/v1/classify", good, "b"),
                                                                ("/v1/explain", good, "c")])]
        assert statuses == [424, 500, 200]  # the connection serves on after each failure
        page = (await client.get("/metrics")).text
    assert metric(page, "routing_requests_total", endpoint="/predict", status="424") == 2  # what the client got
    assert metric(page, "routing_requests_total", endpoint="/v1/classify", status="500") == 2
    assert metric(page, "routing_requests_total", status="500") == 2
    assert metric(page, "routing_failures_total", reason="internal") == 4
    assert not [rec for rec in caplog.records if "Exception in ASGI application" in rec.getMessage()]


async def test_an_unexpected_grpc_failure_is_internal_with_its_request_id_and_no_internals(
        tiny_repo: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(Inference, "run", fails)
    caplog.set_level(logging.INFO)
    port = free_port()
    text = pb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"a text")
    request = pb.ModelInferRequest(model_name="tiny", inputs=[text])
    async with serving(tiny_repo, grpc_port=port) as url, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for rid in ("failing-grpc", None):
            call = stub.ModelInfer(request, metadata=[("x-request-id", rid)] if rid else None)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            assert e.value.code() == grpc.StatusCode.INTERNAL and e.value.details() == INTERNAL_ERROR
            sent = dict(e.value.trailing_metadata() or ())["x-request-id"]
            assert sent == rid if rid else len(sent) == 32, sent
            logged = [rec for rec in caplog.records if rec.levelno >= logging.ERROR and sent in rec.getMessage()]
            assert len(logged) == 1 and "a bug in the pipeline" in str(logged[0].exc_info[1])
        ready = stub.ModelReady(pb.ModelReadyRequest(name="tiny"), metadata=[("x-request-id", "ok-1")])
        assert (await ready).ready and dict(await ready.trailing_metadata())["x-request-id"] == "ok-1"
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            page = (await client.get("/metrics")).text
    assert metric(page, "routing_requests_total", endpoint="grpc ModelInfer", status="500") == 2
