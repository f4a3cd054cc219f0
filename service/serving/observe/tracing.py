"""OpenTelemetry tracing, configured by the standard ``OTEL_*`` variables and off, at no cost, unless an OTLP endpoint
is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` keep it off).

Spans: one per HTTP request (W3C ``traceparent`` continued from the client; the request id an attribute) or gRPC
call, with children for tokenizing, each text's wait in the queue and rendering the answer; one per batch (backbone,
texts, chunks, tokens), linked to the request spans of the texts it served, with the engine's phases as children
(``encode``, ``heads`` with their credit, ``host``: their durations as the engine measured them, laid end to end from
the batch's start, since they interleave). Exported over OTLP/HTTP by the SDK's batch
processor (its own thread): a request waits for no export.

The batch span is written when the batch ends, from the times the batcher measured (its wait, its compute), so the
batcher knows nothing of tracing; the trace context of each text goes beside its job (a weak map), never inside it,
so nothing of it crosses to a backbone's process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from service.serving.core.work import PlainRun

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from service.serving.core.results import WorkAnswer
    from service.serving.core.work import TextJob, Work
    from service.serving.observe.observer import BatchObserver

log = logging.getLogger("service.tracing")

_tracer: Tracer | None = None
_provider: Any = None
_contexts: weakref.WeakKeyDictionary[TextJob, Context] = weakref.WeakKeyDictionary()


def wanted(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the ``OTEL_*`` variables ask for traces: an OTLP endpoint set, the SDK not disabled, the traces'
    exporter not ``none``."""
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint) and env.get("OTEL_SDK_DISABLED", "").lower() != "true" and \
        env.get("OTEL_TRACES_EXPORTER", "otlp").lower() != "none"


