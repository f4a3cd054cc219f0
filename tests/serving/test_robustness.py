"""Overload, deadlines, disconnects, API keys and shutdown, over HTTP against real servers."""

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.server import Server, in_flight, metric, running


@pytest.fixture(scope="module")
def slow(tiny_repo: Path, logs: Path):
    """Batches wait up to 1.5 s to fill: requests stay queued long enough to expire or be abandoned."""
    yield from running(logs, model_repository=tiny_repo, default_model="tiny", max_wait_ms=1500,
                       max_batch_size=64, max_queue=6)


def test_overload_gives_503_with_retry_after_then_recovers(slow: Server) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=slow.url, timeout=30) as client:
            return await asyncio.gather(*(client.post("/v1/classify", json={"inputs": ["a", "b"]})
                                          for _ in range(12)))

    rs = asyncio.run(burst())
    codes = sorted(r.status_code for r in rs)
    assert set(codes) == {200, 503} and codes.count(200) == 3, codes  # 3 requests x 2 texts fill max_queue=6
    for r in rs:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "service_unavailable"
    again = httpx.post(f"{slow.url}/v1/classify", json={"inputs": ["after the burst"]}, timeout=30)
    assert again.status_code == 200
    page = httpx.get(f"{slow.url}/metrics").text
    assert metric(page, "routing_failures_total", reason="overloaded") >= 9


def test_deadline_gives_504(slow: Server) -> None:
    t0 = time.monotonic()
    r = httpx.post(f"{slow.url}/v1/classify", json={"inputs": ["late"], "timeout_s": 0.2}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - t0 < 1.4
    time.sleep(1.6)  # the batcher wakes up and finds the expired text
    page = httpx.get(f"{slow.url}/metrics").text
    assert metric(page, "routing_dropped_texts_total", model="tiny", reason="deadline") >= 1
    assert metric(page, "routing_failures_total", reason="deadline") >= 1


def test_client_disconnect_drops_queued_texts(slow: Server) -> None:
    before = metric(httpx.get(f"{slow.url}/metrics").text, "routing_dropped_texts_total", reason="disconnected")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow.url}/v1/classify", json={"inputs": ["bye", "bye too"]}, timeout=0.3)
    time.sleep(1.8)
    page = httpx.get(f"{slow.url}/metrics").text
    assert metric(page, "routing_dropped_texts_total", reason="disconnected") == before + 2
    assert metric(page, "routing_failures_total", reason="disconnected") >= 1
    assert httpx.post(f"{slow.url}/v1/classify", json={"inputs": ["still fine"]}, timeout=30).status_code == 200


def test_api_keys(keyed: Server) -> None:
    url = f"{keyed.url}/v1/classify"
    body = {"inputs": ["hi"]}
    before = metric(httpx.get(f"{keyed.url}/metrics").text, "routing_failures_total", reason="auth")
    r = httpx.post(url, json=body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "unauthorized"
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Basic k1"}).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer k1"}).status_code == 200
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer second-key"}).status_code == 200
    assert httpx.get(f"{keyed.url}/v1/models").status_code == 401
    assert httpx.get(f"{keyed.url}/healthz").status_code == 200
    assert httpx.get(f"{keyed.url}/readyz").status_code == 200
    assert httpx.get(f"{keyed.url}/metrics").status_code == 200
    for probe in ("/health", "/ping"):  # TEI's, vLLM's and SageMaker's probes need no key, as /healthz
        assert httpx.get(f"{keyed.url}{probe}").status_code == 200
    for path, sent in (("/tokenize", {"inputs": "hi"}), ("/decode", {"ids": [101]}), ("/detokenize", {"tokens": [1]}),
                       ("/invocations", {"inputs": "hi"})):  # the tokenizer and SageMaker's route do
        assert httpx.post(f"{keyed.url}{path}", json=sent).status_code == 401, path
        assert httpx.post(f"{keyed.url}{path}", json=sent, headers={"Authorization": "Bearer k1"}).status_code == 200
    page = httpx.get(f"{keyed.url}/metrics").text
    assert metric(page, "routing_failures_total", reason="auth") == before + 8


