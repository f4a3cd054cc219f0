"""A batch the device has no memory for is split and retried; a chunk that does not fit even alone fails its text
only, answered 503 (retry), never a 500 or a lost answer. The device's failure is simulated on the CPU by making
the encoder raise torch's out-of-memory error for batches over a size, or for chunks holding a marked token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.serving.core.work import CreditSpec, Task
from service.serving.engine.engine import Engine
from tests.serving.test_chunks import LONG
from tests.serving.test_tokenize_once import started

POISON = "zebra"  # a word whose token marks the chunks that fail even alone


@pytest.fixture(scope="module")
def engine(tiny_repo: Path) -> Engine:
    return Engine.load(tiny_repo / "tiny")


def failing(engine: Engine, when: Callable[[np.ndarray, np.ndarray], bool]) -> list[int]:
    """Make ``engine``'s encoder raise out of memory whenever ``when(ids, lengths)``; the sizes it was called with."""
    run_stream = type(engine.backbone).run_stream
    calls: list[int] = []

    def flaky(ids: np.ndarray, lengths: np.ndarray, *where: Any) -> torch.Tensor:
        calls.append(len(lengths))
        if when(ids, lengths):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return run_stream(engine.backbone, ids, lengths, *where)

    engine.backbone.run_stream = flaky  # type: ignore[method-assign]
    return calls


def poison_id(engine: Engine) -> int:
    (token,) = engine.backbone.tokenizer(POISON, add_special_tokens=False)["input_ids"]
    return token


def test_a_batch_too_large_for_the_device_is_split_until_it_fits(engine: Engine) -> None:
    texts = ["one", "two texts", "and a third one", "four", "five is the last"]
    tasks = [Task(t, credit=CreditSpec()) for t in texts]
    expected = engine.run(tasks)
    calls = failing(engine, lambda ids, lengths: len(lengths) > 2)
    try:
        got = engine.run(tasks)
    finally:
        del engine.backbone.run_stream
    assert calls == [5, 2, 3, 1, 2]  # 5 failed; its first half (2) fit; the second (3) failed: 1, then 2
    for a, b in zip(got, expected, strict=True):
        assert a.error is None and a.label == b.label
        assert all(abs(a.scores[k] - b.scores[k]) <= 1e-5 for k in a.scores)
        assert a.credit.targets[0].tokens == pytest.approx(b.credit.targets[0].tokens, abs=1e-5)


def test_a_chunk_that_fails_alone_fails_its_text_only(engine: Engine) -> None:
    bad = poison_id(engine)
    texts = ["a fine text", f"this {POISON} text", "another fine one", LONG.replace("word3 ", f"{POISON} ", 1)]
    expected = engine.run([Task(t) for t in texts])
    failing(engine, lambda ids, lengths: bad in ids)
    try:
        got = engine.run([Task(t) for t in texts])
    finally:
        del engine.backbone.run_stream
    for k in (0, 2):  # the others' answers are untouched
        assert got[k].error is None and got[k].scores == pytest.approx(expected[k].scores, abs=1e-5)
    for k in (1, 3):  # one chunk of the long text failed: the whole text is answered with why, at its end
        assert got[k].unavailable and "out of memory" in got[k].error and got[k].scores == {}


def test_the_server_answers_503_for_the_text_the_device_cannot_take(tiny_repo: Path) -> None:
    for c, _ in started(tiny_repo, model_process=False, max_wait_ms=0):
        engine = c.app.state.app_state.inference.models["tiny"].engine
        bad = poison_id(engine)
        failing(engine, lambda ids, lengths, bad=bad: bad in ids)
        ok = c.post("/v1/classify", json={"inputs": ["a fine text", "and another"]})
        assert ok.status_code == 200 and len(ok.json()["results"]) == 2
        r = c.post("/v1/classify", json={"inputs": [f"a {POISON} here"]})
        assert r.status_code == 503 and "out of memory" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) >= 1
        assert c.post("/v1/classify", json={"inputs": ["fine again"]}).status_code == 200
