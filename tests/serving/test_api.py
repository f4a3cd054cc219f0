"""The API over HTTP against a real server with the tiny model."""

import asyncio
import gzip
import json
import zlib
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.serving.api.app import create_app
from tests.serving.server import Server

TEXTS = ["the first text", "a second, somewhat longer text. It has two sentences!", "x",
         "Long one. " * 40]


def post(server: Server, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, code: str, needle: str = "") -> None:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == code and needle in err["message"], err


def test_classify_orders_results_and_sums_to_one(tiny: Server) -> None:
    r = post(tiny, "/v1/models/tiny/classify", {"inputs": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny" and len(body["results"]) == len(TEXTS)
    for res in body["results"]:
        assert set(res["scores"]) == {"alpha", "beta", "gamma"}
        assert abs(sum(res["scores"].values()) - 1) < 1e-5
        assert res["label"] == max(res["scores"], key=res["scores"].get) and res["score"] == res["scores"][res["label"]]
        assert res["explanation"] is None
    default = post(tiny, "/v1/classify", {"inputs": TEXTS}).json()
    assert default["results"] == body["results"]


def test_request_id_echoed_or_generated(tiny: Server) -> None:
    r = post(tiny, "/v1/classify", {"inputs": ["a"]}, headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    for given, echoed in [("x" * 5000, "x" * 200), ("caf\xe9 1", "caf1"), ("\xe9\xe9", None)]:  # long, non-ASCII, none
        r = httpx.get(f"{tiny.url}/healthz", headers=[("X-Request-ID", given.encode("latin-1"))])
        assert r.headers["x-request-id"] == echoed if echoed else len(r.headers["x-request-id"]) == 32
    assert len(httpx.get(f"{tiny.url}/healthz").headers["x-request-id"]) == 32


def test_classify_with_explain_gives_token_credit_for_the_predicted_label(tiny: Server) -> None:
    res = post(tiny, "/v1/classify", {"inputs": [TEXTS[1]], "explain": True}).json()["results"][0]
    exp = res["explanation"]
    assert exp["target"] == res["label"]
    assert [t["token"] for t in exp["tokens"]][:3] == ["a", "second", ","]
    for t in exp["tokens"]:
        assert TEXTS[1][t["start"]:t["end"]].lower() == t["token"].removeprefix("##")
    # completeness, checkable by the client: token credit + special tokens + baseline = (contrast) logit
    assert exp["method"] == "contribution" and exp["contrast"] is True
    total = sum(t["credit"] for t in exp["tokens"]) + exp["special"] + exp["baseline"]
    assert total == pytest.approx(exp["logit"], abs=1e-4)
    plain = post(tiny, "/v1/classify", {"inputs": [TEXTS[1]], "explain": True, "contrast": False}).json()
    plain_exp = plain["results"][0]["explanation"]
    assert plain_exp["contrast"] is False and plain_exp["logit"] != pytest.approx(exp["logit"])
    total = sum(t["credit"] for t in plain_exp["tokens"]) + plain_exp["special"] + plain_exp["baseline"]
    assert total == pytest.approx(plain_exp["logit"], abs=1e-4)


def test_explain_credit_sums_to_logit_and_shares_stay_available(tiny: Server) -> None:
    res = post(tiny, "/v1/explain", {"inputs": [TEXTS[1]], "target": "all"}).json()["results"][0]
    assert res["method"] == "contribution" and res["contrast"] is True
    logits = {lab: c["logit"] for lab, c in res["credit"].items()}
    assert sum(logits.values()) == pytest.approx(0, abs=1e-5)  # contrast form: centred over the labels
    for c in res["credit"].values():
        assert sum(c["tokens"]) + c["baseline"] == pytest.approx(c["logit"], abs=1e-4)
        words = sum(w["credit"] for w in c["words"])
        specials = sum(v for v, t in zip(c["tokens"], res["tokens"], strict=True) if t["special"])
        assert words + specials == pytest.approx(sum(c["tokens"]), abs=1e-4)
        assert sum(s["credit"] for s in c["sentences"]) == pytest.approx(words, abs=1e-4)
    shares = post(tiny, "/v1/explain", {"inputs": [TEXTS[1]], "target": "all", "method": "shares"}).json()
    sh = shares["results"][0]
    assert sh["method"] == "shares" and sh["contrast"] is False
    assert all(c["logit"] is None and c["baseline"] is None for c in sh["credit"].values())
    assert sh["credit"]["beta"]["tokens"] != pytest.approx(res["credit"]["beta"]["tokens"], abs=1e-3)
    assert_error(post(tiny, "/v1/explain", {"inputs": ["ok"], "method": "gradient"}), 422, "validation_error",
                 "method")


def test_explain_views_targets_matrix_and_phi(tiny: Server) -> None:
    text = TEXTS[1]
    r = post(tiny, "/v1/models/tiny/explain", {"inputs": [text], "target": "all", "include_matrix": True,
                                                "include_phi": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["labels"] == ["alpha", "beta", "gamma"]
    res = body["results"][0]
    n = len(res["tokens"])
    assert res["tokens"][0]["special"] and res["tokens"][-1]["special"]
    assert res["targets"] == ["alpha", "beta", "gamma"]
    c = res["credit"]["beta"]
    assert len(c["tokens"]) == n and len(c["depth"]) == n and len(c["depth"][0]) == 3
    assert [s["text"] for s in c["sentences"]] == ["a second, somewhat longer text.", "It has two sentences!"]
    assert [w["text"] for w in c["words"]][:3] == ["a", "second", ","]
    assert abs(sum(c["tokens"]) - sum(map(sum, c["depth"]))) < 1e-3
    assert len(res["matrix"]) == n and len(res["matrix"][0]) == 3 and len(res["matrix"][0][0]) == 3
    assert res["matrix"][1][2][1] == pytest.approx(c["depth"][1][2], abs=1e-6)
    phi1, phi2, phi3 = res["phi"]
    assert len(phi1) == n * 3 and len(phi1[0]) == 8 and len(phi2) == 8 and len(phi3[0]) == 3
    one = post(tiny, "/v1/explain", {"inputs": [text], "target": ["gamma", "alpha"]}).json()["results"][0]
    assert one["targets"] == ["gamma", "alpha"] and one["matrix"] is None and one["phi"] is None
    assert one["credit"]["gamma"]["tokens"] == pytest.approx(res["credit"]["gamma"]["tokens"], abs=1e-5)
    default = post(tiny, "/v1/explain", {"inputs": [text]}).json()["results"][0]
    assert default["targets"] == [default["label"]]


def test_batch_invariance_through_the_api(tiny: Server) -> None:
    alone = [post(tiny, "/v1/explain", {"inputs": [t], "target": "all"}).json()["results"][0] for t in TEXTS]
    together = post(tiny, "/v1/explain", {"inputs": TEXTS, "target": "all"}).json()["results"]

    async def concurrently() -> list[dict]:
        async with httpx.AsyncClient(base_url=tiny.url, timeout=30) as client:
            rs = await asyncio.gather(*(client.post("/v1/explain", json={"inputs": [t], "target": "all"})
                                        for t in TEXTS * 3))
        return [r.json()["results"][0] for r in rs]

    mixed = asyncio.run(concurrently())
    for k, ref in enumerate(alone):
        for other in (together[k], mixed[k], mixed[k + len(TEXTS)]):
            for lab in ref["scores"]:
                assert abs(other["scores"][lab] - ref["scores"][lab]) <= 1e-5
                diffs = [abs(a - b) for a, b in zip(other["credit"][lab]["tokens"], ref["credit"][lab]["tokens"],
                                                    strict=True)]
                assert max(diffs) <= 1e-5


@pytest.mark.parametrize(("body", "field"), [
    ({}, "inputs"),
    ({"inputs": []}, "inputs"),
    ({"inputs": "not a list"}, "inputs"),
    ({"inputs": [1, 2]}, "inputs.0"),
    ({"inputs": [""]}, "inputs.0"),
    ({"inputs": ["ok", "   \n\t"]}, "inputs.1"),
    ({"inputs": ["ok"], "unknown": 1}, "unknown"),
    ({"inputs": ["ok"], "explain": "maybe"}, "explain"),
    ({"inputs": ["ok"], "timeout_s": -1}, "timeout_s"),
    ({"inputs": ["ok"], "timeout_s": True}, "timeout_s"),
    ({"inputs": ["ok"], "explain": 0}, "explain"),
    ({"inputs": ["ok"], "timeout_s": 10_000}, "timeout_s"),
])
def test_invalid_bodies_are_422_with_the_field(tiny: Server, body: dict, field: str) -> None:
    r = post(tiny, "/v1/classify", body)
    assert_error(r, 422, "validation_error", field)


def test_invalid_target_is_422(tiny: Server) -> None:
    assert_error(post(tiny, "/v1/explain", {"inputs": ["ok"], "target": "nope"}), 422, "validation_error", "target")
    assert_error(post(tiny, "/v1/explain", {"inputs": ["ok"], "target": []}), 422, "validation_error", "target")


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/classify", {"models": "tiny"}, 'models: a list of model names, or "all" for every loaded model; got the '
                                         'string \'tiny\' (one model: ["tiny"])'),
    ("/v1/classify", {"models": 3}, 'models: a list of model names, or "all" for every loaded model; got a number (3)'),
    ("/v1/explain", {"models": ["tiny", None]}, "models: a list of model names, or \"all\" for every loaded model; "
                                                "item 1 is null"),
    ("/v1/explain", {"target": 2}, 'target: a label, a list of labels, or "all"; got a number (2)'),
    ("/v1/explain", {"target": ["pos", ""]}, 'target: a label, a list of labels, or "all"; item 1 is empty'),
    ("/v1/classify", {"models": "m" * 100}, 'models: a list of model names, or "all" for every loaded model; got the '
                                           f"string '{'m' * 57}...' (one model: [\"{'m' * 57}...\"])"),
])
def test_models_and_targets_of_the_wrong_kind_say_what_is_expected(tiny: Server, path: str, body: dict,
                                                                  message: str) -> None:
    # one message per field, not one per branch of the field's type ('models.list[constrained-str]: Input should be
    # a valid list; models.literal['all']: Input should be 'all'')
    r = post(tiny, path, {"inputs": ["ok"], **body})
    assert_error(r, 422, "validation_error")
    assert r.json()["error"]["message"] == message
    assert [d["field"] for d in r.json()["error"]["details"]] == [message.split(":")[0]]


def test_all_in_a_list_of_models_is_404_with_the_way_to_ask_every_model(tiny: Server) -> None:
    r = post(tiny, "/v1/classify", {"inputs": ["ok"], "models": ["all"]})
    assert_error(r, 404, "not_found", '"models": "all" (not in a list) asks every loaded model')


def test_invalid_json_is_422(tiny: Server) -> None:
    r = httpx.post(f"{tiny.url}/v1/classify", content=b"{nope", headers={"Content-Type": "application/json"})
    assert_error(r, 422, "validation_error")


def test_limits_are_413(tiny: Server) -> None:
    assert_error(post(tiny, "/v1/classify", {"inputs": ["a"] * 9}), 413, "payload_too_large", "too many inputs")
    assert_error(post(tiny, "/v1/classify", {"inputs": ["ok", "y" * 2001]}), 413, "payload_too_large", "inputs.1")
    big = post(tiny, "/v1/classify", {"inputs": ["z" * 30000]})
    assert_error(big, 413, "payload_too_large", "body")
    assert "x-request-id" in big.headers
    assert_error(post(tiny, "/v1/explain", {"inputs": [TEXTS[3]] * 2, "include_phi": True,
                                                "include_matrix": True}), 413,
                 "payload_too_large", "include_matrix/include_phi")


def test_unknown_model_route_method_and_media_type(tiny: Server) -> None:
    assert_error(post(tiny, "/v1/models/nope/classify", {"inputs": ["a"]}), 404, "not_found", "nope")
    assert_error(httpx.get(f"{tiny.url}/v1/models/nope"), 404, "not_found", "nope")
    assert_error(httpx.get(f"{tiny.url}/nowhere"), 404, "not_found")
    assert_error(httpx.get(f"{tiny.url}/v1/classify"), 405, "method_not_allowed",
                 "GET is not allowed on /v1/classify; use POST")
    assert_error(httpx.put(f"{tiny.url}/v1/models"), 405, "method_not_allowed", "use GET")
    r = httpx.post(f"{tiny.url}/v1/classify", content=b"hello", headers={"Content-Type": "text/plain"})
    assert_error(r, 415, "unsupported_media_type")
    body = json.dumps({"inputs": TEXTS}).encode()
    for path in ("/v1/classify", "/v1/explain"):  # a compressed body is read as sent, as Triton reads it
        want = post(tiny, path, {"inputs": TEXTS}).json()
        for coding, packed in [("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                               ("GZip", gzip.compress(body))]:
            r = httpx.post(f"{tiny.url}{path}", content=packed,
                           headers={"Content-Type": "application/json", "Content-Encoding": coding})
            assert r.status_code == 200 and r.json() == want, (coding, r.text)
        r = httpx.post(f"{tiny.url}{path}", content=body, headers={"Content-Type": "application/json",
                                                                   "Content-Encoding": "br"})
        assert_error(r, 415, "unsupported_media_type", "Content-Encoding 'br' is not supported")
        assert r.headers["accept-encoding"] == "gzip, deflate"
        for packed, says in [(body, "body: not valid gzip (Error -3 while decompressing data: incorrect header"),
                             (gzip.compress(body)[:-12], "body: not valid gzip (the stream ends before its end)"),
                             (gzip.compress(body) + b"x", "body: not valid gzip (data after the end of the stream)")]:
            r = httpx.post(f"{tiny.url}{path}", content=packed,
                           headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
            assert_error(r, 400, "bad_request", says)
    bomb = gzip.compress(b'{"inputs": ["' + b"a " * 1_500_000 + b'"]}')  # 3 MB once decompressed, in a few kB
    r = httpx.post(f"{tiny.url}/v1/classify", content=bomb,
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert len(bomb) < 10_000
    assert_error(r, 413, "payload_too_large", "body larger than 20000 bytes once decompressed")
    r = httpx.post(f"{tiny.url}/v1/classify", content=b'{"inputs": ["a"]}',
                   headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text
    for path in ("/v1/classify", "/v1/explain"):  # a body that cannot be read says why
        for body, says in [(b'{"inputs": ["\xff\xfe"]}', "'utf-8' codec can't decode byte 0xff in position 13"),
                           (b'{"inputs": [1,}', "body: not valid JSON (Expecting value at character 14)"),
                           (b'{"inputs": ["x', "body: not valid JSON (Unterminated string starting at character 12)"),
                           (b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", "maximum recursion depth exceeded")]:
            r = httpx.post(f"{tiny.url}{path}", content=body, headers={"Content-Type": "application/json"})
            assert_error(r, 422, "validation_error", says)


def test_timeout_above_the_server_maximum_is_not_refused(tiny: Server) -> None:
    """Accepted (the cap itself: ``test_heads.test_a_timeout_above_the_maximum_is_capped``)."""
    r = post(tiny, "/v1/classify", {"inputs": ["ok"], "timeout_s": 3000})
    assert r.status_code == 200 and r.json()["results"][0]["label"] in ("alpha", "beta", "gamma")


def test_models_endpoints(tiny: Server) -> None:
    body = httpx.get(f"{tiny.url}/v1/models").json()
    assert body["default"] == "tiny" and [m["name"] for m in body["models"]] == ["tiny"]
    info = httpx.get(f"{tiny.url}/v1/models/tiny").json()
    assert info["labels"] == ["alpha", "beta", "gamma"] and info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["max_length"] == 16 and info["parameters"]["head"] > 0 and info["backbone"]["d_depth"] == 3
    assert info["evaluation"] == {"note": "random weights"}


def test_the_openapi_document_and_the_routes_are_built_at_start(tmp_path: Path) -> None:
    """What a route's first request would build (its validators; the OpenAPI document) is built as the server
    starts, while its models load: the first requests are answered as fast as the next."""
    app = create_app(Settings(model_repository=tmp_path, model_control="explicit", admin_keys="a"))  # (no models)
    assert app.openapi_schema is None
    with TestClient(app):  # started, no request made yet
        assert app.openapi_schema is not None
        assert {"/v1/classify", "/v2/models/{model}/infer", "/predict", "/classify"} <= set(app.openapi_schema["paths"])


def test_health_and_openapi(tiny: Server) -> None:
    assert httpx.get(f"{tiny.url}/healthz").json()["status"] == "ok"
    assert httpx.get(f"{tiny.url}/readyz").json() == {"status": "ok", "models": ["tiny"]}
    for path in ("/healthz", "/readyz"):  # a probe that checks with HEAD: the GET's status and headers, no body
        head, get = httpx.head(f"{tiny.url}{path}", timeout=5), httpx.get(f"{tiny.url}{path}")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))
    assert httpx.head(f"{tiny.url}/metrics", timeout=5).status_code == 405  # answered, not held (it hung)
    spec = httpx.get(f"{tiny.url}/openapi.json").json()
    assert {"/v1/classify", "/v1/explain", "/v1/models/{model}/classify", "/v1/models/{model}/explain",
            "/v1/models", "/healthz", "/readyz"} <= set(spec["paths"])
    assert set(spec["paths"]["/healthz"]) == set(spec["paths"]["/readyz"]) == {"get"}
    assert httpx.get(f"{tiny.url}/docs").status_code == 200
