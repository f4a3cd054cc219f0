"""Chunk-level scheduling: a long text's chunks run over several batches, interleaved with other
texts' work, the head runs once all of them are encoded, and the answer is the same as computing the
text alone. The per-text token cap answers 413."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from service.serving.core.results import Result
from service.serving.core.work import ChunkWork, CreditSpec, Task
from service.serving.engine.engine import Engine
from tests.serving.test_tokenize_once import started

LONG = " ".join(f"word{k} is here, and then." for k in range(60))  # many chunks of the tiny model's 16 tokens
SHORT = ["a short text", "another one!"]


@pytest.fixture(scope="module")
def engine(tiny_repo: Path) -> Engine:
    return Engine.load(tiny_repo / "tiny")


def same(a: Result, b: Result) -> None:
    assert a.label == b.label
    for k in a.scores:
        assert abs(a.scores[k] - b.scores[k]) <= 1e-5
    ca = torch.tensor(a.credit.targets[0].tokens)
    cb = torch.tensor(b.credit.targets[0].tokens)
    torch.testing.assert_close(ca, cb, atol=1e-5, rtol=0)


def test_a_long_text_split_over_batches_among_other_work_gets_the_same_answer(engine: Engine) -> None:
    task = Task(LONG, credit=CreditSpec())
    alone = engine.run([task])[0]
    (plan,) = engine.plan([task])
    assert len(plan) > 6
    others = [w for p in engine.plan([Task(t, credit=CreditSpec()) for t in SHORT]) for w in p]
    batches: list[list[ChunkWork]] = [plan[:3] + others[:1], plan[3:5], others[1:] + plan[5:]]
    answers = [engine.run_chunks(b) for b in batches]
    # only the batch holding a text's last chunk answers it, at that chunk's place
    assert all(a is None for a in answers[0][:3] + answers[1])
    assert answers[0][3] is not None and answers[2][0] is not None
    assert all(a is None for a in answers[2][1:-1])
    same(answers[2][-1][0], alone)
    same(answers[0][3][0], engine.run([Task(SHORT[0], credit=CreditSpec())])[0])
    assert plan[0].job.states == []  # the hidden states are let go once the text is answered


def test_two_batches_in_flight_answer_as_one_at_a_time(engine: Engine) -> None:
    """``run_pipelined`` launches batch k + 1 before reading batch k's results: the same answers, in order, as
    running each batch alone; a long text's chunks out of order within its batch, too."""
    texts = [LONG, *SHORT, "one more", LONG[:80], "and the last"]
    batches = [[Task(t, credit=CreditSpec() if k % 2 else None) for t in texts[k : k + 2]]
               for k in range(0, len(texts), 2)]
    piped = list(engine.run_pipelined(iter(batches)))
    assert len(piped) == len(batches)
    for batch, got in zip(batches, piped, strict=True):
        for a, b in zip(got, engine.run(batch), strict=True):
            assert a.label == b.label and (a.credit is None) == (b.credit is None)
            assert all(abs(a.scores[k] - b.scores[k]) <= 1e-5 for k in a.scores)
    assert list(engine.run_pipelined([])) == []
    (plan,) = engine.plan([Task(LONG)])
    reordered = [plan[-1], *plan[1:-1][::-1], plan[0]]  # the last chunk first: the text completes at the end
    answers = engine.run_chunks(reordered)
    assert all(a is None for a in answers[:-1])
    assert abs(answers[-1][0].scores["alpha"] - engine.run([Task(LONG)])[0].scores["alpha"]) <= 1e-5


def test_a_short_request_goes_ahead_of_a_long_texts_remaining_chunks(tiny_repo: Path) -> None:
    """With the first batch of a long text's chunks computing, a short request arriving then is in the
    next batch and is answered before the long text; the long text's answer is unchanged."""
    for c, _ in started(tiny_repo, max_batch_tokens=64, max_wait_ms=0):
        short_behind_long(c)


def short_behind_long(c: TestClient) -> None:
    batcher = c.app.state.app_state.inference.models["tiny"].batcher
    expected = c.post("/v1/classify", json={"inputs": [LONG]}).json()["results"][0]
    gate, first = threading.Event(), threading.Event()
    batches: list[list[bool]] = []  # per batch, per chunk: whether it is the long text's
    run_chunks = batcher.runners[0]
    assert inspect.iscoroutinefunction(run_chunks)  # the backbone's process, awaited on the server's loop

    async def gated(works: list[ChunkWork]) -> list[Result | None]:
        batches.append([len(w.job.encoding.chunks) > 1 for w in works])
        if len(batches) == 1:
            first.set()
            await asyncio.to_thread(gate.wait, 10)  # "computing" while the loop takes requests
        return await run_chunks(works)

    batcher.runners[0] = gated
    done: dict[str, float] = {}

    def post(text: str) -> dict:
        r = c.post("/v1/classify", json={"inputs": [text]})
        done[text] = time.monotonic()
        assert r.status_code == 200, r.text
        return r.json()["results"][0]

    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(post, LONG)
        assert first.wait(10)
        short = pool.submit(post, SHORT[0])
        time.sleep(0.3)  # the short request is queued behind the computing batch
        gate.set()
        assert short.result(10)["label"]
        got = long.result(10)
    assert batches[1][0] is False  # the next batch is built around the short text
    assert sum(sum(b) for b in batches) > 6 and len(batches) > 3
    assert done[SHORT[0]] < done[LONG]
    assert got["label"] == expected["label"]
    for k, p in expected["scores"].items():
        assert abs(got["scores"][k] - p) <= 1e-5


def test_the_token_cap_answers_413_and_is_off_by_default(tiny_repo: Path) -> None:
    for c, _ in started(tiny_repo, max_text_tokens=40):
        r = c.post("/v1/classify", json={"inputs": ["fine", LONG]})
        assert r.status_code == 413 and "inputs.1 has" in r.json()["error"]["message"]
        assert "limit of 40" in r.json()["error"]["message"]
        assert c.post("/v1/explain", json={"inputs": [LONG]}).status_code == 413
        assert c.post("/v1/classify", json={"inputs": ["fine"]}).status_code == 200
    for c, _ in started(tiny_repo):
        assert c.post("/v1/classify", json={"inputs": [LONG]}).status_code == 200
