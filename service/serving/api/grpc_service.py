"""The Open Inference Protocol v2 over gRPC (``inference.GRPCInferenceService``, from the definitions tritonclient
ships) and the standard gRPC health service, on ``ROUTING_GRPC_PORT``, over the same inference layer, batches,
limits, keys and lifecycle as HTTP: a thin layer over the protocol's rules (:mod:`service.serving.api.oip`), as
``routes/v2.py`` is for REST.

Keys travel as call metadata (``authorization: Bearer <key>``), a request id likewise (``x-request-id``, kept as
HTTP keeps the header, or a new one), returned in every call's trailing metadata. Errors map to gRPC codes by their
HTTP status: 400 and 422 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 NOT_FOUND, 413
RESOURCE_EXHAUSTED, 501 UNIMPLEMENTED, 503 UNAVAILABLE (queue full, draining, models not loaded), 504
DEADLINE_EXCEEDED, anything else INTERNAL (its message names no internals: the log line names the request id).
Outputs are returned as ``raw_output_contents`` (little-endian, BYTES as 4-byte length and bytes), as Triton does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from service.serving.api.auth import check_admin, check_key
from service.serving.api.errors import INTERNAL_ERROR
from service.serving.api.middleware import request_id_of
from service.serving.api.oip import (
    LOGGING_INSTEAD,
    SERVER_METADATA,
    SHARED_MEMORY_INSTEAD,
    TRACES_INSTEAD,
    check_version,
    controlled,
    infer_tensors,
    metadata_of,
    parameters_of,
    text_count,
    texts_of,
    unload_parameters,
    unpack_bytes,
)
from service.serving.core.errors import APIError
from service.serving.observe import tracing
from service.serving.state import AppState

log = logging.getLogger("service.grpc")
SERVICE = "inference.GRPCInferenceService"
GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
         401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
         413: grpc.StatusCode.RESOURCE_EXHAUSTED, 501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE,
         504: grpc.StatusCode.DEADLINE_EXCEEDED}
DTYPES = {"FP32": "<f4", "INT32": "<i4"}
Reply = TypeVar("Reply")


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    return next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)


def _request_id(context: grpc.aio.ServicerContext) -> str:
    """The call's request id: the client's ``x-request-id`` metadata kept as HTTP keeps the header, or a new one."""
    return request_id_of([(k.encode(), v.encode()) for k, v in context.invocation_metadata() or ()
                          if k == "x-request-id" and isinstance(v, str)])


def _parameter(p: pb.InferParameter) -> str | bool | int | float:
    """An InferParameter's value, as the REST body would hold it."""
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which is not None else ""


def _request_parameters(request: Any) -> dict[str, Any]:
    """A repository request's parameters as REST's body holds them (``{"parameters": {...}}``, or ``{}``)."""
    return {"parameters": {k: _parameter(v) for k, v in request.parameters.items()}} if request.parameters else {}


def _texts(request: pb.ModelInferRequest) -> list[str]:
    """The ``text`` input's strings, from ``raw_input_contents`` or ``contents.bytes_contents``, checked as REST's."""
    if len(request.inputs) != 1:
        raise APIError(400, f"expected one input named 'text' of datatype BYTES, got {len(request.inputs)} inputs")
    tensor = request.inputs[0]
    shape = list(tensor.shape)
    n = text_count(tensor.name, tensor.datatype, shape)
    raw = request.raw_input_contents
    if len(raw) > 1:
        raise APIError(400, f"raw_input_contents holds {len(raw)} tensors; the request has one input")
    if raw and tensor.HasField("contents"):
        raise APIError(400, "input 'text' has its elements both in raw_input_contents and in contents: send them "
                            "in one of the two")
    items = unpack_bytes(raw[0]) if raw else list(tensor.contents.bytes_contents)
    return texts_of(items, n, shape, "inputs.0.contents")


def _raw(datatype: str, data: list[Any]) -> bytes:
    """A tensor's elements as ``raw_output_contents`` bytes."""
    if datatype == "BYTES":
        out = bytearray()
        for item in data:
            b = str(item).encode("utf-8")
            out += struct.pack("<I", len(b)) + b
        return bytes(out)
    return np.asarray(data, dtype=DTYPES[datatype]).tobytes()


