"""OpenTelemetry: with an OTLP endpoint set, a request's span (continuing the client's trace), its children and the
span of the batch that served it reach an OTLP/HTTP receiver, decoded here with opentelemetry-proto; without one,
nothing is traced."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from service.serving.observe import tracing
from tests.serving.server import running

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
GRPC_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP endpoint on a free port: every span POSTed to ``/v1/traces``, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Span]] = []
        self.paths: list[str] = []
        spans, paths = self.spans, self.paths

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                paths.append(self.path)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    service = next(a.value.string_value for a in resource.resource.attributes
                                   if a.key == "service.name")
                    spans.extend((service, s) for scope in resource.scope_spans for s in scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[Span]:
        return [s for _, s in self.spans if s.name == name]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.httpd.shutdown()


def attributes(span: Span) -> dict[str, object]:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


def test_a_request_its_children_and_its_batch_reach_the_otlp_endpoint(tiny_repo: Path, tmp_path: Path,
                                                                      receiver: Receiver,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "routing-under-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 0.1 s
    for server in running(tmp_path / "logs", model_repository=tiny_repo, default_model="tiny"):
        r = httpx.post(f"{server.url}/v1/classify", json={"inputs": ["one text", "and another"]},
                       headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-ID": "trace-me"})
        assert r.status_code == 200, r.text
        text = triton.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"over grpc"], dtype=object))
        port = server.env["ROUTING_GRPC_PORT"]
        triton.InferenceServerClient(f"127.0.0.1:{port}").infer(
            "tiny", [text], headers={"traceparent": f"00-{GRPC_TRACE_ID}-{PARENT_ID}-01"})
        end = time.monotonic() + 20
        while time.monotonic() < end and not (receiver.named("POST /v1/classify") and receiver.named("batch")
                                              and receiver.named("grpc ModelInfer")):
            time.sleep(0.1)
    assert set(receiver.paths) == {"/v1/traces"} and {s for s, _ in receiver.spans} == {"routing-under-test"}
    (request,) = receiver.named("POST /v1/classify")
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID  # the client's trace
    assert request.kind == Span.SPAN_KIND_SERVER
    assert attributes(request)["routing.request_id"] == "trace-me"
    assert attributes(request)["http.route"] == "/v1/classify"
    assert attributes(request)["http.response.status_code"] == 200
    children = [s for _, s in receiver.spans if s.parent_span_id == request.span_id]
    names = sorted(s.name for s in children)
    assert names == ["queue wait", "queue wait", "render", "tokenize"], names  # a queue wait per text
    assert all(s.trace_id == request.trace_id for s in children)
    for child in children:  # within the request's time
        assert request.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano \
            <= request.end_time_unix_nano, child.name
    batches = [b for b in receiver.named("batch") if any(link.span_id == request.span_id for link in b.links)]
    assert len(batches) >= 1
    batch = batches[0]
    assert batch.trace_id != request.trace_id and not batch.parent_span_id  # its own trace, linked
    assert {link.trace_id.hex() for link in batch.links} == {TRACE_ID}
    got = attributes(batch)
    assert got["routing.backbone"] == "tiny-bert@random" and got["routing.texts"] >= 1 and got["routing.tokens"] > 0
    phases = [s for _, s in receiver.spans if s.parent_span_id == batch.span_id]  # the engine's, in its process
    assert sorted(s.name for s in phases) == ["encode", "heads", "host"]
    assert all(batch.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano
               <= batch.end_time_unix_nano for s in phases)
    assert next(s for s in phases if s.name == "encode").end_time_unix_nano > batch.start_time_unix_nano
    queued = [s for s in children if s.name == "queue wait"]
    assert all(q.end_time_unix_nano <= batch.start_time_unix_nano + 1000 for q in queued)  # waited, then computed
    (call,) = receiver.named("grpc ModelInfer")  # a gRPC call continues its metadata's trace likewise
    assert call.trace_id.hex() == GRPC_TRACE_ID and attributes(call)["rpc.grpc.status_code"] == "OK"
    names = sorted(s.name for _, s in receiver.spans if s.parent_span_id == call.span_id)
    assert names == ["queue wait", "tokenize"], names


def test_tracing_is_off_without_an_endpoint_or_when_disabled() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.enabled()  # this process configured nothing: every tracing call is a no-op
    assert tracing.start_request([], "GET", "/", "id") is None
    with tracing.span("nothing"):
        pass
