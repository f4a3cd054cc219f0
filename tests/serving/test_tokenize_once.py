"""Each text is tokenized once per request, before the queue, and a request the queue has no room for
is answered 503 before any tokenization. In-process (the app on a test client) so that the
tokenizer's calls can be counted; the model's own process gets token ids only."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.config import Settings
from service.modeling.backbone import ChunkTokenizer
from service.serving.api.app import create_app
from service.serving.pipeline.inference import INLINE_CHARS

TEXTS = ["the first text", "a second, somewhat longer text. It has two sentences!", "Long one. " * 40]
V2 = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": TEXTS}], "parameters": {"explain": True}}


class CountingTokenizer:
    """Delegates to the real tokenizer and counts its calls (tokenizations of a batch of texts): ``calls`` in all,
    ``spans`` of them with the tokens' character offsets (``encode_batch``; ``encode_batch_fast`` keeps none)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls, self.spans, self.threads = inner, 0, 0, []

    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.spans += 1
        return self._counted(self.inner.encode_batch, *args, **kwargs)

    def encode_batch_fast(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(self.inner.encode_batch_fast, *args, **kwargs)

    def _counted(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call`` counted, with the thread it ran on."""
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        return call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def started(tiny_repo: Path, **settings: Any) -> Iterator[tuple[TestClient, CountingTokenizer]]:
    app: FastAPI = create_app(Settings(model_repository=tiny_repo, default_model="tiny", **settings))
    with TestClient(app) as client:
        for _ in range(600):
            if client.get("/readyz").status_code == 200:
                break
            time.sleep(0.05)
        chunker: ChunkTokenizer = app.state.app_state.inference.models["tiny"].engine.chunker  # the server's tokenizer
        counting = CountingTokenizer(chunker.tokenizer)
        chunker.tokenizer = counting
        yield client, counting


@pytest.fixture(scope="module")
def client(tiny_repo: Path) -> Iterator[tuple[TestClient, CountingTokenizer]]:
    yield from started(tiny_repo)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/classify", {"inputs": TEXTS}),
    ("/v1/classify", {"inputs": TEXTS, "explain": True}),
    ("/v1/explain", {"inputs": TEXTS, "target": "all", "include_matrix": True}),
    ("/v2/models/tiny/infer", V2),
    ("/v1/models/tiny:explain", {"instances": TEXTS}),
])
def test_one_tokenization_per_request(client: tuple[TestClient, CountingTokenizer], path: str, body: dict) -> None:
    c, counting = client
    before, spans = counting.calls, counting.spans
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    assert counting.calls - before == 1  # all texts of the request in one call, and never again
    credit = path != "/v1/classify" or body.get("explain", False)
    assert counting.spans - spans == int(credit)  # character offsets tracked only where credit is rendered


def test_a_full_queue_answers_503_without_tokenizing(tiny_repo: Path) -> None:
    # batches wait up to 2 s to fill, so the first request's texts sit in the queue (room for 4)
    for c, counting in started(tiny_repo, max_queue=4, max_wait_ms=2000):
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(c.post, "/v1/classify", json={"inputs": TEXTS})
            deadline = time.monotonic() + 10
            while counting.calls == 0 and time.monotonic() < deadline:  # the first request is tokenized
                time.sleep(0.01)
            time.sleep(0.2)  # and queued
            before = counting.calls
            r = c.post("/v1/classify", json={"inputs": ["one too many", "and another"]})  # 3 + 2 > 4
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert counting.calls == before  # refused before any tokenization
            assert first.result(timeout=30).status_code == 200


def test_short_texts_are_tokenized_on_the_event_loop_and_long_ones_in_a_thread(
        client: tuple[TestClient, CountingTokenizer]) -> None:
    c, counting = client
    short = ["a tweet of about a hundred characters, as most requests carry: short enough to tokenize at once."] * 16
    long = ["x" * (INLINE_CHARS // 2 + 1)] * 2
    assert sum(map(len, short)) <= INLINE_CHARS < sum(map(len, long))
    for texts, in_thread in ((short, False), (long, True)):
        r = c.post("/v1/classify", json={"inputs": texts})
        assert r.status_code == 200, r.text
        assert counting.threads[-1].startswith("asyncio_") == in_thread  # the loop's default executor's threads