NOT_SERVED = {
    "ModelConfig": "a model here has no Triton model configuration; ModelMetadata gives its inputs and outputs",
    "ModelStreamInfer": "send each request with ModelInfer",
    "TraceSetting": TRACES_INSTEAD,
    "LogSettings": LOGGING_INSTEAD,
    **{f"{kind}SharedMemory{verb}": SHARED_MEMORY_INSTEAD
       for kind in ("System", "Cuda") for verb in ("Status", "Register", "Unregister")},
}
"""The protocol's RPCs this server does not serve, each with what to do instead."""


def _not_served(name: str, instead: str) -> Callable[..., Awaitable[None]]:
    """The RPC ``name``, answered UNIMPLEMENTED (and counted as any call is)."""
    async def rpc(self: InferenceService, request: Any, context: grpc.aio.ServicerContext) -> None:
        async def work() -> None:
            raise APIError(501, f"{name} is not served by this server: {instead}")
        await self._call(context, name, work, key="none")
    return rpc


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """Each RPC of the protocol that this server has; the others (:data:`NOT_SERVED`) answer UNIMPLEMENTED with what
    to do instead (the generated servicer's own raised an error, logged with its traceback at every call)."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    async def _call(self, context: grpc.aio.ServicerContext, method: str, work: Callable[[], Awaitable[Reply]], *,
                    key: str = "api", inference: bool = False) -> Reply:
        """``work()`` with the key checked (``api``, ``admin`` or ``none``), counted in flight as an HTTP request is,
        and an APIError turned into its gRPC status (anything else: INTERNAL); a new inference call is UNAVAILABLE
        while the server drains. The request metrics count it under ``endpoint="grpc <method>"`` with the HTTP
        status its gRPC code stands for, as the failures do by reason."""
        state, m = self.state, self.state.metrics
        status, t0 = 200, time.perf_counter()
        request_id = _request_id(context)
        context.set_trailing_metadata((("x-request-id", request_id),))
        traced = tracing.start_call(context.invocation_metadata() or (), method)  # None: tracing is off
        try:
            if key == "api":
                check_key(state, _authorization(context))
            elif key == "admin":
                check_admin(state, _authorization(context))
            if inference and state.lifecycle.draining:
                raise APIError(503, "the server is shutting down: send the request again (to another replica)",
                               reason="draining")
            with state.lifecycle.request():
                return await work()
        except APIError as e:
            status = e.status
            if e.reason:
                m.failures.labels(e.reason).inc()
            await context.abort(GRPC_CODES.get(e.status, grpc.StatusCode.INTERNAL), e.message)
            raise  # abort raises; this line is for the type checker
        except asyncio.CancelledError:
            status = 499  # the client cancelled the call or went away
            m.failures.labels("disconnected").inc()
            raise
        except Exception:
            status = 500
            m.failures.labels("internal").inc()
            log.exception("gRPC %s failed (request %s)", method, request_id,
                          extra={"fields": {"request_id": request_id}})
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)
            raise
        finally:
            code = "OK" if status == 200 else GRPC_CODES.get(status, grpc.StatusCode.INTERNAL).name
            tracing.end_request(traced, None, status, code if status != 499 else "CANCELLED")
            m.served(f"grpc {method}", status, time.perf_counter() - t0)

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
                          ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.lifecycle.ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ModelReadyResponse:
        async def work() -> pb.ModelReadyResponse:
            check_version(request.version or "1")
            try:
                await self.state.inference.require([request.name])  # as GET /v2/models/{model}/ready
            except APIError as e:
                if e.status != 404:
                    raise
                return pb.ModelReadyResponse(ready=False)  # as Triton: a model it does not serve is not ready
            return pb.ModelReadyResponse(ready=True)
        return await self._call(context, "ModelReady", work)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest,
                             context: grpc.aio.ServicerContext) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**SERVER_METADATA)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest,
                            context: grpc.aio.ServicerContext) -> pb.ModelMetadataResponse:
        async def work() -> pb.ModelMetadataResponse:
            inf = self.state.inference
            await inf.require([request.name])
            check_version(request.version or "1")
            meta = metadata_of(inf, request.name)
            tensors = lambda ts: [pb.ModelMetadataResponse.TensorMetadata(**t) for t in ts]  # noqa: E731
            return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                            inputs=tensors(meta["inputs"]), outputs=tensors(meta["outputs"]))
        return await self._call(context, "ModelMetadata", work)

    async def ModelInfer(self, request: pb.ModelInferRequest,
                         context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        async def work() -> pb.ModelInferResponse:
            inf, model = self.state.inference, request.model_name
            inf.check_name(model)
            check_version(request.model_version or "1")
            await inf.require([model])  # no await from here to the run: its head stays in memory
            texts = _texts(request)
            params = {k: _parameter(v) for k, v in request.parameters.items()}
            wanted = [o.name for o in request.outputs] or None
            outputs = await infer_tensors(inf, model, texts, params, wanted)
            reply = pb.ModelInferResponse(model_name=model, model_version="1", id=request.id)
            for t in outputs:
                reply.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
                reply.raw_output_contents.append(_raw(t.datatype, t.data))
            return reply
        return await self._call(context, "ModelInfer", work, inference=True)

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest,
                              context: grpc.aio.ServicerContext) -> pb.RepositoryIndexResponse:
        async def work() -> pb.RepositoryIndexResponse:
            entries = await self.state.control.entries(ready_only=request.ready)
            return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in entries])
        return await self._call(context, "RepositoryIndex", work, key="admin")

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: grpc.aio.ServicerContext) -> pb.RepositoryModelLoadResponse:
        async def work() -> pb.RepositoryModelLoadResponse:
            parameters_of(_request_parameters(request), "load", why=": a model loads from its folder in the repository")
            controlled(self.state)
            await self.state.control.load(request.model_name)
            return pb.RepositoryModelLoadResponse()
        return await self._call(context, "RepositoryModelLoad", work, key="admin")

    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: grpc.aio.ServicerContext) -> pb.RepositoryModelUnloadResponse:
        async def work() -> pb.RepositoryModelUnloadResponse:
            unload_parameters(_request_parameters(request))
            controlled(self.state)
            await self.state.control.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()
        return await self._call(context, "RepositoryModelUnload", work, key="admin")

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest,
                              context: grpc.aio.ServicerContext) -> pb.ModelStatisticsResponse:
        async def work() -> pb.ModelStatisticsResponse:
            from google.protobuf import json_format

            inf = self.state.inference
            if request.name:
                inf.group_of(request.name)
                check_version(request.version or "1")
            names = [request.name] if request.name else inf.resolve("all")
            stats = await self.state.control.statistics(names)
            return json_format.ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)
        return await self._call(context, "ModelStatistics", work)


for _name, _instead in NOT_SERVED.items():
    setattr(InferenceService, _name, _not_served(_name, _instead))


@contextlib.asynccontextmanager
async def serving(state: AppState) -> AsyncIterator[grpc.aio.Server | None]:
    """The gRPC server on ``grpc_port`` (none when it is 0) for as long as the block runs: the inference service,
    and the health service, SERVING while the server is ready and NOT_SERVING otherwise (loading, draining)."""
    s = state.settings
    if not s.grpc_port:
        yield None
        return
    limit = s.max_body_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", -1)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(state), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"[{s.host}]:{s.grpc_port}" if ":" in s.host else f"{s.host}:{s.grpc_port}")  # IPv6
    await server.start()
    log.info("gRPC (Open Inference Protocol v2, health) on %s:%d", s.host, s.grpc_port)

    async def follow() -> None:  # the health service says what the lifecycle says
        said = None
        while True:
            status = (health_pb2.HealthCheckResponse.SERVING if state.lifecycle.ready
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            if status != said:
                for service in ("", SERVICE):
                    await checks.set(service, status)
                said = status
            await asyncio.sleep(0.05)

    follower = asyncio.create_task(follow())
    try:
        yield server
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await server.stop(grace=1.0)
