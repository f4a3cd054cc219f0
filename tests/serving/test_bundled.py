"""The bundled models, served as the README's main command serves them (real backbone, CPU): one backbone
process for all three, each model as accurate on a sample of its test split as its manifest says (the multi-label
one's micro-F1 too), several models in one request answering as each alone, and the README's examples answering
as it shows them."""

import contextlib
import io
import itertools
import json
import math
import random
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.bench.server import children
from service.training.data import make_dataset, preset_dataset, preset_path, read_examples
from tests.serving.server import Server, running

ROOT = Path(__file__).resolve().parents[2]
SPORT = ("Arsenal beat Chelsea 2-1 in a thrilling Premiership match at Highbury on Saturday, with the striker "
         "scoring twice in the second half to lift the champions back to the top of the league table. ") * 20


@pytest.fixture(scope="module")
def bundled(logs: Path) -> Iterator[Server]:
    yield from running(logs, model_repository=ROOT / "models")


def test_default_is_tweet_sentiment_and_every_model_is_listed(bundled: Server) -> None:
    body = httpx.get(f"{bundled.url}/v1/models").json()
    assert body["default"] == "tweet-sentiment"
    names = {m["name"]: m for m in body["models"]}
    assert set(names) == {"tweet-sentiment", "bbc-news-topics", "bbc-news-digests"}
    for m in names.values():
        assert m["backbone"]["name"] == "sentence-transformers/all-MiniLM-L6-v2"
        ev = m["evaluation"]
        if m["problem_type"] == "multi_label_classification":
            assert {"micro_f1", "macro_f1"} <= set(ev["head"]) and "micro_f1" in ev["probe_all_layers"]["test"]
            continue
        assert {"accuracy", "macro_f1", "confusion_matrix"} <= set(ev["head"])
        assert "accuracy" in ev["baseline"]["test"]
    assert names["bbc-news-digests"]["problem_type"] == "multi_label_classification"
    assert len(children(bundled.proc.pid)) == 1  # one process holds the backbone and every head


@pytest.mark.parametrize(("model", "n"), [("tweet-sentiment", 300), ("bbc-news-topics", 60)])
def test_each_model_is_as_accurate_as_its_manifest_says(bundled: Server, model: str, n: int) -> None:
    """A seeded sample of the model's test split, classified by the server: its accuracy is within three
    standard errors of the manifest's test accuracy (a wrong head, label order or chunking would miss)."""
    path, opts = preset_path(model)
    test = make_dataset(read_examples(path, **opts), model).test
    pairs = random.Random(0).sample(list(zip(test.texts, test.labels, strict=True)), n)
    labels = httpx.get(f"{bundled.url}/v1/models/{model}").json()["labels"]
    right = 0
    for k in range(0, n, 32):
        batch = pairs[k : k + 32]
        r = httpx.post(f"{bundled.url}/v1/models/{model}/classify", json={"inputs": [t for t, _ in batch]},
                       timeout=120)
        assert r.status_code == 200, r.text[:300]
        right += sum(res["label"] == labels[y] for res, (_, y) in zip(r.json()["results"], batch, strict=True))
    claimed = httpx.get(f"{bundled.url}/v1/models/{model}").json()["evaluation"]["head"]["accuracy"]
    se = math.sqrt(max(claimed * (1 - claimed), 0.01) / n)
    assert abs(right / n - claimed) <= 3 * se, (right / n, claimed)


