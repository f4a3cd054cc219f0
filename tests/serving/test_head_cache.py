"""The head cache (``head_cache_bytes``): start-up loads only the pinned models, any model folder of the
repository serves on demand, heads beyond the budget leave memory least recently used first (never a pinned one
or one a request holds), and every answer equals its head served alone."""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from service.config import Settings
from service.modeling.manifest import WEIGHTS
from service.serving.api.app import create_app
from service.serving.core.errors import APIError
from service.serving.core.work import CreditSpec, Task
from service.serving.engine.engine import Engine
from service.serving.state import AppState
from tests.conftest import write_tiny_model
from tests.serving.server import loaded, metric

NAMES = [f"head-{k:02d}" for k in range(10)]
TEXTS = ["a short text", "and a somewhat longer one, with a comma", "third"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    repo = tmp_path_factory.mktemp("cache")
    for seed, name in enumerate(NAMES):
        write_tiny_model(repo, tiny_backbone_dir, name=name, seed=seed)
    return repo


@pytest.fixture(scope="module")
def head_bytes(repo: Path) -> int:
    return (repo / NAMES[0] / WEIGHTS).stat().st_size


@pytest.fixture(scope="module")
def alone(repo: Path) -> dict[str, list[tuple[str, list[float]]]]:
    """Each head's label and scores for TEXTS, served alone."""
    out = {}
    for name in NAMES:
        results = Engine.load(repo / name, device="cpu").run([Task(t, model=name) for t in TEXTS])
        out[name] = [(r.label, list(r.scores.values())) for r in results]
    return out


@pytest.fixture
async def state(repo: Path, head_bytes: int) -> AsyncIterator[AppState]:
    """A budget of three heads; head-00 pinned (and the default)."""
    async with loaded(Settings(model_repository=repo, default_model=NAMES[0], model_process=False, max_wait_ms=1,
                               head_cache_bytes=3 * head_bytes)) as st:
        yield st


def page(st: AppState) -> str:
    return generate_latest(st.metrics.registry).decode()


async def settle(st: AppState) -> None:
    """Let a background eviction finish."""
    assert st.cache is not None
    await st.cache.stop()


async def test_start_up_loads_only_the_pinned_heads(state: AppState) -> None:
    assert list(state.inference.models) == [NAMES[0]]
    assert metric(page(state), "routing_head_cache_resident_heads") == 1


@pytest.mark.parametrize(("heads", "said"), [(3.5, "room for about 2 heads "), (2.5, "room for about 1 head "),
                                             (1.5, "leaves no room beside")])
async def test_start_up_says_what_room_the_budget_leaves(repo: Path, head_bytes: int, heads: float, said: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="service.cache"):
        async with loaded(Settings(model_repository=repo, default_model=NAMES[0], model_process=False,
                                   head_cache_bytes=int(heads * head_bytes))):
            pass
    assert said in caplog.text, caplog.text


async def test_every_answer_is_its_heads_alone_and_the_budget_holds(state: AppState, head_bytes: int,
                                                                     alone: dict[str, list]) -> None:
    rng = random.Random(0)
    inf = state.inference
    asked = [rng.choice(NAMES) for _ in range(30)]
    for name in asked:
        await inf.require([name])
        (got,) = await inf.classify([name], TEXTS)
        for r, (label, scores) in zip(got, alone[name], strict=True):
            assert r["label"] == label and max(abs(a - b) for a, b in zip(r["scores"].values(), scores,
                                                                          strict=True)) <= 1e-5
        await settle(state)
        assert len(inf.models) <= 3 and NAMES[0] in inf.models  # the budget, the pinned head
    text = page(state)
    hits, misses = metric(text, "routing_head_cache_hits_total"), metric(text, "routing_head_cache_misses_total")
    assert hits + misses == len(asked) and misses >= len(set(asked) - {NAMES[0]})
    assert metric(text, "routing_head_cache_evictions_total") == misses - (len(inf.models) - 1) > 0
    assert metric(text, "routing_head_cache_resident_bytes") == len(inf.models) * head_bytes
    assert metric(text, "routing_head_cache_load_seconds_count") == misses


async def test_heads_held_by_requests_in_flight_are_not_evicted(state: AppState, alone: dict[str, list]) -> None:
    """Forty requests at once over ten heads with room for three: each is answered by its own head (an
    evicted head would answer 'model was unloaded', a withdrawn name 404)."""
    inf = state.inference
    rng = random.Random(1)
    asked = [rng.choice(NAMES) for _ in range(40)]

    async def one(name: str) -> None:
        await inf.require([name])
        (got,) = await inf.classify([name], TEXTS[:1], explain=bool(rng.getrandbits(1)))
        assert got[0]["label"] == alone[name][0][0]

    await asyncio.gather(*(one(n) for n in asked))
    await settle(state)
    assert len(inf.models) <= 3


async def test_several_heads_in_one_request_with_credit(state: AppState, alone: dict[str, list]) -> None:
    inf = state.inference
    names = NAMES[3:6]
    await inf.require(names)
    scored = await inf.run(names, TEXTS, [CreditSpec()] * 3, inf.deadline(None))
    for name, per in zip(names, scored, strict=True):
        assert [s.result.label for s in per] == [label for label, _ in alone[name]]
        assert all(s.result.credit is not None for s in per)


async def test_names_outside_the_repository_are_refused(state: AppState) -> None:
    for name, status in (("nope", 404), ("../models", 400), ("a/b", 400), ("a" * 300, 400)):
        with pytest.raises(APIError) as e:
            await state.inference.require([name])
        assert e.value.status == status


def test_over_http_a_model_not_in_memory_answers_on_every_protocol(repo: Path, head_bytes: int,
                                                                   alone: dict[str, list]) -> None:
    settings = Settings(model_repository=repo, default_model=NAMES[0], head_cache_bytes=2 * head_bytes,
                        model_process=False, admin_keys=["adm"])
    with TestClient(create_app(settings)) as client:
        for _ in range(600):  # the pinned model loads in the background
            if client.get("/readyz").status_code == 200:
                break
            time.sleep(0.05)
        assert client.get("/readyz").status_code == 200
        r = client.post(f"/v1/models/{NAMES[7]}/classify", json={"inputs": TEXTS[:1]})
        assert r.status_code == 200 and r.json()["results"][0]["label"] == alone[NAMES[7]][0][0]
        r = client.post(f"/v2/models/{NAMES[8]}/infer", json={"inputs": [
            {"name": "text", "shape": [1], "datatype": "BYTES", "data": TEXTS[:1]}]})
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [alone[NAMES[8]][0][0]]
        r = client.post(f"/v1/models/{NAMES[9]}:predict", json={"instances": TEXTS[:1]})
        assert r.status_code == 200 and r.json()["predictions"][0]["label"] == alone[NAMES[9]][0][0]
        r = client.post("/v1/explain", json={"inputs": TEXTS[:1], "models": [NAMES[1], NAMES[2]]})
        assert r.status_code == 200 and [m["labels"] for m in r.json()["responses"]] == [["alpha", "beta", "gamma"]] * 2
        r = client.post("/tokenize", json={"model": NAMES[4], "prompt": TEXTS[0]})  # its head's tokenizer, brought in
        assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 2
        r = client.post("/v1/models/nope/classify", json={"inputs": ["x"]})
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
        in_memory = [m["name"] for m in client.get("/v1/models").json()["models"]]  # what is in memory
        assert NAMES[0] in in_memory and len(in_memory) <= 3 and NAMES[3] not in in_memory
        assert client.get(f"/v1/models/{NAMES[3]}").json()["name"] == NAMES[3]  # any folder is described
        index = {e["name"]: (e["state"], e["reason"]) for e in client.post(
            "/v2/repository/index", headers={"Authorization": "Bearer adm"}).json()}
        assert sorted(index) == NAMES and index[NAMES[0]] == ("READY", "")
        assert index[NAMES[5]] == ("UNAVAILABLE", "not in memory: loads on its first request")
        assert index[NAMES[7]] == ("UNAVAILABLE", "evicted from the head cache: loads on the next request")


async def test_a_damaged_head_loaded_together_with_others_fails_alone(repo: Path, head_bytes: int, tmp_path: Path,
                                                                      alone: dict[str, list]) -> None:
    """Three heads wanted at once load in one change; one has truncated weights: its request gets 400 naming
    the file, the other two answer."""
    damaged = tmp_path / "models"
    shutil.copytree(repo, damaged)
    weights = damaged / NAMES[5] / WEIGHTS
    weights.write_bytes(weights.read_bytes()[: head_bytes // 2])
    async with loaded(Settings(model_repository=damaged, default_model=NAMES[0], model_process=False, max_wait_ms=1,
                               head_cache_bytes=5 * head_bytes)) as st:
        inf = st.inference

        async def ask(name: str) -> str | APIError:
            try:
                await inf.require([name])
                return (await inf.classify([name], TEXTS[:1]))[0][0]["label"]
            except APIError as e:
                return e

        got = await asyncio.gather(*(ask(n) for n in (NAMES[3], NAMES[5], NAMES[7])))
        assert got[0] == alone[NAMES[3]][0][0] and got[2] == alone[NAMES[7]][0][0]
        assert isinstance(got[1], APIError) and got[1].status == 400 and WEIGHTS in got[1].message
        assert NAMES[5] not in inf.models and {NAMES[3], NAMES[7]} <= set(inf.models)
