"""One backbone, many heads: each head's answers in batches that mix heads equal that head served alone,
whatever the other texts ask; heads that cut a text alike share its encoder pass; the inference layer
serves several models in one call, without HTTP; a client that leaves is recorded as 499, not 500."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from service.config import Settings
from service.serving.api.app import create_app
from service.serving.core.errors import APIError
from service.serving.core.results import Result
from service.serving.core.work import Ask, ChunkWork, CreditSpec, Task, TextJob
from service.serving.engine.engine import Engine
from service.serving.state import AppState
from tests.conftest import write_tiny_model
from tests.serving.server import loaded, metric

HEADS = {"tiny": 16, "tiny-b": 24, "tiny-c": 16}  # name -> max_length (tiny-b cuts long texts otherwise)
TEXTS = ["a short text", "Long one, with many words in it. " * 6, "and a third, somewhat longer text than the first",
         "fourth!", "Another long text that goes on and on, sentence after sentence. " * 3]


@pytest.fixture(scope="module")
def heads_repo(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    repo = tmp_path_factory.mktemp("heads")
    for seed, (name, length) in enumerate(HEADS.items()):
        labels = ["alpha", "beta", "gamma", "delta"] if name == "tiny-b" else None
        write_tiny_model(repo, tiny_backbone_dir, name=name, max_length=length, seed=seed, labels=labels)
    return repo


@pytest.fixture(scope="module")
def shared(heads_repo: Path) -> Engine:
    return Engine.load([heads_repo / n for n in HEADS], device="cpu")


@pytest.fixture(scope="module")
def alone(heads_repo: Path) -> dict[str, Engine]:
    return {n: Engine.load(heads_repo / n, device="cpu") for n in HEADS}


def same(got: Result, want: Result) -> None:
    assert got.error is None and got.label == want.label
    assert max(abs(got.scores[k] - want.scores[k]) for k in want.scores) <= 1e-5
    if want.credit is not None:
        assert got.credit is not None
        for g, w in zip(got.credit.targets, want.credit.targets, strict=True):
            assert g.label == w.label
            torch.testing.assert_close(torch.tensor(g.tokens), torch.tensor(w.tokens), atol=1e-5, rtol=0)
            if w.depth is not None:
                torch.testing.assert_close(torch.tensor(g.depth), torch.tensor(w.depth), atol=1e-5, rtol=0)
            assert (g.logit is None) == (w.logit is None)
            if w.logit is not None:
                assert abs(g.logit - w.logit) <= 1e-5 and abs(g.baseline - w.baseline) <= 1e-5


SPECS = [None, CreditSpec(), CreditSpec(method="shares", detail="full"), CreditSpec(contrast=False, targets=(0, 2))]


def test_one_backbone_is_loaded_for_every_head(shared: Engine) -> None:
    backbones = {id(c.backbone) for c in shared.classifiers.values()}
    assert len(backbones) == 1 and shared.models == list(HEADS)
    assert shared.max_length("tiny-b") == 24 and shared.max_length("tiny") == 16


def test_heads_cut_a_text_alike_share_its_encoder_pass(shared: Engine) -> None:
    short, long = shared.encode([TEXTS[0], TEXTS[1]], list(HEADS))
    asks = [Ask(n) for n in HEADS]
    (job,) = shared.jobs(short, asks)  # one chunk at every length: one job, one encoder pass for all three
    assert [a.model for a in job.asks] == list(HEADS)
    jobs = shared.jobs(long, asks)  # 16- and 24-token chunks differ: one job per chunking
    assert [[a.model for a in j.asks] for j in jobs] == [["tiny", "tiny-c"], ["tiny-b"]]
    assert [len(j.encoding.chunks) for j in jobs] == [len(long[16].chunks), len(long[24].chunks)]


@pytest.mark.parametrize("gather", [False, True], ids=["by-head", "gathered"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_head_answers_as_alone_whatever_shares_its_batch(shared: Engine, alone: dict[str, Engine],
                                                              seed: int, gather: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Texts ask random subsets of the heads with random credit; the jobs' chunks are shuffled and cut into
    random batches (a long text spans several, next to other texts' chunks for other heads). Gathered: the
    texts of heads of one shape (tiny, tiny-c) run in one call on their stacked parameters."""
    monkeypatch.setattr(shared, "gather_heads", gather)
    rng = random.Random(seed)
    names = list(HEADS)
    jobs: list[tuple[int, TextJob]] = []  # each job with its text
    for t, by_length in enumerate(shared.encode(TEXTS, names)):
        asks = [Ask(n, rng.choice(SPECS)) for n in rng.sample(names, rng.randint(1, len(names)))]
        jobs += [(t, j) for j in shared.jobs(by_length, asks)]
    chunks = [w for _, j in jobs for w in j.chunks()]
    rank = {id(w): rng.random() for w in chunks}
    chunks.sort(key=lambda w: (w.k, rank[id(w)]))  # texts interleave; a text's chunks stay in order
    answers: dict[int, list[Result]] = {}
    k = 0
    while k < len(chunks):
        batch: list[ChunkWork] = chunks[k : k + rng.randint(1, 6)]
        for w, a in zip(batch, shared.run_chunks(batch), strict=True):
            if a is not None:
                answers[id(w.job)] = a
        k += len(batch)
    assert len(answers) == len(jobs)
    for t, job in jobs:
        for ask, got in zip(job.asks, answers[id(job)], strict=True):
            same(got, alone[ask.model or ""].run([Task(TEXTS[t], model=ask.model, credit=ask.credit)])[0])


