"""The bundled models, served as the README's main command serves them (real backbone, CPU)."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import running
from tests.serving.server import Server

ROOT = Path(__file__).resolve().parents[2]
SPORT = ("Arsenal beat Chelsea 2-1 in a thrilling Premiership match at Highbury on Saturday, with the striker "
         "scoring twice in the second half to lift the champions back to the top of the league table. ") * 20


@pytest.fixture(scope="module")
def bundled(logs: Path) -> Iterator[Server]:
    yield from running(logs, model_repository=ROOT / "models")


def test_default_is_tweet_sentiment_and_both_models_are_listed(bundled: Server) -> None:
    body = httpx.get(f"{bundled.url}/v1/models").json()
    assert body["default"] == "tweet-sentiment"
    names = {m["name"]: m for m in body["models"]}
    assert set(names) == {"tweet-sentiment", "bbc-news-topics"}
    for m in names.values():
        assert m["backbone"]["name"] == "sentence-transformers/all-MiniLM-L6-v2"
        ev = m["evaluation"]
        assert {"accuracy", "macro_f1", "confusion_matrix"} <= set(ev["head"])
        assert "accuracy" in ev["baseline"]["test"]
    tweets = names["tweet-sentiment"]["evaluation"]
    assert tweets["head"]["accuracy"] > tweets["baseline"]["test"]["accuracy"]
    assert names["bbc-news-topics"]["evaluation"]["head"]["accuracy"] >= 0.97


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