def test_the_multi_label_model_is_as_good_as_its_manifest_says(bundled: Server) -> None:
    """Every test text of the multi-label model, classified by the server: the labels it answers (each label's
    probability at or over the threshold its manifest gives) reach the manifest's micro-F1, and every label's
    probability is its own (they need not sum to one)."""
    test = preset_dataset("bbc-news-digests").test
    info = httpx.get(f"{bundled.url}/v1/models/bbc-news-digests").json()
    labels = info["labels"]
    tp = fp = fn = 0
    for k in range(0, len(test.texts), 32):
        r = httpx.post(f"{bundled.url}/v1/models/bbc-news-digests/classify", json={"inputs": test.texts[k : k + 32]},
                       timeout=120)
        assert r.status_code == 200, r.text[:300]
        for res, want in zip(r.json()["results"], (test.sets or [])[k : k + 32], strict=True):
            got, true = set(res["labels"]), {labels[j] for j in want}
            tp, fp, fn = tp + len(got & true), fp + len(got - true), fn + len(true - got)
    micro = 2 * tp / (2 * tp + fp + fn)
    assert abs(micro - info["evaluation"]["head"]["micro_f1"]) <= 0.01, (micro, info["evaluation"]["head"])


def test_models_in_one_request_answer_as_each_alone(bundled: Server) -> None:
    texts = ["I absolutely love this, best day ever!", SPORT[:600]]  # one fits a chunk of either; one does not
    both = httpx.post(f"{bundled.url}/v1/classify", json={"inputs": texts, "models": "all", "explain": True},
                      timeout=120).json()
    assert both["models"] == ["bbc-news-digests", "bbc-news-topics", "tweet-sentiment"]  # in loading order
    for model, got in zip(both["models"], both["responses"], strict=True):
        alone = httpx.post(f"{bundled.url}/v1/models/{model}/classify", json={"inputs": texts, "explain": True},
                           timeout=120).json()
        assert got["model"] == model
        for g, a in zip(got["results"], alone["results"], strict=True):
            assert g["label"] == a["label"]
            assert max(abs(g["scores"][k] - a["scores"][k]) for k in a["scores"]) <= 1e-5
            assert max(abs(x["credit"] - y["credit"]) for x, y in zip(g["explanation"]["tokens"],
                                                                      a["explanation"]["tokens"], strict=True)) <= 1e-5


def test_tweet_sentiment_classify_and_explain(bundled: Server) -> None:
    texts = ["I absolutely love this, best day ever! So happy :)", "This is awful, I hate it. Worst service ever."]
    res = httpx.post(f"{bundled.url}/v1/classify", json={"inputs": texts, "explain": True}, timeout=60).json()
    assert [r["label"] for r in res["results"]] == ["positive", "negative"]
    tokens = res["results"][0]["explanation"]["tokens"]
    assert res["results"][0]["explanation"]["target"] == "positive"
    assert [t["token"] for t in tokens][:3] == ["i", "absolutely", "love"]
    assert all(texts[0][t["start"]:t["end"]].lower() == t["token"].removeprefix("##") for t in tokens)
    exp = httpx.post(f"{bundled.url}/v1/explain", json={"inputs": texts[:1], "target": "all"}, timeout=60).json()
    r = exp["results"][0]
    assert r["targets"] == ["negative", "neutral", "positive"] and len(r["credit"]["positive"]["depth"][0]) == 7