def test_protected_metrics(tiny_repo: Path, logs: Path) -> None:
    for server in running(logs, model_repository=tiny_repo, default_model="tiny", api_keys="k1",
                          protect_metrics="true"):
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        assert httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer k1"}).status_code == 200


def test_sigterm_during_load_answers_every_accepted_request(tiny_repo: Path, logs: Path) -> None:
    # one chunk per batch and long texts: answering everything takes seconds, so the drain is observable,
    # yet well within the requests' 30 s deadline on a slow machine (about 1,700 batches)
    server = Server(logs, model_repository=tiny_repo, default_model="tiny", max_wait_ms=300, max_batch_size=1,
                    drain_timeout_s=60).wait_ready()
    results: list[int | str] = []

    def record(r: httpx.Response | httpx.TransportError) -> None:
        results.append(r.status_code if isinstance(r, httpx.Response) else type(r).__name__)

    bodies = [{"inputs": [f"text number {k}, long enough to need many chunks. " * 30] * 3} for k in range(24)]
    thread = in_flight(server, bodies, record, wait_s=30)
    server.terminate()
    time.sleep(0.1)
    ready = httpx.get(f"{server.url}/readyz", timeout=5)
    health = httpx.get(f"{server.url}/health", timeout=5)  # TEI's and vLLM's probe: a load balancer turns away too
    ping = httpx.get(f"{server.url}/ping", timeout=5)  # and SageMaker's
    late = httpx.post(f"{server.url}/v1/classify", json={"inputs": ["too late"]}, timeout=5)
    thread.join(60)
    code = server.proc.wait(40)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert health.status_code == 503 and health.json()["error_type"] == "Unhealthy" and "retry-after" in health.headers
    assert ping.status_code == 503
    assert late.status_code == 503 and "retry-after" in late.headers
    assert results.count(200) == 24, results  # every accepted request was answered
    assert code == 0, server.log()
    server.stop()


