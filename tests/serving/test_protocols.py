"""Open Inference Protocol v2 with a real client (tritonclient) and KServe V1 over plain HTTP, against
a real server: the same answers as the service's own /v1 routes."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from service.serving.api.routes.v2 import NOT_SERVED
from tests.serving.server import Server

TEXTS = ["the first text", "a second, somewhat longer text. It has two sentences!", "x"]


@pytest.fixture
def client(tiny: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=f"127.0.0.1:{tiny.port}")


def text_input(texts: list[str], binary: bool) -> triton.InferInput:
    inp = triton.InferInput("text", [len(texts)], "BYTES")
    inp.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_), binary_data=binary)
    return inp


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", model_version="1")
    assert not client.is_model_ready("nope")
    server = client.get_server_metadata()
    assert server["name"] == "routing-service" and "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata("tiny")
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    outputs = {o["name"]: o for o in meta["outputs"]}
    assert outputs["probabilities"] == {"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]}
    assert {"label", "credit", "tokens", "token_lengths", "credit_targets", "logit", "baseline"} <= set(outputs)
    assert meta["parameters"]["labels"] == ["alpha", "beta", "gamma"] and "credit[b, p, t]" in \
        meta["parameters"]["credit_layout"]


@pytest.mark.parametrize("binary", [True, False])
def test_infer_equals_v1_classify(client: triton.InferenceServerClient, tiny: Server, binary: bool) -> None:
    ref = httpx.post(f"{tiny.url}/v1/models/tiny/classify", json={"inputs": TEXTS}).json()["results"]
    res = client.infer("tiny", [text_input(TEXTS, binary)], request_id="req-7")
    assert res.get_response()["id"] == "req-7" and res.get_response()["model_name"] == "tiny"
    labels = res.as_numpy("label")
    probs = res.as_numpy("probabilities")
    assert probs.dtype == np.float32 and probs.shape == (3, 3)
    assert [lab.decode() if isinstance(lab, bytes) else lab for lab in labels] == [r["label"] for r in ref]
    expected = np.array([[r["scores"][lab] for lab in ("alpha", "beta", "gamma")] for r in ref], dtype=np.float32)
    np.testing.assert_allclose(probs, expected, atol=1e-6)
    assert res.as_numpy("credit") is None  # no credit unless asked for
    for compression in ("gzip", "deflate"):  # the request compressed, as tritonclient offers; the answer the same
        packed = client.infer("tiny", [text_input(TEXTS, binary)], request_compression_algorithm=compression,
                              response_compression_algorithm=compression)
        np.testing.assert_array_equal(packed.as_numpy("probabilities"), probs)


def test_tensor_data_flat_or_nested_as_its_shape(tiny: Server) -> None:
    """The protocol lets ``data`` nest as the tensor's dimensions: ``[n, 1]`` nested gives the flat answers; data
    nested otherwise than its shape is a 400."""
    url = f"{tiny.url}/v2/models/tiny/infer"

    def infer(shape: list[int], data: list[object]) -> httpx.Response:
        return httpx.post(url, json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": shape, "data": data}]})

    flat = infer([3], TEXTS)
    assert flat.status_code == 200, flat.text
    for shape, data in [([3, 1], TEXTS), ([3, 1], [[t] for t in TEXTS]), ([3, 1, 1], [[[t]] for t in TEXTS])]:
        r = infer(shape, data)
        assert r.status_code == 200, (shape, data, r.text)
        assert r.json()["outputs"] == flat.json()["outputs"]
    for shape, data in [([3], [[t] for t in TEXTS]), ([3, 1], [TEXTS]), ([3, 1], [[TEXTS[0]], [TEXTS[1]], TEXTS[2]]),
                        ([3, 1], [[t, t] for t in TEXTS]), ([3, 1], [[[t]] for t in TEXTS])]:
        r = infer(shape, data)
        assert r.status_code == 400 and "shape" in r.json()["error"], (shape, data, r.text)


def test_output_selection_and_credit_tensors(client: triton.InferenceServerClient, tiny: Server) -> None:
    only = client.infer("tiny", [text_input(TEXTS, False)],
                        outputs=[triton.InferRequestedOutput("probabilities", binary_data=False)])
    assert [o["name"] for o in only.get_response()["outputs"]] == ["probabilities"]
    names = ["credit", "tokens", "token_lengths", "credit_targets", "logit", "baseline"]
    res = client.infer("tiny", [text_input(TEXTS, True)], parameters={"target": "all"},
                       outputs=[triton.InferRequestedOutput(n, binary_data=False) for n in names])
    credit, lengths, logit, baseline = (res.as_numpy(n) for n in ("credit", "token_lengths", "logit", "baseline"))
    tokens, targets = res.as_numpy("tokens"), res.as_numpy("credit_targets")
    assert credit.dtype == np.float32 and credit.shape == (3, int(lengths.max()), 3) and targets.shape == (3, 3)
    ref = httpx.post(f"{tiny.url}/v1/models/tiny/explain", json={"inputs": TEXTS, "target": "all"}).json()["results"]
    for b, r in enumerate(ref):
        n = int(lengths[b])
        assert n == len(r["tokens"]) and [str(t, "utf-8") if isinstance(t, bytes) else t for t in tokens[b, :n]] == \
            [t["token"] for t in r["tokens"]]
        assert (credit[b, n:] == 0).all()
        for t, lab in enumerate(targets[b]):
            lab = lab.decode() if isinstance(lab, bytes) else lab
            np.testing.assert_allclose(credit[b, :n, t], r["credit"][lab]["tokens"], atol=1e-6)
            assert credit[b, :n, t].sum() + baseline[b, t] == pytest.approx(logit[b, t], abs=1e-4)
    predicted = client.infer("tiny", [text_input(TEXTS, False)], parameters={"explain": True})
    assert predicted.as_numpy("credit").shape[2] == 1
    assert [t.decode() if isinstance(t, bytes) else t for t in predicted.as_numpy("credit_targets")[:, 0]] == \
        [r["label"] for r in ref]


def test_errors_in_the_protocols_shape(client: triton.InferenceServerClient, tiny: Server) -> None:
    with pytest.raises(InferenceServerException) as e:
        client.infer("nope", [text_input(TEXTS, False)])
    assert e.value.status() == "404" and "nope" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer("tiny", [text_input(TEXTS, False)], outputs=[triton.InferRequestedOutput("nothing")])
    assert e.value.status() == "400" and "nothing" in e.value.message()
    url = f"{tiny.url}/v2/models/tiny/infer"
    for body, status in [({"inputs": []}, 422), ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                                              "data": ["  "]}]}, 422),
                         ({"inputs": [{"name": "img", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, 400),
                         ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a"]}]}, 400),
                         ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [9], "data": ["a"] * 9}]}, 413)]:
        r = httpx.post(url, json=body)
        assert r.status_code == status and set(r.json()) == {"error"}, (body, r.text)
    assert httpx.post(url, content=b"{nope").json()["error"].startswith("body: not valid JSON")
    # half a surrogate pair: valid JSON, no character; a 500 from the tokenizer before
    lone = rb'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["\ud800 x"]}]}'
    r = httpx.post(url, content=lone)
    assert r.status_code == 422 and r.json()["error"].startswith("body: not valid JSON (unexpected end of hex escape")
    r = httpx.post(url, content=rb'{"id": "\ud800", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], '
                                rb'"data": ["a"]}]}')  # the id is echoed: a 500 when the response was written
    assert r.status_code == 422 and r.json()["error"].startswith("body: not valid JSON"), r.text
    for route, body in [("/v1/models/tiny/classify", rb'{"inputs": ["\ud800 x"]}'),
                        ("/v1/models/tiny:predict", rb'{"instances": ["\ud800 x"]}')]:
        r = httpx.post(f"{tiny.url}{route}", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", (route, r.text)
    text = [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]}]
    for params, field in [({"explain": "false"}, "explain"), ({"timeout": True}, "timeout"),
                          ({"timeout": -1}, "timeout"), ({"method": "gradients"}, "method")]:
        r = httpx.post(url, json={"inputs": text, "parameters": params})
        assert r.status_code == 422 and field in r.json()["error"], (params, r.text)
    assert set(httpx.get(f"{tiny.url}/v2/models/tiny/versions/2").json()) == {"error"}


def test_the_functions_of_triton_not_served_are_501_with_what_to_do_instead(
        client: triton.InferenceServerClient, tiny: Server) -> None:
    for call in [lambda: client.get_model_config("tiny"), lambda: client.get_trace_settings(),
                 lambda: client.update_log_settings({"log_info": True}),
                 lambda: client.get_system_shared_memory_status(), lambda: client.unregister_cuda_shared_memory()]:
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "501" and "not served by this server" in e.value.message(), e.value.message()
    for what, methods, paths, instead in NOT_SERVED:
        for method in methods:
            for path in paths:
                url = tiny.url + "/v2" + path.format(model="tiny", version="1", name="region")
                r = httpx.request(method, url)
                assert r.status_code == 501 and r.json() == {"error": f"{what} is not served by this server: "
                                                                      f"{instead}"}, (method, url, r.text)
    r = httpx.post(f"{tiny.url}/v2/models/tiny/config")
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    assert httpx.get(f"{tiny.url}/v2/models/tiny/configs").status_code == 404
    assert "/config" not in httpx.get(f"{tiny.url}/openapi.json").text


def test_v2_needs_the_api_key_but_health_does_not(keyed: Server) -> None:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    r = httpx.post(f"{keyed.url}/v2/models/tiny/infer", json=body)
    assert r.status_code == 401 and set(r.json()) == {"error"}
    ok = httpx.post(f"{keyed.url}/v2/models/tiny/infer", json=body, headers={"Authorization": "Bearer k1"})
    assert ok.status_code == 200
    assert httpx.get(f"{keyed.url}/v2/health/ready").json() == {"ready": True}


def test_kserve_v1_predict_and_explain_equal_our_routes(tiny: Server) -> None:
    instances = [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2]]
    pred = httpx.post(f"{tiny.url}/v1/models/tiny:predict", json={"instances": instances})
    assert pred.status_code == 200, pred.text
    ours = httpx.post(f"{tiny.url}/v1/models/tiny/classify", json={"inputs": TEXTS}).json()["results"]
    assert pred.json()["predictions"] == [{k: r[k] for k in ("label", "score", "scores")} for r in ours]
    exp = httpx.post(f"{tiny.url}/v1/models/tiny:explain", json={"instances": instances, "target": "all"})
    assert exp.status_code == 200, exp.text
    ours = httpx.post(f"{tiny.url}/v1/models/tiny/explain", json={"inputs": TEXTS, "target": "all"}).json()
    assert exp.json()["explanations"] == ours["results"]
    bad = httpx.post(f"{tiny.url}/v1/models/tiny:predict", json={"instances": []})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "validation_error"
    assert httpx.post(f"{tiny.url}/v1/models/nope:predict", json={"instances": ["a"]}).status_code == 404
    for target, got in (([], "got an empty list"), (7, "got a number (7)")):  # as on /v1/.../explain, not a 500
        bad = httpx.post(f"{tiny.url}/v1/models/tiny:explain", json={"instances": ["a"], "target": target})
        assert bad.status_code == 422, bad.text
        assert bad.json()["error"]["message"] == f'target: a label, a list of labels, or "all"; {got}'


def test_kserve_v1_takes_its_options_in_parameters_as_vertex_ai_sends_them(tiny: Server) -> None:
    url = f"{tiny.url}/v1/models/tiny"
    for verb, options in (("predict", {"raw_scores": True, "truncate": True}),
                          ("explain", {"target": "all", "method": "shares"})):
        top = httpx.post(f"{url}:{verb}", json={"instances": TEXTS, **options}).json()
        nested = httpx.post(f"{url}:{verb}", json={"instances": TEXTS, "parameters": options})
        assert nested.status_code == 200 and nested.json() == top, nested.text
    assert httpx.post(f"{url}:predict", json={"instances": TEXTS, "parameters": None}).status_code == 200
    for parameters, says in (({"raw_scores": False}, "['raw_scores'] given both in the body and in parameters"),
                             (3, "parameters must be an object of options; got a number (3)"),
                             ({"parameters": {}}, "['parameters'] given both"), ({"top_k": 1}, "top_k")):
        r = httpx.post(f"{url}:predict", json={"instances": TEXTS, "raw_scores": True, "parameters": parameters})
        assert r.status_code == 422 and says in r.json()["error"]["message"], r.text


def test_kserve_v1_verbs_misused_are_explained(tiny: Server) -> None:
    """GET on a verb, or a verb KServe V1 does not have: not 'unknown model tiny:predict' nor 'use GET'."""
    r = httpx.get(f"{tiny.url}/v1/models/tiny:predict")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    assert r.json()["error"]["message"] == "GET is not allowed on /v1/models/tiny:predict; use POST"
    r = httpx.post(f"{tiny.url}/v1/models/tiny:predcit", json={"instances": ["a"]})
    assert r.status_code == 404 and "no KServe V1 verb ':predcit'" in r.json()["error"]["message"], r.text
    r = httpx.get(f"{tiny.url}/v1/models/tiny")  # a model's own path is still its metadata, with KServe V1's readiness
    assert r.status_code == 200 and r.json()["name"] == "tiny" and r.json()["ready"] is True
    r = httpx.get(f"{tiny.url}/v1/models/nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]  # not ready: KServe V1's 404