def test_a_batch_of_heads_answers_each_text_in_one_engine_call(shared: Engine, alone: dict[str, Engine]) -> None:
    tasks = [Task(t, model=n, credit=CreditSpec()) for t in TEXTS for n in HEADS]
    for task, res in zip(tasks, shared.run(tasks), strict=True):
        same(res, alone[task.model or ""].run([task])[0])


# --- the inference layer, without HTTP ---

@pytest.fixture
async def state(heads_repo: Path) -> AsyncIterator[AppState]:
    async with loaded(Settings(model_repository=heads_repo, default_model="tiny", model_process=False,
                               max_wait_ms=2)) as st:
        yield st


async def test_the_pipeline_serves_several_models_as_each_alone(state: AppState) -> None:
    inf = state.inference
    assert list(state.registry.groups) == ["tiny-bert@random"] and list(inf.models) == list(HEADS)
    names = ["tiny-b", "tiny"]
    together = await inf.classify(names, TEXTS, explain=True)
    for m, per in zip(names, together, strict=True):
        (alone,) = await inf.classify([m], TEXTS, explain=True)
        for g, w in zip(per, alone, strict=True):
            assert g["label"] == w["label"] and max(abs(g["scores"][k] - w["scores"][k]) for k in w["scores"]) <= 1e-5
            g_tokens, w_tokens = g["explanation"]["tokens"], w["explanation"]["tokens"]
            assert [t["token"] for t in g_tokens] == [t["token"] for t in w_tokens]
            assert max(abs(a["credit"] - b["credit"]) for a, b in zip(g_tokens, w_tokens, strict=True)) <= 1e-5
    explained = await inf.explain(["tiny", "tiny-b"], TEXTS[:2], target="all")
    assert [r["targets"] for r in explained[1]] == [["alpha", "beta", "gamma", "delta"]] * 2


async def test_the_pipeline_says_what_is_wrong(state: AppState) -> None:
    inf = state.inference
    with pytest.raises(APIError) as e:
        inf.resolve(["tiny", "nope", "tiny-c"])
    assert e.value.status == 404 and "nope" in e.value.message
    with pytest.raises(APIError) as e:
        inf.resolve(["tiny", "tiny"])
    assert e.value.status == 422 and "tiny" in e.value.message
    assert inf.resolve("all") == list(HEADS)
    with pytest.raises(APIError) as e:
        await inf.explain(["tiny", "tiny-b"], TEXTS[:1], target="beta")
    assert e.value.status == 422  # labels only with one model
    with pytest.raises(APIError) as e:
        await inf.explain(["tiny-b"], TEXTS[:1], target=["delta", "omega"])
    assert e.value.status == 422 and "omega" in e.value.message
    with pytest.raises(APIError) as e:
        await inf.classify(["tiny"], ["x" * (state.settings.max_chars + 1)])
    assert e.value.status == 413


async def test_a_timeout_above_the_maximum_is_capped(heads_repo: Path) -> None:
    """A batch waits 3 s to fill; the request asks for 3,000 s, the server's maximum is 0.3 s: 504 at the cap."""
    async with loaded(Settings(model_repository=heads_repo, default_model="tiny", model_process=False,
                               max_wait_ms=3000, max_request_timeout_s=0.3)) as st:
        t0 = time.monotonic()
        with pytest.raises(APIError) as e:
            await st.inference.classify(["tiny"], ["ok"], timeout_s=3000)
        assert e.value.status == 504 and time.monotonic() - t0 < 2.0


async def test_a_client_that_leaves_is_dropped_and_answered_499(state: AppState) -> None:
    inf = state.inference
    left = asyncio.Event()

    async def gone() -> None:
        await left.wait()

    loop = asyncio.get_running_loop()
    loop.call_later(0.0, left.set)
    with pytest.raises(APIError) as e:
        await inf.classify(["tiny"], TEXTS * 8, gone=gone)
    assert e.value.status == 499
    for _ in range(200):  # what was queued is dropped; a batch already computing finishes
        if all(b.batcher.idle for b in state.registry.groups.values()):
            break
        await asyncio.sleep(0.01)
    assert all(b.batcher.idle for b in state.registry.groups.values())


# --- the HTTP layer's record of a client that left ---

async def test_a_request_whose_client_left_before_any_answer_is_recorded_as_499(heads_repo: Path) -> None:
    """The client disconnects while its body is read: no response is sent, and the request is counted as 499
    (nginx's "client closed request"), never as a 500 nobody received."""
    app = create_app(Settings(model_repository=heads_repo, default_model="tiny"))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/classify", "raw_path": b"/v1/classify", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    page = generate_latest(app.state.metrics.registry).decode()
    assert sent == []
    assert metric(page, "routing_requests_total", status="499") == 1
    assert metric(page, "routing_requests_total", status="500") == 0
    assert metric(page, "routing_failures_total", reason="disconnected") == 1