def test_unloadable_repository_exits_with_a_clear_message(tmp_path: Path, logs: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text("{not json")
    server = Server(logs, model_repository=tmp_path, default_model="broken")
    assert server.proc.wait(60) == 1
    log = server.log()
    assert "model loading failed" in log and "broken/manifest.json: not valid JSON" in log
    server.stop()


async def test_a_default_model_named_but_not_served_fails_the_start_and_one_not_named_is_the_first_served(
        tiny_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.config import Settings
    from service.serving.observe.metrics import Metrics
    from service.serving.state import AppState

    state = AppState(settings=Settings(model_repository=tiny_repo, default_model="tweet-sentiment"), metrics=Metrics())
    await state.load()
    assert not state.lifecycle.ready
    error = state.lifecycle.error or ""
    assert "default model 'tweet-sentiment'" in error and "['tiny']" in error and "ROUTING_DEFAULT_MODEL" in error
    await state.close(1.0)
    # not named, its default (tweet-sentiment) not served: the first model served is the default, cache or not
    monkeypatch.delenv("ROUTING_DEFAULT_MODEL", raising=False)
    for budget in (None, 10**9):
        state = AppState(settings=Settings(model_repository=tiny_repo, model_process=False, head_cache_bytes=budget),
                         metrics=Metrics())
        await state.load()
        assert state.lifecycle.ready, state.lifecycle.error
        assert state.default_model == "tiny" and state.inference.resolve("all") == ["tiny"]
        await state.close(1.0)


async def test_an_empty_repository_starts_a_server_only_where_models_can_come_later_and_the_first_is_the_default(
        tmp_path: Path, tiny_backbone_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.config import Settings
    from service.serving.core.errors import APIError
    from service.serving.observe.metrics import Metrics
    from service.serving.state import AppState
    from tests.conftest import write_tiny_model

    monkeypatch.delenv("ROUTING_DEFAULT_MODEL", raising=False)
    repo = tmp_path / "models"
    repo.mkdir()
    state = AppState(settings=Settings(model_repository=repo, model_process=False), metrics=Metrics())
    await state.load()  # nothing could ever serve: the start fails, saying how to start empty
    assert not state.lifecycle.ready and "ROUTING_MODEL_CONTROL=poll" in (state.lifecycle.error or "")
    await state.close(1.0)
    for control, budget in (("poll", None), ("none", 10**9)):
        write = repo / control
        write.mkdir()
        state = AppState(settings=Settings(model_repository=write, model_process=False, model_control=control,
                                           head_cache_bytes=budget), metrics=Metrics())
        await state.load()
        assert state.lifecycle.ready, state.lifecycle.error
        assert state.inference.resolve("all") == [] and state.default_model is None
        with pytest.raises(APIError) as e:
            state.default()
        assert e.value.status == 404 and "no default model" in str(e.value)
        for name, seed in (("tiny-b", 1), ("tiny", 0)):
            write_tiny_model(write, tiny_backbone_dir, name=name, seed=seed)
            if budget is None:
                await state.control.sync()  # the poll's pass
            else:
                await state.inference.require([name])  # the head cache loads what a request names
            assert name in state.inference.resolve("all")
            assert state.default() == "tiny-b"  # the first to serve, and it stays so
        await state.close(1.0)
    named = AppState(settings=Settings(model_repository=repo / "none", default_model="tiny-b", model_process=False,
                                       head_cache_bytes=10**9), metrics=Metrics())
    assert named.default_model == "tiny-b" and named.cache is not None and named.cache.pinned == {"tiny-b"}
    (repo / "later").mkdir()  # empty, its default named: it starts, the default to come
    state = AppState(settings=Settings(model_repository=repo / "later", default_model="tiny", model_process=False,
                                       model_control="poll"), metrics=Metrics())
    await state.load()
    assert state.lifecycle.ready and state.default() == "tiny"
    await state.close(1.0)


async def test_a_model_named_twice_loads_once(tiny_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.config import Settings
    from tests.serving.server import loaded

    monkeypatch.setenv("ROUTING_MODELS", "tiny, tiny")  # failed the start before: "zip() argument 2 is longer ..."
    settings = Settings(model_repository=tiny_repo, default_model="tiny", model_process=False)
    assert settings.models == ["tiny"]
    async with loaded(settings) as state:
        assert list(state.inference.models) == ["tiny"]


def test_overload_on_teis_route_is_429_in_teis_shape(slow: Server) -> None:
    """TEI's clients retry on 429 (their overloaded), with the same Retry-After as our 503, counted as overloaded.
    How many of a burst fit depends on whether a batch leaves the queue while the burst still arrives (these requests
    go through the framework's routing, slower than /v1/classify's direct route: a CI run saw 6 of 12 answered where
    the /v1 burst above always gets 3); at least the queue's 3 requests are, and the rest are refused."""
    before = metric(httpx.get(f"{slow.url}/metrics").text, "routing_failures_total", reason="overloaded")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=slow.url, timeout=30) as client:
            return await asyncio.gather(*(client.post("/predict", json={"inputs": [["a"], ["b"]]}) for _ in range(24)))

    rs = asyncio.run(burst())
    codes = sorted(r.status_code for r in rs)
    assert set(codes) == {200, 429} and codes.count(200) >= 3, codes  # 3 requests x 2 texts fill max_queue=6
    for r in rs:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error_type"] == "Overloaded"
            assert r.json()["error"].startswith("overloaded")
        else:
            assert [len(answer) for answer in r.json()] == [3, 3]  # both texts' every label
    after = metric(httpx.get(f"{slow.url}/metrics").text, "routing_failures_total", reason="overloaded")
    assert after - before == codes.count(429)  # what the clients got
