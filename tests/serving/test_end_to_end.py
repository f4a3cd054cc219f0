"""End-to-end credit served: ``"method": "end_to_end"`` on /v1, OIP v2 and KServe V1 for a BERT-family backbone,
with the same completeness a client can check as the value path's; a backbone whose layers it does not know answers
422 naming the reason, and says which methods it offers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from service.config import Settings
from service.serving.api.app import create_app
from tests.conftest import TINY, write_tiny_model
from tests.serving.server import Server
from tests.serving.test_api import assert_error, post

TEXT = "a second, somewhat longer text. It has two sentences!"


def test_a_bert_backbones_model_offers_end_to_end_credit_that_adds_up_to_the_logit(tiny: Server) -> None:
    info = httpx.get(f"{tiny.url}/v1/models/tiny").json()
    assert info["credit_methods"] == ["contribution", "end_to_end", "shares"]
    res = post(tiny, "/v1/models/tiny/explain", {"inputs": [TEXT], "target": "all", "method": "end_to_end"}).json()
    r = res["results"][0]
    value_path = post(tiny, "/v1/models/tiny/explain", {"inputs": [TEXT], "target": "all"}).json()["results"][0]
    assert r["method"] == "end_to_end" and r["contrast"] is True
    for label, c in r["credit"].items():
        assert sum(c["tokens"]) + c["baseline"] == pytest.approx(c["logit"], abs=1e-4)
        assert c["logit"] == pytest.approx(value_path["credit"][label]["logit"], abs=1e-5)
        assert len(c["depth"]) == len(r["tokens"]) and len(c["depth"][0]) == 3  # by the depth the head reads
        assert sum(map(sum, c["depth"])) == pytest.approx(sum(c["tokens"]), abs=1e-4)
    exp = post(tiny, "/v1/classify", {"inputs": [TEXT], "explain": True, "method": "end_to_end",
                                      "contrast": False}).json()["results"][0]["explanation"]
    assert exp["method"] == "end_to_end" and exp["contrast"] is False
    total = sum(t["credit"] for t in exp["tokens"]) + exp["special"] + exp["baseline"]
    assert total == pytest.approx(exp["logit"], abs=1e-4)
    kserve = post(tiny, "/v1/models/tiny:explain", {"instances": [TEXT], "method": "end_to_end"}).json()
    assert kserve["explanations"][0]["method"] == "end_to_end"


def test_oip_v2_gives_end_to_end_credit_with_its_logit_and_baseline(tiny: Server) -> None:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": [TEXT, "short"]}],
            "parameters": {"explain": True, "method": "end_to_end", "target": "all"}}
    out = {o["name"]: o for o in post(tiny, "/v2/models/tiny/infer", body).json()["outputs"]}
    assert {"credit", "logit", "baseline"} <= set(out)
    n, width, t = out["credit"]["shape"]
    credit = torch.tensor(out["credit"]["data"]).view(n, width, t)
    logit, baseline = (torch.tensor(out[k]["data"]).view(n, t) for k in ("logit", "baseline"))
    torch.testing.assert_close(credit.sum(dim=1) + baseline, logit, atol=1e-4, rtol=0)
    bad = post(tiny, "/v2/models/tiny/infer", {**body, "parameters": {"explain": True, "method": "gradient"}})
    assert bad.status_code == 422 and "'end_to_end'" in bad.json()["error"]
    assert_error(post(tiny, "/v1/explain", {"inputs": [TEXT], "method": "end-to-end"}), 422, "validation_error",
                 "method")


@pytest.fixture(scope="module")
def unknown_layers(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Iterator[TestClient]:
    """A server of a model whose backbone is a BERT with an activation the decomposition does not know (SiLU)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    backbone = tmp_path_factory.mktemp("silu-backbone")
    tok = AutoTokenizer.from_pretrained(tiny_backbone_dir)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_act="silu", **TINY)).save_pretrained(backbone)
    tok.save_pretrained(backbone)
    repo = tmp_path_factory.mktemp("silu-repo")
    write_tiny_model(repo, backbone, name="silu")
    with TestClient(create_app(Settings(model_repository=repo, default_model="silu"))) as client:
        for _ in range(600):
            if client.get("/readyz").status_code == 200:
                break
            time.sleep(0.05)
        yield client


def test_a_backbone_whose_layers_are_unknown_answers_422_naming_why(unknown_layers: TestClient) -> None:
    client = unknown_layers
    assert client.get("/v1/models/silu").json()["credit_methods"] == ["contribution", "shares"]
    for path, body in [("/v1/models/silu/explain", {"inputs": [TEXT], "method": "end_to_end"}),
                       ("/v1/classify", {"inputs": [TEXT], "explain": True, "method": "end_to_end"}),
                       ("/v1/models/silu:explain", {"instances": [TEXT], "method": "end_to_end"})]:
        r = client.post(path, json=body)
        assert r.status_code == 422, (path, r.text)
        assert "BERT family" in r.json()["error"]["message"] and "['contribution', 'shares']" in r.text
    v2 = client.post("/v2/models/silu/infer", json={
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [TEXT]}],
        "parameters": {"explain": True, "method": "end_to_end"}})
    assert v2.status_code == 422 and "BERT family" in v2.json()["error"]
    ok = client.post("/v1/models/silu/explain", json={"inputs": [TEXT]})
    assert ok.status_code == 200 and ok.json()["results"][0]["method"] == "contribution"