def test_bbc_news_topics_long_article_is_chunked_and_explained(bundled: Server) -> None:
    url = f"{bundled.url}/v1/models/bbc-news-topics/explain"
    r = httpx.post(url, json={"inputs": [SPORT]}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    res = r.json()["results"][0]
    assert res["label"] == "sports"
    n_special = sum(t["special"] for t in res["tokens"])
    assert n_special >= 4  # several chunks, each with its own [CLS] and [SEP]
    assert len(res["credit"]["sports"]["sentences"]) == 20


@pytest.mark.parametrize(("model", "text"), [("tweet-sentiment", "I absolutely love this, best day ever! So happy :)"),
                                             ("bbc-news-topics", SPORT), ("bbc-news-digests", SPORT[:800])])
def test_end_to_end_credit_of_the_bundled_models_adds_up_to_their_logits(bundled: Server, model: str, text: str
                                                                        ) -> None:
    """Over the input tokens of every chunk (the article's several), for every label: credit plus baseline is the
    contrast logit (a multi-label model's: each label's own) within 1e-4, the same logit the value path explains; by
    depth, the depths sum to each token's."""
    url = f"{bundled.url}/v1/models/{model}/explain"
    body = {"inputs": [text], "target": "all"}
    e2e = httpx.post(url, json={**body, "method": "end_to_end"}, timeout=120).json()["results"][0]
    value_path = httpx.post(url, json=body, timeout=120).json()["results"][0]
    assert e2e["method"] == "end_to_end" and e2e["label"] == value_path["label"]
    for label, c in e2e["credit"].items():
        assert abs(sum(c["tokens"]) + c["baseline"] - c["logit"]) <= 1e-4
        assert abs(c["logit"] - value_path["credit"][label]["logit"]) <= 1e-5
        assert len(c["depth"]) == len(c["tokens"]) and len(c["depth"][0]) == 7
        assert max(abs(sum(row) - t) for row, t in zip(c["depth"], c["tokens"], strict=True)) <= 1e-5
        assert c["tokens"] != value_path["credit"][label]["tokens"]  # a split of its own, not the value path's


def readme_examples() -> list[tuple[str, dict, object]]:
    """Each example of the README that shows an answer: a bash block of one ``curl`` request to the server (its path
    and ``-d`` body), followed by a json block of the answer."""
    blocks = re.findall(r"```(\w+)\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    out = []
    for (kind, command), (then, answer) in itertools.pairwise(blocks):
        if kind == "bash" and then == "json" and command.startswith("curl "):
            args = shlex.split(command.replace("\\\n", " "))
            url = next(a for a in args if a.startswith("http://127.0.0.1:8000/"))
            out.append((url.removeprefix("http://127.0.0.1:8000"), json.loads(args[args.index("-d") + 1]),
                        json.loads(answer)))
    return out


def as_shown(got: object, shown: object, where: str = "") -> None:
    """``got`` is the answer ``shown``, up to 1e-5 in a number, and but for what is new each time (vLLM's ``id`` and
    ``created``)."""
    if isinstance(shown, dict):
        assert isinstance(got, dict) and got.keys() == shown.keys(), (where, got)
        new = {"id", "created"} if "created" in shown else set()  # vLLM's answer: its own each time
        for k in shown.keys() - new:
            as_shown(got[k], shown[k], f"{where}.{k}")
    elif isinstance(shown, list):
        assert isinstance(got, list) and len(got) == len(shown), (where, got)
        for k, (g, s) in enumerate(zip(got, shown, strict=True)):
            as_shown(g, s, f"{where}.{k}")
    elif isinstance(shown, float):
        assert isinstance(got, float) and abs(got - shown) <= 1e-5, (where, got, shown)
    else:
        assert got == shown, (where, got, shown)


def test_the_readme_examples_answer_as_it_shows(bundled: Server) -> None:
    examples = readme_examples()
    assert len(examples) >= 7  # /v1, OIP, KServe, TEI, vLLM, /tokenize, a multi-label model
    for path, body, shown in examples:
        r = httpx.post(f"{bundled.url}{path}", json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
        as_shown(r.json(), shown, path)
    # Hugging Face's client: the block that uses it, run, prints the labels and scores its comment shows
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
               if "InferenceClient(" in c]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace("http://127.0.0.1:8000", bundled.url), {})  # the README's own example
    pairs = re.compile(r"label='([^']*)', score=([0-9.e-]+)")
    shown = [(label, float(v)) for label, v in pairs.findall("".join(re.findall(r"^# ?(.*)$", code, re.M)))]
    got = [(label, float(v)) for label, v in pairs.findall(printed.getvalue())]
    assert len(shown) == 2 and [g[0] for g in got] == [s[0] for s in shown], (got, shown)
    assert all(abs(g[1] - s[1]) <= 1e-5 for g, s in zip(got, shown, strict=True)), (got, shown)

