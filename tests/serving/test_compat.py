"""The clients people already have: TEI's ``/predict`` and ``/info``, Hugging Face's ``POST /`` (through
``huggingface_hub.InferenceClient`` itself), vLLM's ``/classify``; raw scores and truncation on every API; a
multi-label head served on every API. Scores are checked against ``/v1/classify``'s for the same text and model."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
from huggingface_hub import InferenceClient

from service.serving.api.errors import error_response
from tests.conftest import edit_manifest, write_tiny_model
from tests.serving.server import Server, metric, running

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
LONG = " ".join(WORDS)  # 20 tokens; the tiny models read 14 a chunk (16 with [CLS] and [SEP])
TEXTS = ["a short text", "another text that is somewhat longer than the first one"]
THRESHOLDS = [0.4, 0.5, 0.6]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    """The tiny model, and a multi-label one on the same backbone (its heads share batches with the tiny one's)."""
    repo = tmp_path_factory.mktemp("repo-compat")
    write_tiny_model(repo, tiny_backbone_dir)
    multi = write_tiny_model(repo, tiny_backbone_dir, name="tiny-multi", seed=3)
    edit_manifest(multi, problem_type="multi_label_classification", thresholds=THRESHOLDS)
    return repo


@pytest.fixture(scope="module")
def server(repo: Path, logs: Path) -> Iterator[Server]:
    yield from running(logs, model_repository=repo, default_model="tiny", max_inputs=8, max_wait_ms=150)


def v1(server: Server, text: str, model: str = "tiny", **options: object) -> dict:
    r = httpx.post(f"{server.url}/v1/models/{model}/classify", json={"inputs": [text], **options})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def post_json(url: str, body: dict) -> httpx.Response:
    """``body`` posted as ASCII JSON, so that a text may hold what UTF-8 cannot (half a surrogate pair: escaped)."""
    return httpx.post(url, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def as_dict(ranked: list[dict]) -> dict[str, float]:
    return {item["label"]: item["score"] for item in ranked}


def close(got: dict[str, float], want: dict[str, float], tol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    assert max(abs(got[k] - want[k]) for k in want) <= tol, (got, want)


# --- TEI ---

def test_tei_predict_one_text_and_a_batch_sorted_equal_v1(server: Server) -> None:
    one = httpx.post(f"{server.url}/predict", json={"inputs": TEXTS[0]})
    assert one.status_code == 200, one.text
    ranked = one.json()
    assert [set(x) for x in ranked] == [{"score", "label"}] * 3
    assert [x["score"] for x in ranked] == sorted((x["score"] for x in ranked), reverse=True)  # highest first
    close(as_dict(ranked), v1(server, TEXTS[0])["scores"])
    batch = httpx.post(f"{server.url}/predict", json={"inputs": [[t] for t in TEXTS]}).json()
    assert len(batch) == 2
    for text, got in zip(TEXTS, batch, strict=True):
        close(as_dict(got), v1(server, text)["scores"])
    raw = httpx.post(f"{server.url}/predict", json={"inputs": TEXTS[1], "raw_scores": True}).json()
    close(as_dict(raw), v1(server, TEXTS[1], raw_scores=True)["scores"])
    assert abs(sum(as_dict(raw).values()) - 1) > 1e-3  # logits, not probabilities


def test_tei_model_by_path_and_by_header(server: Server) -> None:
    want = v1(server, TEXTS[0], "tiny-multi")["scores"]
    by_path = httpx.post(f"{server.url}/models/tiny-multi/predict", json={"inputs": TEXTS[0]}).json()
    by_header = httpx.post(f"{server.url}/predict", json={"inputs": TEXTS[0]}, headers={"X-Model": "tiny-multi"})
    close(as_dict(by_path), want)
    close(as_dict(by_header.json()), want)


def test_tei_truncation_keeps_the_side_asked(server: Server) -> None:
    first, last = " ".join(WORDS[:14]), " ".join(WORDS[-14:])
    right = httpx.post(f"{server.url}/predict", json={"inputs": LONG, "truncate": True}).json()
    left = httpx.post(f"{server.url}/predict", json={"inputs": LONG, "truncate": True,
                                                     "truncation_direction": "Left"}).json()
    close(as_dict(right), v1(server, first)["scores"])
    close(as_dict(left), v1(server, last)["scores"])
    lower = httpx.post(f"{server.url}/predict", json={"inputs": LONG, "truncate": True,
                                                      "truncation_direction": "left"}).json()
    close(as_dict(lower), as_dict(left))  # TEI's documentation spells it in lower case
    whole = as_dict(httpx.post(f"{server.url}/predict", json={"inputs": LONG}).json())
    close(whole, v1(server, LONG)["scores"])  # without truncate, read whole in chunks as /v1 reads it
    assert max(abs(whole[k] - as_dict(right)[k]) for k in whole) > 1e-6
    close(v1(server, LONG, truncate=True, truncation_direction="left")["scores"], as_dict(left))  # /v1 too


def test_tei_info_describes_the_model(server: Server) -> None:
    info = httpx.get(f"{server.url}/info").json()
    assert info["model_id"] == "tiny" and info["model_dtype"] == "float32" and info["max_input_length"] == 16
    labels = httpx.get(f"{server.url}/v1/models/tiny").json()["labels"]
    assert info["model_type"]["classifier"] == {"id2label": {str(k): v for k, v in enumerate(labels)},
                                                "label2id": {v: k for k, v in enumerate(labels)}}
    assert info["max_client_batch_size"] == 8
    assert httpx.get(f"{server.url}/info", headers={"X-Model": "tiny-multi"}).json()["model_id"] == "tiny-multi"


@pytest.mark.parametrize(("body", "status", "kind", "says"), [
    ({"inputs": ["query", "document"]}, 422, "Validation", "pair"),
    ({"inputs": [["a", "b"], ["c"]]}, 422, "Validation", "item 0 is a pair"),
    ({"inputs": 3}, 422, "Validation", "a number"),
    ({"inputs": []}, 422, "Validation", "empty list"),
    ({"inputs": "   "}, 422, "Validation", "empty"),
    ({"inputs": ["a", "b", "c"]}, 422, "Validation", "one-text lists"),
    ({"inputs": [[t] for t in "abcdefghi"]}, 413, "Validation", "too many inputs"),
    ({"inputs": "x", "truncation_direction": "Up"}, 422, "Validation", "truncation_direction"),
    ({"inputs": "x", "extra": 1}, 422, "Validation", "extra"),
    ({"inputs": "ok \ud800"}, 422, "Validation", "inputs holds half of a surrogate pair ('\\ud800') at character 3"),
    ({"inputs": [["ok"], ["\udfff"]]}, 422, "Validation", "inputs.1.0 holds half of a surrogate pair"),
])
def test_tei_errors_are_tei_shaped(server: Server, body: dict, status: int, kind: str, says: str) -> None:
    r = post_json(f"{server.url}/predict", body)
    assert r.status_code == status, r.text
    assert r.json().keys() == {"error", "error_type"} and r.json()["error_type"] == kind
    assert says in r.json()["error"]


def test_tei_unknown_model_wrong_type_and_method(server: Server) -> None:
    r = httpx.post(f"{server.url}/models/nope/predict", json={"inputs": "x"})
    assert r.status_code == 404 and "nope" in r.json()["error"] and r.json()["error_type"] == "Validation"
    r = httpx.post(f"{server.url}/predict", content=b"inputs=x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error_type"] == "Validation"
    r = httpx.get(f"{server.url}/predict")
    assert r.status_code == 405 and set(r.json()) == {"error", "error_type"}
    r = httpx.post(f"{server.url}/predict", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "Validation"


# --- Hugging Face's client ---

def test_huggingface_inference_client(server: Server) -> None:
    client = InferenceClient(base_url=server.url)
    want = v1(server, TEXTS[0])
    got = client.text_classification(TEXTS[0])
    assert len(got) == 3  # every label (TEI's flat answer gives this client one)
    close({e.label: e.score for e in got}, want["scores"])
    assert got[0].label == want["label"]
    (top,) = client.text_classification(TEXTS[0], top_k=1)
    assert top.label == want["label"]
    raw = v1(server, TEXTS[0], raw_scores=True)["scores"]
    close({e.label: e.score for e in client.text_classification(TEXTS[0], function_to_apply="none")}, raw)
    sig = {e.label: e.score for e in client.text_classification(TEXTS[0], function_to_apply="sigmoid")}
    close(sig, {k: 1 / (1 + math.exp(-v)) for k, v in raw.items()})
    soft = {e.label: e.score for e in client.text_classification(TEXTS[0], function_to_apply="softmax", top_k=2)}
    assert len(soft) == 2 and all(abs(soft[k] - want["scores"][k]) <= 1e-6 for k in soft)
    one = InferenceClient(base_url=f"{server.url}/models/tiny-multi")  # a model by its path
    close({e.label: e.score for e in one.text_classification(TEXTS[1])}, v1(server, TEXTS[1], "tiny-multi")["scores"])
    endpoint = InferenceClient(server.url, provider="hf-inference")  # as the client asks a TEI Inference Endpoint
    assert endpoint.health_check() is True and endpoint.get_endpoint_info()["model_id"] == "tiny"


def test_huggingface_route_errors(server: Server) -> None:
    for body in ({"inputs": ""}, {"inputs": "x", "parameters": {"top_k": 0}},
                 {"inputs": "x", "parameters": {"function_to_apply": "tanh"}}, {"text": "x"}, {"inputs": "\ud800"}):
        r = post_json(f"{server.url}/", body)
        assert r.status_code == 422 and r.json()["error_type"] == "Validation", (body, r.text)
    r = httpx.post(f"{server.url}/models/nope", json={"inputs": "x"})
    assert r.status_code == 404 and r.json()["error_type"] == "Validation"
    assert httpx.get(f"{server.url}/").headers["content-type"].startswith("text/html")  # the page stays


# --- vLLM ---

def test_vllm_classify(server: Server) -> None:
    r = httpx.post(f"{server.url}/classify", json={"model": "tiny", "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("classify-")
    labels = httpx.get(f"{server.url}/v1/models/tiny").json()["labels"]
    for k, (text, row) in enumerate(zip(TEXTS, body["data"], strict=True)):
        want = v1(server, text)
        assert row["index"] == k and row["label"] == want["label"] and row["num_classes"] == 3
        close(dict(zip(labels, row["probs"], strict=True)), want["scores"])
    tokens = [len(httpx.post(f"{server.url}/v1/explain", json={"inputs": [t]}).json()["results"][0]["tokens"])
              for t in TEXTS]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(tokens)
    one = httpx.post(f"{server.url}/classify", json={"input": TEXTS[0], "use_activation": False}).json()
    close(dict(zip(labels, one["data"][0]["probs"], strict=True)), v1(server, TEXTS[0], raw_scores=True)["scores"])
    for side, words in [(None, WORDS[:6]), ("right", WORDS[:6]), ("left", WORDS[-6:])]:  # vLLM's default: the first
        body = {"input": LONG, "truncate_prompt_tokens": 8, **({"truncation_side": side} if side else {})}
        cut = httpx.post(f"{server.url}/classify", json=body).json()
        assert cut["usage"]["prompt_tokens"] == 8  # 6 words, [CLS] and [SEP]
        close(dict(zip(labels, cut["data"][0]["probs"], strict=True)), v1(server, " ".join(words))["scores"])
    whole = httpx.post(f"{server.url}/classify", json={"input": LONG, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == 16


def test_vllm_classify_takes_token_ids_as_vllm_does(server: Server) -> None:
    """A list of ids (or a list of those) is read as it is, in one chunk: the text's own ids answer as the text."""
    url = f"{server.url}/classify"
    ids = [httpx.post(f"{server.url}/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    labels = httpx.get(f"{server.url}/v1/models/tiny").json()["labels"]
    for sent in (ids[0], ids):
        r = httpx.post(url, json={"model": "tiny", "input": sent})
        assert r.status_code == 200, r.text
        got = r.json()
        lists = [sent] if sent is ids[0] else sent
        assert got["usage"]["prompt_tokens"] == sum(map(len, lists)) and len(got["data"]) == len(lists)
        for row, text in zip(got["data"], TEXTS, strict=False):
            close(dict(zip(labels, row["probs"], strict=True)), v1(server, text)["scores"])
    long = httpx.post(f"{server.url}/tokenize", json={"prompt": LONG}).json()["tokens"]  # 22: more than a chunk
    r = httpx.post(url, json={"input": long})
    assert r.status_code == 400 and "22 token ids, more than the 16 a chunk of this model holds" in r.text
    for side, kept in (("right", long[:8]), ("left", long[-8:])):
        cut = httpx.post(url, json={"input": long, "truncate_prompt_tokens": 8, "truncation_side": side}).json()
        alone = httpx.post(url, json={"input": kept}).json()
        assert cut["usage"]["prompt_tokens"] == 8 and cut["data"] == alone["data"]


def test_vllm_classify_without_special_tokens_and_by_the_older_names_of_use_activation(server: Server) -> None:
    url = f"{server.url}/classify"
    bare = httpx.post(f"{server.url}/tokenize", json={"prompt": TEXTS[1], "add_special_tokens": False}).json()
    got = httpx.post(url, json={"input": TEXTS[1], "add_special_tokens": False}).json()
    assert got["usage"]["prompt_tokens"] == bare["count"]  # its ids alone, as vLLM reads it then
    assert got["data"] == httpx.post(url, json={"input": bare["tokens"]}).json()["data"]
    assert got["data"] != httpx.post(url, json={"input": TEXTS[1]}).json()["data"]
    r = httpx.post(url, json={"input": LONG, "add_special_tokens": False})  # 20 tokens: more than a chunk
    assert r.status_code == 400 and "inputs.0 has 20 token ids, more than the 16" in r.json()["error"]["message"]
    cut = httpx.post(url, json={"input": LONG, "add_special_tokens": False, "truncate_prompt_tokens": 5}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    logits = httpx.post(url, json={"input": TEXTS[0], "use_activation": False}).json()["data"]
    for older in ("softmax", "activation"):
        assert httpx.post(url, json={"input": TEXTS[0], older: False}).json()["data"] == logits
    r = httpx.post(url, json={"input": TEXTS[0], "use_activation": True, "softmax": False})
    assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "says"), [
    ({"input": [[1], []]}, "item 1: an empty list"),
    ({"input": [101, "a"]}, "item 1: the string 'a'"),
    ({"input": [[101], ["a"]]}, "item 1: a list holding other than token ids"),
    ({"input": [101, True]}, "item 1: a boolean"),
    ({"input": [[101, 2023], [102, 30522_000]]}, "30522000 (list 1, position 1) is not a token id"),
    ({"input": [101, 2023], "truncate_prompt_tokens": 0}, "truncation to 0 tokens leaves none to read"),
    ({"input": ["x", "\u200b"], "add_special_tokens": False}, "inputs.1 holds no token ids"),  # the tokenizer drops it
])
def test_vllm_token_ids_errors(server: Server, body: dict, says: str) -> None:
    r = httpx.post(f"{server.url}/classify", json=body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_vllm_clients_find_the_model_in_the_openai_list(server: Server) -> None:
    """vLLM's own example client: the model from ``GET /v1/models``' ``data[0].id``, then ``/classify`` with it."""
    listed = httpx.get(f"{server.url}/v1/models").json()
    assert listed["object"] == "list" and listed["data"][0]["id"] == listed["default"] == "tiny"
    assert sorted(c["id"] for c in listed["data"]) == sorted(m["name"] for m in listed["models"])
    assert all(c["object"] == "model" and c["max_model_len"] == 16 for c in listed["data"])
    r = httpx.post(f"{server.url}/classify", json={"model": listed["data"][0]["id"], "input": TEXTS})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_vllm_answer_id_names_the_request_as_vllm_does(server: Server) -> None:
    """``classify-`` and the client's X-Request-ID, else the body's ``request_id``, else the server's request id."""
    url = f"{server.url}/classify"
    r = httpx.post(url, json={"input": "x", "request_id": "body-1"}, headers={"X-Request-ID": "header-1"})
    assert r.json()["id"] == "classify-header-1" and r.headers["x-request-id"] == "header-1"
    assert httpx.post(url, json={"input": "x", "request_id": "body-1"}).json()["id"] == "classify-body-1"
    r = httpx.post(url, json={"input": "x"})
    assert r.json()["id"] == f"classify-{r.headers['x-request-id']}" and len(r.headers["x-request-id"]) == 32


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"input": 3}, 400, "a text, a list of texts, a list of token ids or a list of those; got a number (3)"),
    ({"input": []}, 400, "empty list"),
    ({"input": ["x", None]}, 400, "item 1"),
    ({"model": "nope", "input": "x"}, 404, "nope"),
    ({"input": "x", "truncate_prompt_tokens": 2}, 400, "no room"),
    ({"input": "x", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": 4, "truncation_side": "middle"}, 400, "truncation_side"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "messages (a chat, which vLLM renders with the model's "
                                                            "chat template) is not taken"),
    ({"input": ["x"] * 9}, 413, "too many inputs"),
    ({"input": ["x", "\ud800"]}, 400, "unable to parse raw data as a unicode string"),
])
def test_vllm_errors_are_vllm_shaped(server: Server, body: dict, status: int, says: str) -> None:
    r = post_json(f"{server.url}/classify", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"} and error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLargeError"}[status]
    assert says in error["message"]


# --- the tokenizer alone: TEI's /tokenize and /decode, vLLM's /tokenize and /detokenize ---

def test_tei_tokenize_answers_the_tokenizers_ids_and_spans_and_decode_reverses_it(
        server: Server, tiny_backbone_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_backbone_dir / "tokenizer.json"))
    tokenizer.no_padding()  # as saved, it pads to 128
    (tokens,) = httpx.post(f"{server.url}/tokenize", json={"inputs": TEXTS[1]}).json()  # one text: a list of one
    assert [t["id"] for t in tokens] == tokenizer.encode(TEXTS[1]).ids
    first, *words, last = tokens
    assert first == {"id": first["id"], "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert last["text"] == "[SEP]" and last["special"] and not any(t["special"] for t in words)
    assert [t["text"] for t in words] == [TEXTS[1][t["start"]:t["stop"]] for t in words]
    assert " ".join(t["text"] for t in words) == TEXTS[1]  # whole words here: each token is one
    # the tokens the model reads: a text of one chunk as /v1/explain shows it
    explained = httpx.post(f"{server.url}/v1/explain", json={"inputs": [TEXTS[1]]}).json()["results"][0]["tokens"]
    assert len(explained) == len(tokens)
    batch = httpx.post(f"{server.url}/tokenize", json={"inputs": TEXTS, "add_special_tokens": False}).json()
    assert [[t["id"] for t in one] for one in batch] == [tokenizer.encode(t, add_special_tokens=False).ids
                                                         for t in TEXTS]
    ids = [[t["id"] for t in one] for one in batch]
    assert httpx.post(f"{server.url}/decode", json={"ids": ids}).json() == TEXTS
    with_special = [t["id"] for t in tokens]
    assert httpx.post(f"{server.url}/decode", json={"ids": with_special}).json() == [TEXTS[1]]  # skipped: TEI's default
    kept = httpx.post(f"{server.url}/decode", json={"ids": with_special, "skip_special_tokens": False}).json()
    assert kept == [f"[CLS] {TEXTS[1]} [SEP]"]
    assert httpx.post(f"{server.url}/tokenize", json={"inputs": ""}).json() == [[first, {**last}]]  # nothing to read


def test_vllm_tokenize_counts_what_classify_reads_and_detokenize_reverses_it(server: Server) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": TEXTS[0]})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got.keys() == {"count", "max_model_len", "tokens", "token_strs"} and got["token_strs"] is None
    read = httpx.post(f"{server.url}/classify", json={"model": "tiny", "input": TEXTS[0]}).json()["usage"]
    assert got["count"] == len(got["tokens"]) == read["prompt_tokens"]
    assert got["max_model_len"] == httpx.get(f"{server.url}/info").json()["max_input_length"] == 16
    tei = httpx.post(f"{server.url}/tokenize", json={"inputs": TEXTS[0]}).json()[0]
    assert got["tokens"] == [t["id"] for t in tei]
    strs = httpx.post(f"{server.url}/tokenize", json={"prompt": TEXTS[0], "return_token_strs": True}).json()
    assert strs["token_strs"] == ["[CLS]", *TEXTS[0].split(), "[SEP]"] and strs["tokens"] == got["tokens"]
    bare = httpx.post(f"{server.url}/tokenize", json={"prompt": TEXTS[0], "add_special_tokens": False}).json()
    assert bare["tokens"] == got["tokens"][1:-1] and bare["count"] == got["count"] - 2
    back = httpx.post(f"{server.url}/detokenize", json={"model": "tiny", "tokens": got["tokens"]}).json()
    assert back == {"prompt": f"[CLS] {TEXTS[0]} [SEP]"}  # special tokens kept, as vLLM decodes


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/tokenize", {"inputs": []}, 422, "at least 1 item"),
    ("/tokenize", {"inputs": 3}, 422, "inputs"),
    ("/tokenize", {"inputs": "x", "prompt_name": "query"}, 422, "no prompts"),
    ("/tokenize", {"inputs": "x", "other": 1}, 422, "other"),
    ("/tokenize", {"inputs": ["x"] * 9}, 413, "too many inputs"),
    ("/tokenize", {"inputs": "\ud800"}, 422, "hex escape"),  # half a surrogate pair: no text
    ("/decode", {"ids": [101, 30522_000]}, 422, "30522000 (list 0, position 1) is not a token id"),
    ("/decode", {"ids": [[1], [2, -3]]}, 422, "-3 (list 1, position 1) is not a token id"),
    ("/decode", {"ids": "x"}, 422, "ids must be a list of token ids or a list of those; got the string 'x'"),
    ("/decode", {"ids": [[1], [2, "a"]]}, 422, "ids.1 must be a list of token ids or a list of those; got item 1: "),
    ("/decode", {"ids": [[1]] * 9}, 413, "too many inputs"),
])
def test_tei_tokenizer_errors_are_tei_shaped(server: Server, path: str, body: dict, status: int, says: str) -> None:
    r = post_json(f"{server.url}{path}", body)
    assert r.status_code == status, r.text
    assert r.json().keys() == {"error", "error_type"} and r.json()["error_type"] == "Validation"
    assert says in r.json()["error"]


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "nope"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}]}, 400, "send it as prompt"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "hex escape"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/detokenize", {"tokens": [-1]}, 400, "-1 (list 0, position 0) is not a token id"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "nope"),
])
def test_vllm_tokenizer_errors_are_vllm_shaped(server: Server, path: str, body: dict, status: int, says: str) -> None:
    r = post_json(f"{server.url}{path}", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"} and error["code"] == status
    assert says in error["message"]


def test_the_tokenizer_routes_take_the_model_from_the_header_or_body(server: Server) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"inputs": "x"}, headers={"X-Model": "nope"})
    assert r.status_code == 404 and r.json()["error_type"] == "Validation" and "nope" in r.json()["error"]
    r = httpx.post(f"{server.url}/decode", json={"ids": [1]}, headers={"X-Model": "tiny-multi"})
    assert r.status_code == 200
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, headers={"X-Model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404  # vLLM's shape, the header's model


def test_health_is_teis_and_vllms_probe_and_sagemakers_ping(server: Server) -> None:
    for path in ("/health", "/ping"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 200 and r.content == b""
        assert httpx.head(f"{server.url}{path}").status_code == 200


def test_sagemakers_invocations_is_teis_predict(server: Server) -> None:
    for body in ({"inputs": TEXTS[0]}, {"inputs": [[t] for t in TEXTS], "raw_scores": True}):
        r = httpx.post(f"{server.url}/invocations", json=body)
        assert r.status_code == 200 and r.json() == httpx.post(f"{server.url}/predict", json=body).json()
    r = httpx.post(f"{server.url}/invocations", json={"inputs": TEXTS[0]}, headers={"X-Model": "tiny-multi"})
    assert as_dict(r.json()).keys() == v1(server, TEXTS[0], "tiny-multi")["scores"].keys()
    r = httpx.post(f"{server.url}/invocations", json={"inputs": ["query", "document"]})
    assert r.status_code == 422 and r.json()["error_type"] == "Validation" and "pair" in r.json()["error"]


# --- one batcher, metrics, documentation ---

@pytest.mark.parametrize(("path", "body"), [("/predict", {"inputs": "from tei"}),
                                          ("/classify", {"input": "from vllm"})])
def test_a_tei_or_vllm_and_a_v1_text_sent_together_share_a_batch(server: Server, path: str, body: dict) -> None:
    bb = "tiny-bert@random"
    # a batch of two first: a batcher whose last batches held one text sends a lone text at once (it never holds
    # one request at a time back), so which of two texts sent together reached it first would decide the count;
    # having seen two, it waits (up to its 150 ms) for a second
    assert httpx.post(f"{server.url}/v1/classify", json={"inputs": ["one", "two"]}).status_code == 200
    page = httpx.get(f"{server.url}/metrics").text
    batches, chunks = (metric(page, f"routing_batch_size_{s}", backbone=bb) for s in ("count", "sum"))

    async def both() -> None:
        async with httpx.AsyncClient(base_url=server.url) as http:
            other, ours = await asyncio.gather(http.post(path, json=body),
                                               http.post("/v1/classify", json={"inputs": ["from v1"]}))
            assert [r.status_code for r in (other, ours)] == [200] * 2

    asyncio.run(both())  # the server waits up to 150 ms for a batch to fill: both texts arrive within it
    page = httpx.get(f"{server.url}/metrics").text
    assert metric(page, "routing_batch_size_count", backbone=bb) == batches + 1
    assert metric(page, "routing_batch_size_sum", backbone=bb) == chunks + 2


def test_metrics_count_the_new_routes_as_v1(server: Server) -> None:
    def counted(endpoint: str, status: str) -> float:
        return metric(httpx.get(f"{server.url}/metrics").text, "routing_requests_total", endpoint=endpoint,
                      status=status)

    cases = [("/predict", {"inputs": "x"}, "200"), ("/predict", {"inputs": ["a", "b"]}, "422"),
             ("/classify", {"input": "x"}, "200"), ("/classify", {"input": 1}, "400"), ("/", {"inputs": "x"}, "200")]
    for path, body, status in cases:
        before = counted(path, status)
        assert str(httpx.post(f"{server.url}{path}", json=body).status_code) == status
        assert counted(path, status) == before + 1, (path, status)


def test_openapi_documents_the_new_routes(server: Server) -> None:
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    for path in ("/predict", "/models/{model}/predict", "/info", "/classify", "/", "/models/{model}", "/tokenize",
                 "/decode", "/detokenize", "/health", "/ping", "/invocations"):
        assert path in paths, path
    assert "424" in paths["/predict"]["post"]["responses"] and "400" in paths["/classify"]["post"]["responses"]
    props = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]["ClassifyRequest"]["properties"]
    assert {"raw_scores", "truncate", "truncation_direction"} <= set(props)


# --- raw scores and truncation on the other protocols ---

def test_oip_and_kserve_raw_scores_and_truncation(server: Server) -> None:
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    labels = httpx.get(f"{server.url}/v1/models/tiny").json()["labels"]

    def infer(text: str, **parameters: object) -> np.ndarray:
        inp = triton_http.InferInput("text", [1], "BYTES")
        inp.set_data_from_numpy(np.array([text.encode()], dtype=object))
        return client.infer("tiny", [inp], parameters=parameters or None).as_numpy("probabilities")[0]

    close(dict(zip(labels, infer(TEXTS[0], raw_scores=True).tolist(), strict=True)),
          v1(server, TEXTS[0], raw_scores=True)["scores"], 1e-5)
    close(dict(zip(labels, infer(LONG, truncate=True, truncation_direction="left").tolist(), strict=True)),
          v1(server, " ".join(WORDS[-14:]))["scores"], 1e-5)
    bad = httpx.post(f"{server.url}/v2/models/tiny/infer", json={
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
        "parameters": {"raw_scores": "yes"}})
    assert bad.status_code == 422 and bad.json() == {"error": "parameters.raw_scores must be a bool"}
    pred = httpx.post(f"{server.url}/v1/models/tiny:predict", json={"instances": [LONG], "raw_scores": True,
                                                                    "truncate": True}).json()["predictions"][0]
    close(pred["scores"], v1(server, " ".join(WORDS[:14]), raw_scores=True)["scores"])


# --- a multi-label head on every API ---

def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_a_multi_label_model_answers_independent_probabilities_everywhere(server: Server) -> None:
    assert httpx.get(f"{server.url}/v1/models/tiny-multi").json()["problem_type"] == "multi_label_classification"
    assert httpx.get(f"{server.url}/v1/models/tiny").json()["problem_type"] == "single_label_classification"
    for text in [*TEXTS, LONG]:
        got, raw = v1(server, text, "tiny-multi"), v1(server, text, "tiny-multi", raw_scores=True)["scores"]
        close(got["scores"], {k: sigmoid(v) for k, v in raw.items()})
        assert got["labels"] == [k for k, t in zip(got["scores"], THRESHOLDS, strict=True) if got["scores"][k] >= t]
        assert got["label"] == max(got["scores"], key=got["scores"].__getitem__)
        assert "labels" not in v1(server, text)  # a single-label model's answer is as before
        close(as_dict(httpx.post(f"{server.url}/models/tiny-multi/predict", json={"inputs": text}).json()),
              got["scores"])
        vllm = httpx.post(f"{server.url}/classify", json={"model": "tiny-multi", "input": text}).json()
        close(dict(zip(got["scores"], vllm["data"][0]["probs"], strict=True)), got["scores"])
        kserve = httpx.post(f"{server.url}/v1/models/tiny-multi:predict", json={"instances": [text]}).json()
        assert kserve["predictions"][0]["labels"] == got["labels"]
        close(kserve["predictions"][0]["scores"], got["scores"])
        oip = httpx.post(f"{server.url}/v2/models/tiny-multi/infer", json={
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}).json()
        probabilities = next(o for o in oip["outputs"] if o["name"] == "probabilities")["data"]
        close(dict(zip(got["scores"], probabilities, strict=True)), got["scores"])
    assert any(abs(sum(v1(server, t, "tiny-multi")["scores"].values()) - 1) > 1e-3 for t in TEXTS)


def test_a_multi_label_models_credit_splits_each_labels_own_logit(server: Server) -> None:
    body = {"inputs": [TEXTS[1]], "target": "all"}  # contrast (the default) does not apply to a multi-label head
    r = httpx.post(f"{server.url}/v1/models/tiny-multi/explain", json=body)
    assert r.status_code == 200, r.text
    res = r.json()["results"][0]
    raw = v1(server, TEXTS[1], "tiny-multi", raw_scores=True)["scores"]
    assert res["contrast"] is False
    for label, c in res["credit"].items():
        assert abs(sum(c["tokens"]) + c["baseline"] - c["logit"]) <= 1e-4
        assert abs(c["logit"] - raw[label]) <= 1e-4  # the label's own logit, not a contrast of labels
    assert res["labels"] == v1(server, TEXTS[1], "tiny-multi")["labels"]


def test_the_same_answers_from_two_fronts(server: Server, repo: Path, logs: Path) -> None:
    """Behind two fronts (the engine host computes; the wire carries the logits and a multi-label head's labels)
    every one of these APIs answers as one front does."""
    calls = [("/predict", {"inputs": [[t] for t in TEXTS], "raw_scores": True}, {}),
             ("/models/tiny-multi/predict", {"inputs": LONG, "truncate": True}, {}),
             ("/", {"inputs": TEXTS[0], "parameters": {"function_to_apply": "sigmoid"}}, {"X-Model": "tiny-multi"}),
             ("/v1/models/tiny-multi/classify", {"inputs": TEXTS}, {}),
             ("/v1/models/tiny-multi:predict", {"instances": TEXTS, "raw_scores": True}, {}),
             ("/tokenize", {"inputs": TEXTS}, {"X-Model": "tiny-multi"}),  # a front's tokenizer, and the host's none
             ("/tokenize", {"model": "tiny-multi", "prompt": LONG, "return_token_strs": True}, {}),
             ("/decode", {"ids": [[101, 2028], [2048, 102]]}, {})]

    def answers(s: Server) -> list[object]:
        got = []
        for path, body, headers in calls:
            r = httpx.post(f"{s.url}{path}", json=body, headers=headers)
            assert r.status_code == 200, (path, r.text)
            got.append(r.json())
        vllm = httpx.post(f"{s.url}/classify", json={"model": "tiny-multi", "input": TEXTS}).json()
        ids = httpx.post(f"{s.url}/classify", json={"input": [[101, 2028, 102], [101, 2048, 2093, 102]]}).json()
        return [*got, vllm["data"], vllm["usage"], ids["data"], ids["usage"]]

    def near(a: object, b: object) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return abs(a - b) <= 1e-5
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(near(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(near(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    for two in running(logs, model_repository=repo, default_model="tiny", max_inputs=8, workers=2):
        assert near(answers(two), answers(server))


OIP_BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}


@pytest.mark.parametrize(("path", "body", "whose"), [
    ("/v1/classify", {"model": "tiny", "input": "x"}, "vLLM's or SGLang's classification API: send it to POST "
                                                      "/classify"),
    ("/v1/models/tiny/explain", {"instances": ["x"]}, "KServe V1: send it to POST /v1/models/{model}:predict"),
    ("/v1/classify", OIP_BODY, "the Open Inference Protocol: send it to POST /v2/models/{model}/infer"),
    ("/v1/classify", {"inputs": "x", "parameters": {"top_k": 1}}, "TEI's or Hugging Face's API: send it to POST "
                                                                   "/predict or POST /"),
    ("/classify", {"inputs": ["x"]}, "this service's own API: send it to POST /v1/classify"),
    ("/v1/models/tiny:predict", {"inputs": ["x"]}, "this service's own API"),
    ("/v2/models/tiny/infer", {"inputs": ["x"]}, "this service's own API"),
    ("/v2/models/tiny/infer", {"instances": ["x"]}, "KServe V1"),
    ("/predict", {"input": "x"}, "vLLM's or SGLang's"),
    ("/", {"instances": ["x"]}, "KServe V1"),
    ("/models/tiny", OIP_BODY, "the Open Inference Protocol"),
])
def test_a_body_of_another_api_is_refused_with_where_that_api_is_served(server: Server, path: str, body: dict,
                                                                       whose: str) -> None:
    r = post_json(f"{server.url}{path}", body)
    assert r.status_code in (400, 422), r.text
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert message.endswith(")") and f" (a body of {whose}" in message, message


def test_a_refused_body_of_the_routes_own_api_names_no_other(server: Server) -> None:
    for path, body in [("/v1/classify", {"inputs": [1]}), ("/classify", {"input": 3}),
                       ("/v1/models/tiny:predict", {"instances": 3}), ("/v2/models/tiny/infer", {"inputs": []}),
                       ("/predict", {"inputs": ""}), ("/predict", {"inputs": ["a", "b"]}),  # TEI's pair
                       ("/v1/classify", {"inputs": ["a"], "instances": ["a"]}), ("/", {"inputs": ["a", 3]})]:
        r = post_json(f"{server.url}{path}", body)
        assert r.status_code in (400, 413, 422) and "a body of" not in r.text, (path, r.text)


@pytest.mark.parametrize(("path", "status", "why", "want_status", "want"), [
    ("/predict", 503, "overloaded", 429, {"error_type": "Overloaded"}),
    ("/models/m/predict", 503, "loading", 503, {"error_type": "Unhealthy"}),
    ("/", 503, "draining", 503, {"error_type": "Unhealthy"}),
    ("/predict", 500, None, 424, {"error_type": "Backend"}),
    ("/info", 504, None, 424, {"error_type": "Backend"}),
    ("/predict", 413, None, 413, {"error_type": "Validation"}),
    ("/classify", 503, "overloaded", 503, {"error": {"message": "m", "type": "ServiceUnavailableError",
                                                     "param": None, "code": 503}}),
    ("/classify", 500, None, 500, {"error": {"message": "m", "type": "InternalServerError", "param": None,
                                             "code": 500}}),
    ("/classify", 422, None, 400, {"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}}),
    ("/v1/classify", 503, "overloaded", 503, {"error": {"code": "service_unavailable", "message": "m"}}),
])
def test_each_api_answers_a_failure_with_its_own_status_and_shape(path: str, status: int, why: str | None,
                                                                   want_status: int, want: dict) -> None:
    """What the service's failures become on each API's routes (TEI: overloaded is 429, a model failure 424)."""
    response = error_response(status, "m", headers={"Retry-After": "1"}, path=path, why=why)
    body = json.loads(response.body)
    assert response.status_code == want_status and response.headers["retry-after"] == "1"
    assert body == ({"error": "m", **want} if "error_type" in want else want)
