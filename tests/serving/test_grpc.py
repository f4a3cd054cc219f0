"""The Open Inference Protocol v2 over gRPC, through ``tritonclient.grpc`` (sync and asyncio) as Triton's users call
it: the same cases as the REST tests (health, metadata, infer with and without credit, the repository with and
without the admin key, statistics, each error's code), answers equal to REST's, gRPC and HTTP texts sharing a batch,
and the standard health service going NOT_SERVING while the server drains."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from service.serving.api.grpc_service import NOT_SERVED
from tests.conftest import write_tiny_model
from tests.serving.server import Server, free_port, metric

ADMIN, USER = "admin-key-1", "user-key-1"
AS_ADMIN, AS_USER = {"authorization": f"Bearer {ADMIN}"}, {"authorization": f"Bearer {USER}"}
TEXTS = ["a short text", "another one, a little longer than the first"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    repo = tmp_path_factory.mktemp("grpc") / "models"
    write_tiny_model(repo, tiny_backbone_dir, name="tiny", seed=0)
    write_tiny_model(repo, tiny_backbone_dir, name="tiny-b", seed=1)
    return repo


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("grpc-logs"), model_repository=repo, models="tiny", default_model="tiny",
               model_control="explicit", admin_keys=ADMIN, api_keys=USER, grpc_port=free_port(),
               max_wait_ms=150).wait_ready()
    try:
        yield s
    finally:
        s.stop()


def grpc_url(server: Server) -> str:
    assert "gRPC (Open Inference Protocol v2, health) on" in server.full_log()
    return f"127.0.0.1:{server.env['ROUTING_GRPC_PORT']}"


@pytest.fixture(scope="module")
def client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(grpc_url(server))


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


def code(e: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(e.value.status())


def rest(server: Server, model: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, headers=AS_USER, timeout=60)
    assert r.status_code == 200, r.text
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}


def test_health_and_metadata(client: triton.InferenceServerClient, server: Server) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny", headers=AS_USER)
    assert not client.is_model_ready("nope", headers=AS_USER)  # as Triton: not served, not ready
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "routing-service" and "model_repository" in meta["extensions"]
    model = client.get_model_metadata("tiny", headers=AS_USER, as_json=True)
    rest_meta = httpx.get(f"{server.url}/v2/models/tiny", headers=AS_USER).json()
    assert model["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]
    assert [o["name"] for o in model["outputs"]] == [o["name"] for o in rest_meta["outputs"]]
    with grpc.insecure_channel(grpc_url(server)) as channel:
        checks = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            status = checks.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_infer_with_and_without_credit_equals_rest(client: triton.InferenceServerClient, server: Server) -> None:
    got = client.infer("tiny", [text_input(TEXTS)], headers=AS_USER)
    want = rest(server, "tiny", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": TEXTS}]})
    assert [b.decode() for b in got.as_numpy("label")] == list(want["label"])
    np.testing.assert_allclose(got.as_numpy("probabilities"), want["probabilities"], atol=1e-5)
    assert got.get_response().model_name == "tiny"
    explained = client.infer("tiny", [text_input(TEXTS)], headers=AS_USER, parameters={"explain": True,
                                                                                        "target": "all"})
    want = rest(server, "tiny", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": TEXTS}],
                                 "parameters": {"explain": True, "target": "all"}})
    for name in ("credit", "logit", "baseline"):
        np.testing.assert_allclose(explained.as_numpy(name), want[name], atol=1e-5)
    assert explained.as_numpy("token_lengths").tolist() == want["token_lengths"].tolist()
    credit, logit, baseline = (explained.as_numpy(n) for n in ("credit", "logit", "baseline"))
    np.testing.assert_allclose(credit.sum(1) + baseline, logit, atol=1e-4)  # complete, as over REST
    only = client.infer("tiny", [text_input(TEXTS)], headers=AS_USER,
                        outputs=[triton.InferRequestedOutput("probabilities")])
    assert only.as_numpy("label") is None and only.as_numpy("probabilities").shape == (2, 3)


def test_the_asyncio_client_passes_the_same_cases(client: triton.InferenceServerClient, server: Server) -> None:
    """``tritonclient.grpc.aio``: health, metadata, infer with and without credit (the sync client's answers), the
    repository with and without the admin key, statistics, and the error codes."""

    async def calls() -> dict[str, object]:
        got: dict[str, object] = {}
        async with triton_aio.InferenceServerClient(grpc_url(server)) as aio:
            got["live"], got["ready"] = await aio.is_server_live(), await aio.is_server_ready()
            got["model_ready"] = await aio.is_model_ready("tiny", headers=AS_USER)
            got["server"] = (await aio.get_server_metadata(as_json=True))["name"]
            got["outputs"] = [o["name"] for o in (await aio.get_model_metadata("tiny", headers=AS_USER,
                                                                                 as_json=True))["outputs"]]
            plain = await aio.infer("tiny", [text_input(TEXTS)], headers=AS_USER)
            explained = await aio.infer("tiny", [text_input(TEXTS)], headers=AS_USER, parameters={"explain": True})
            got["probabilities"], got["credit"] = plain.as_numpy("probabilities"), explained.as_numpy("credit")
            got["index"] = [m["name"] for m in (await aio.get_model_repository_index(headers=AS_ADMIN,
                                                                                      as_json=True))["models"]]
            got["stats"] = (await aio.get_inference_statistics("tiny", headers=AS_USER, as_json=True)
                            )["model_stats"][0]["name"]
            codes = []
            for call in (lambda: aio.get_model_repository_index(headers=AS_USER),  # an inference key
                         lambda: aio.load_model("tiny-b"),  # no key
                         lambda: aio.infer("nope", [text_input(TEXTS)], headers=AS_USER),
                         lambda: aio.infer("tiny", [text_input([" "])], headers=AS_USER),
                         lambda: aio.infer("tiny", [text_input(TEXTS)], headers=AS_USER, timeout=1)):
                try:
                    await call()
                    codes.append("OK")
                except InferenceServerException as e:
                    codes.append(str(e.status()).removeprefix("StatusCode."))
            got["codes"] = codes
            await aio.load_model("tiny-b", headers=AS_ADMIN)
            got["loaded"] = await aio.is_model_ready("tiny-b", headers=AS_USER)
            await aio.unload_model("tiny-b", headers=AS_ADMIN)
            got["unloaded"] = not await aio.is_model_ready("tiny-b", headers=AS_USER)
        return got

    got = asyncio.run(calls())
    assert got["live"] and got["ready"] and got["model_ready"] and got["server"] == "routing-service"
    assert got["outputs"][:2] == ["label", "probabilities"] and "credit" in got["outputs"]  # type: ignore[index]
    sync = client.infer("tiny", [text_input(TEXTS)], headers=AS_USER, parameters={"explain": True})
    np.testing.assert_allclose(got["probabilities"], sync.as_numpy("probabilities"), atol=1e-6)  # type: ignore[arg-type]
    np.testing.assert_allclose(got["credit"], sync.as_numpy("credit"), atol=1e-6)  # type: ignore[arg-type]
    assert set(got["index"]) == {"tiny", "tiny-b"} and got["stats"] == "tiny"  # type: ignore[arg-type]
    assert got["codes"] == ["PERMISSION_DENIED", "UNAUTHENTICATED", "NOT_FOUND", "INVALID_ARGUMENT",
                            "DEADLINE_EXCEEDED"]
    assert got["loaded"] and got["unloaded"]


def test_each_error_has_its_code(client: triton.InferenceServerClient, server: Server) -> None:
    with pytest.raises(InferenceServerException) as e:
        client.infer("tiny", [text_input(TEXTS)])  # no key
    assert code(e) == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as e:
        client.infer("nope", [text_input(TEXTS)], headers=AS_USER)
    assert code(e) == "StatusCode.NOT_FOUND" and "nope" in e.value.message()
    wrong = triton.InferInput("words", [1], "BYTES")
    wrong.set_data_from_numpy(np.array([b"x"], dtype=object))
    with pytest.raises(InferenceServerException) as e:
        client.infer("tiny", [wrong], headers=AS_USER)
    assert code(e) == "StatusCode.INVALID_ARGUMENT" and "'text'" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer("tiny", [text_input(["  "])], headers=AS_USER)
    assert code(e) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as e:
        client.infer("tiny", [text_input(TEXTS)], headers=AS_USER, parameters={"method": "guess"})
    assert code(e) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as e:  # a deadline of 1 us (Triton's timeout) passes in the queue
        client.infer("tiny", [text_input(TEXTS)], headers=AS_USER, timeout=1)
    assert code(e) == "StatusCode.DEADLINE_EXCEEDED"
    big = "word " * 20_000  # over the server's body limit (ROUTING_MAX_BODY_BYTES), as over HTTP
    with pytest.raises(InferenceServerException) as e:
        client.infer("tiny", [text_input([big] * 20)], headers=AS_USER)
    assert code(e) == "StatusCode.RESOURCE_EXHAUSTED"


def test_a_text_tensor_sent_twice_or_in_two_places_is_invalid(server: Server) -> None:
    """Elements in both ``raw_input_contents`` and ``contents``, or more raw tensors than inputs, break the protocol
    (raw contents: one per input, in place of every input's ``contents``): INVALID_ARGUMENT (they were served, one
    copy read and the other ignored)."""
    def raw(texts: list[bytes]) -> bytes:
        return b"".join(len(t).to_bytes(4, "little") + t for t in texts)

    def request(contents: list[bytes], raws: list[bytes]) -> pb.ModelInferRequest:
        r = pb.ModelInferRequest(model_name="tiny", raw_input_contents=raws)
        text = r.inputs.add(name="text", datatype="BYTES", shape=[1])
        if contents:
            text.contents.bytes_contents.extend(contents)
        return r

    with grpc.insecure_channel(grpc_url(server)) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        metadata = list(AS_USER.items())
        assert infer(request([b"a text"], []), metadata=metadata).outputs  # each alone is served
        assert infer(request([], [raw([b"a text"])]), metadata=metadata).outputs
        for contents, raws, says in [([b"a text"], [raw([b"another"])], "both in raw_input_contents and in contents"),
                                     ([], [raw([b"a text"]), raw([b"another"])], "holds 2 tensors")]:
            with pytest.raises(grpc.RpcError) as e:
                infer(request(contents, raws), metadata=metadata)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.details()


def test_the_rpcs_not_served_are_unimplemented_with_what_to_do_instead(server: Server) -> None:
    """Every RPC of the protocol that this server does not serve: UNIMPLEMENTED with a message, and no traceback in
    the log (the generated servicer's default raised an error, logged at every call)."""
    not_served = {"ModelConfig": pb.ModelConfigRequest(name="tiny"), "TraceSetting": pb.TraceSettingRequest(),
                  "LogSettings": pb.LogSettingsRequest(),
                  "SystemSharedMemoryStatus": pb.SystemSharedMemoryStatusRequest(),
                  "CudaSharedMemoryRegister": pb.CudaSharedMemoryRegisterRequest(name="x")}
    rpcs = {m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    assert rpcs - set(NOT_SERVED) == {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                                      "ModelInfer", "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad",
                                      "RepositoryModelUnload"}  # served; every other one of the protocol is listed
    assert set(not_served) | {"ModelStreamInfer"} <= set(NOT_SERVED)
    before = server.full_log().count("Traceback")
    with grpc.insecure_channel(grpc_url(server)) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [(name, lambda name=name, req=req: getattr(stub, name)(req, metadata=list(AS_USER.items())))
                 for name, req in not_served.items()]
        calls.append(("ModelStreamInfer", lambda: list(stub.ModelStreamInfer(iter([pb.ModelInferRequest()])))))
        for name, call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, (name, e.value.details())
            assert e.value.details().startswith(f"{name} is not served by this server: "), e.value.details()
    assert server.full_log().count("Traceback") == before
    page = httpx.get(f"{server.url}/metrics").text  # counted as any call is, by what the client got
    assert metric(page, "routing_requests_total", endpoint="grpc ModelConfig", status="501") == 1


def test_repository_load_and_unload_need_the_admin_key(client: triton.InferenceServerClient) -> None:
    index = {m["name"]: m.get("state") for m in client.get_model_repository_index(headers=AS_ADMIN,
                                                                                   as_json=True)["models"]}
    assert index == {"tiny": "READY", "tiny-b": "UNAVAILABLE"}
    for headers, status in ((None, "StatusCode.UNAUTHENTICATED"), (AS_USER, "StatusCode.PERMISSION_DENIED")):
        with pytest.raises(InferenceServerException) as e:
            client.load_model("tiny-b", headers=headers)
        assert code(e) == status
        with pytest.raises(InferenceServerException) as e:
            client.get_model_repository_index(headers=headers)
        assert code(e) == status
    client.load_model("tiny-b", headers=AS_ADMIN)
    assert client.is_model_ready("tiny-b", headers=AS_USER)
    assert client.infer("tiny-b", [text_input(TEXTS)], headers=AS_USER).as_numpy("label").shape == (2,)
    client.unload_model("tiny-b", headers=AS_ADMIN)
    assert not client.is_model_ready("tiny-b", headers=AS_USER)
    with pytest.raises(InferenceServerException) as e:
        client.load_model("no-such-folder", headers=AS_ADMIN)
    assert code(e) in ("StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT")


def test_statistics_and_metrics_count_grpc_requests(client: triton.InferenceServerClient, server: Server) -> None:
    page = httpx.get(f"{server.url}/metrics").text
    counted = {s: metric(page, "routing_requests_total", endpoint="grpc ModelInfer", status=s) for s in ("200", "404")}
    before = client.get_inference_statistics("tiny", headers=AS_USER, as_json=True)["model_stats"][0]
    client.infer("tiny", [text_input(TEXTS)], headers=AS_USER)
    after = client.get_inference_statistics("tiny", headers=AS_USER, as_json=True)["model_stats"][0]
    assert after["name"] == "tiny" and int(after["inference_count"]) == int(before.get("inference_count", 0)) + 2
    with pytest.raises(InferenceServerException):
        client.infer("nope", [text_input(TEXTS)], headers=AS_USER)
    page = httpx.get(f"{server.url}/metrics").text  # what the clients got, as for HTTP requests
    assert metric(page, "routing_requests_total", endpoint="grpc ModelInfer", status="200") == counted["200"] + 1
    assert metric(page, "routing_requests_total", endpoint="grpc ModelInfer", status="404") == counted["404"] + 1
    with pytest.raises(InferenceServerException) as e:
        client.get_inference_statistics("nope", headers=AS_USER)
    assert code(e) == "StatusCode.NOT_FOUND"


def test_a_grpc_and_an_http_request_share_a_batch(client: triton.InferenceServerClient, server: Server) -> None:
    bb = "tiny-bert@random"
    # a batch of two first, so that the batcher waits for a second text (see test_compat's sharing test)
    two = httpx.post(f"{server.url}/v1/classify", json={"inputs": ["one", "two"]}, headers=AS_USER)
    assert two.status_code == 200
    page = httpx.get(f"{server.url}/metrics").text
    batches, chunks = (metric(page, f"routing_batch_size_{s}", backbone=bb) for s in ("count", "sum"))

    async def both() -> None:
        async with triton_aio.InferenceServerClient(grpc_url(server)) as aio, httpx.AsyncClient() as http:
            grpc_call = aio.infer("tiny", [text_input(["from grpc"])], headers=AS_USER)
            http_call = http.post(f"{server.url}/v1/classify", json={"inputs": ["from http"]}, headers=AS_USER)
            result, response = await asyncio.gather(grpc_call, http_call)
            assert response.status_code == 200 and result.as_numpy("label").shape == (1,)

    asyncio.run(both())  # the server waits up to 150 ms for a batch to fill: both texts arrive within it
    page = httpx.get(f"{server.url}/metrics").text
    assert metric(page, "routing_batch_size_count", backbone=bb) == batches + 1
    assert metric(page, "routing_batch_size_sum", backbone=bb) == chunks + 2


def test_a_full_queue_is_unavailable_and_health_says_not_serving_while_the_server_drains(repo: Path,
                                                                                         tmp_path: Path) -> None:
    port = free_port()
    s = Server(tmp_path, model_repository=repo, models="tiny", default_model="tiny", grpc_port=port,
               drain_timeout_s=5, max_queue=16).wait_ready()
    statuses = []
    try:
        with pytest.raises(InferenceServerException) as e:  # more texts than the queue holds: turned away at once
            triton.InferenceServerClient(f"127.0.0.1:{port}").infer("tiny", [text_input(["a text"] * 17)])
        assert code(e) == "StatusCode.UNAVAILABLE" and "overloaded" in e.value.message()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            checks = health_pb2_grpc.HealthStub(channel)
            end = time.monotonic() + 5  # the health service follows the server's state within 50 ms
            while time.monotonic() < end and statuses[-1:] != [health_pb2.HealthCheckResponse.SERVING]:
                statuses.append(checks.Check(health_pb2.HealthCheckRequest()).status)
            # requests being computed keep the drain going a moment
            slow = triton.InferenceServerClient(f"127.0.0.1:{port}")
            answered: list[object] = []
            for _ in range(4):
                slow.async_infer("tiny", [text_input(["held " * 200] * 4)],
                                 lambda result, error: answered.append(error or result))
            os.kill(s.proc.pid, signal.SIGTERM)
            end = time.monotonic() + 10
            while time.monotonic() < end:
                try:
                    statuses.append(checks.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
                except grpc.RpcError:
                    break  # the server has gone
                if statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.01)
    finally:
        s.stop()
    serving = statuses.index(health_pb2.HealthCheckResponse.SERVING)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses[serving:]  # after serving: draining