def configure() -> bool:
    """Start exporting traces when the environment asks for them (see :func:`wanted`); whether it does. The SDK
    reads the rest of ``OTEL_*`` itself (service name and resource, sampler, batch processor, exporter headers and
    timeouts)."""
    global _tracer, _provider
    if not wanted():
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK or its OTLP/HTTP exporter is not "
                    "installed (the service's dependencies: pip install opentelemetry-sdk "
                    "opentelemetry-exporter-otlp-proto-http): no traces (%s)", e)
        return False
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "routing-service")})
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _tracer = _provider.get_tracer("routing-service")
    log.info("tracing: exporting spans over OTLP/HTTP to %s", os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return True


def shutdown() -> None:
    """Export the spans still held, then stop (the server's exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def start_request(headers: Iterable[tuple[bytes, bytes]], method: str, path: str,
                  request_id: str) -> tuple[Span, object] | None:
    """A server span for an HTTP request, continuing the client's ``traceparent`` (and ``tracestate``), made the
    current span; with the token that :func:`end_request` needs. None when tracing is off."""
    if _tracer is None:
        return None
    carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in (b"traceparent", b"tracestate")}
    return _server_span(f"{method} {path}", carrier, {"http.request.method": method, "url.path": path,
                                                      "routing.request_id": request_id})


def start_call(metadata: Iterable[tuple[str, str | bytes]], method: str) -> tuple[Span, object] | None:
    """A server span for a gRPC call (``grpc <method>``), continuing the ``traceparent`` its metadata carries, made
    the current span; None when tracing is off. :func:`end_request` ends it."""
    if _tracer is None:
        return None
    carrier = {k: v for k, v in metadata if k in ("traceparent", "tracestate") and isinstance(v, str)}
    return _server_span(f"grpc {method}", carrier, {"rpc.system": "grpc", "rpc.method": method})


def _server_span(name: str, carrier: dict[str, str], attributes: dict[str, str]) -> tuple[Span, object]:
    from opentelemetry import context, propagate, trace

    assert _tracer is not None
    span = _tracer.start_span(name, context=propagate.extract(carrier), kind=trace.SpanKind.SERVER,
                              attributes=attributes)
    return span, context.attach(trace.set_span_in_context(span))


def end_request(started: tuple[Span, object] | None, route: str | None, status: int,
                grpc_code: str | None = None) -> None:
    """End the span of :func:`start_request` (named by its ``route``, ``POST /v1/classify``, with its HTTP
    ``status``) or :func:`start_call` (with its ``grpc_code``, e.g. ``OK``, ``NOT_FOUND``); an error status for a
    server's error (5xx)."""
    if started is None:
        return
    from opentelemetry import context, trace

    span, token = started
    if route is not None:
        span.update_name(f"{span.attributes.get('http.request.method')} {route}")  # type: ignore[union-attr]
        span.set_attribute("http.route", route)
    if grpc_code is not None:
        span.set_attribute("rpc.grpc.status_code", grpc_code)
    else:
        span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(trace.Status(trace.StatusCode.ERROR))
    span.end()
    context.detach(token)  # type: ignore[arg-type]


@contextlib.contextmanager
def span(name: str, **attributes: str | int | float) -> Iterator[None]:
    """A child of the current span named ``name`` around the block; nothing when tracing is off."""
    if _tracer is None:
        yield
        return
    with _tracer.start_as_current_span(name, attributes=attributes):
        yield


def follow(jobs: Sequence[TextJob]) -> None:
    """Remember the current span's context for ``jobs`` (the request's texts), for their batch's spans."""
    if _tracer is None:
        return
    from opentelemetry import context

    current = context.get_current()
    for job in jobs:
        _contexts[job] = current


class TracedBatches:
    """A batch observer (see :class:`~service.serving.observe.observer.BatchObserver`) that passes every event on to
    ``inner`` and writes each batch's span (linked to its texts' request spans) and each text's queue wait (a child of
    its request's span)."""

    def __init__(self, inner: BatchObserver[Work, WorkAnswer], backbone: str) -> None:
        self.inner, self.backbone = inner, backbone

    def on_queue_depth(self, depth: int) -> None:
        self.inner.on_queue_depth(depth)

    def on_drop(self, reason: str, payloads: Sequence[Work]) -> None:
        self.inner.on_drop(reason, payloads)

    def on_batch(self, payloads: Sequence[Work], results: Sequence[WorkAnswer] | None, cost: int,
                 waits: Sequence[float], seconds: float, runner: int) -> None:
        self.inner.on_batch(payloads, results, cost, waits, seconds, runner)
        tracer = _tracer
        if tracer is None:
            return
        try:
            self._spans(tracer, payloads, results, cost, waits, seconds)
        except Exception:  # an observer never raises into the batcher
            log.exception("tracing a batch failed")

    def _spans(self, tracer: Tracer, payloads: Sequence[Work], results: Sequence[WorkAnswer] | None,
               cost: int, waits: Sequence[float], seconds: float) -> None:
        from opentelemetry import trace

        end = time.time_ns()
        start = end - int(seconds * 1e9)
        requests: dict[int, Context] = {}  # each text's request, once
        for work, wait in zip(payloads, waits, strict=True):
            if type(work) is PlainRun:  # (an engine host's: its requests are traced by the fronts)
                continue
            ctx = _contexts.get(work.job)
            if ctx is None:
                continue
            requests.setdefault(id(ctx), ctx)
            queued = tracer.start_span("queue wait", context=ctx, start_time=start - int(wait * 1e9),
                                       attributes={"routing.backbone": self.backbone, "routing.chunk": work.k,
                                                   "routing.tokens": work.cost})
            queued.end(end_time=start)
        links = [trace.Link(trace.get_current_span(ctx).get_span_context()) for ctx in requests.values()]
        batch = tracer.start_span("batch", context=trace.set_span_in_context(trace.INVALID_SPAN), links=links,
                                  start_time=start,
                                  attributes={"routing.backbone": self.backbone,
                                              "routing.chunks": sum(w.size for w in payloads),
                                              "routing.texts": len({id(w.job) for w in payloads
                                                                    if type(w) is not PlainRun})
                                              + sum(w.size for w in payloads if type(w) is PlainRun),
                                              "routing.tokens": cost, "routing.requests": len(requests)})
        if results is None:
            batch.set_status(trace.Status(trace.StatusCode.ERROR, "the batch failed"))
        at = start  # the engine's phases (see contract.Answers): measured durations, laid end to end from the start
        inside = trace.set_span_in_context(batch)
        for phase, seconds in getattr(results, "phases", {}).items():
            child = tracer.start_span(phase, context=inside, start_time=at)
            at += int(seconds * 1e9)
            child.end(end_time=min(at, end))
        batch.end(end_time=end)
