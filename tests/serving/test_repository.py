"""Models at runtime through Triton's repository and statistics extensions, driven by tritonclient: index, load,
reload (atomic: every answer is the old head's or the new one's), unload (what it accepted is answered, then
404), admin keys, names that try to leave the repository, damaged models that fail while the others serve, and
the repository folder polled."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.http as triton
from safetensors.torch import load_file, save_file
from tritonclient.utils import InferenceServerException

from service.bench.server import children
from service.config import Settings
from service.serving.core.results import Result
from service.serving.core.work import Task
from service.serving.engine.engine import Engine
from tests.conftest import edit_manifest, write_tiny_model
from tests.serving.server import Server, metric

ADMIN, USER = "admin-key-1", "user-key-1"
AS_ADMIN, AS_USER = {"Authorization": f"Bearer {ADMIN}"}, {"Authorization": f"Bearer {USER}"}
TEXTS = ["the first text", "a second, somewhat longer text. It has two sentences!", "x",
         "Long one, with many words in it. " * 4]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("runtime")
    repo = root / "models"
    write_tiny_model(repo, tiny_backbone_dir, name="tiny", seed=0)
    write_tiny_model(repo, tiny_backbone_dir, name="tiny-b", seed=1, max_length=24)
    for version, seed in (("v1", 2), ("v2", 12)):  # versions of a model kept elsewhere, one linked in
        write_tiny_model(root / "store" / version, tiny_backbone_dir, name="linked", seed=seed)
    (repo / "linked").symlink_to(root / "store" / "v1" / "linked", target_is_directory=True)
    damaged(repo, tiny_backbone_dir)
    return repo


def damaged(repo: Path, backbone_dir: Path) -> None:
    """Models that must fail to load, each for its own reason."""
    nan = write_tiny_model(repo, backbone_dir, name="bad-nan", seed=3)
    state = load_file(str(nan / "head.safetensors"))
    first = sorted(state)[0]
    state[first][(0,) * state[first].dim()] = float("nan")
    save_file(state, str(nan / "head.safetensors"))
    cut = write_tiny_model(repo, backbone_dir, name="bad-truncated", seed=4)
    data = (cut / "head.safetensors").read_bytes()
    (cut / "head.safetensors").write_bytes(data[: len(data) // 2])
    labels = write_tiny_model(repo, backbone_dir, name="bad-labels", seed=5)
    edit_manifest(labels, labels=["one", "two"])
    backbone = write_tiny_model(repo, backbone_dir, name="bad-backbone", seed=6)
    manifest = json.loads((backbone / "manifest.json").read_text())
    manifest["backbone"].update(source=str(repo.parent / "no-such-backbone"), revision="other")
    (backbone / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def server(repo: Path, logs: Path) -> Iterator[Server]:
    s = Server(logs, model_repository=repo, models="tiny", default_model="tiny", model_control="explicit",
               admin_keys=ADMIN, api_keys=USER, max_wait_ms=2, metrics_models="tiny,tiny-b").wait_ready()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=f"127.0.0.1:{server.port}")


def scores(server: Server, model: str, texts: list[str] = TEXTS) -> list[dict[str, float]]:
    r = httpx.post(f"{server.url}/v1/models/{model}/classify", json={"inputs": texts}, headers=AS_USER, timeout=60)
    assert r.status_code == 200, r.text
    return [res["scores"] for res in r.json()["results"]]


def alone(folder: Path, texts: list[str] = TEXTS) -> list[Result]:
    engine = Engine.load(folder, device="cpu", warmup=False)
    return engine.run([Task(t) for t in texts])


def close(got: dict[str, float], want: Result, atol: float = 1e-5) -> bool:
    return got.keys() == want.scores.keys() and all(abs(got[k] - want.scores[k]) <= atol for k in got)


def states(client: triton.InferenceServerClient) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["state"], e.get("reason", "")) for e in client.get_model_repository_index(headers=AS_ADMIN)}


def test_index_lists_every_folder_with_its_state(client: triton.InferenceServerClient) -> None:
    index = states(client)
    assert index["tiny"] == ("READY", "")
    assert index["tiny-b"] == ("UNAVAILABLE", "not loaded")
    assert "bad-nan" in index and "linked" in index
    assert "model_repository" in client.get_server_metadata()["extensions"]


def test_load_reload_and_unload(client: triton.InferenceServerClient, server: Server, repo: Path,
                                tiny_backbone_dir: Path) -> None:
    assert not client.is_model_ready("tiny-b", headers=AS_USER)
    client.load_model("tiny-b", headers=AS_ADMIN)
    assert client.is_model_ready("tiny-b", headers=AS_USER) and states(client)["tiny-b"] == ("READY", "")
    got = scores(server, "tiny-b")
    assert all(close(g, w) for g, w in zip(got, alone(repo / "tiny-b"), strict=True))
    page = httpx.get(f"{server.url}/metrics").text
    assert metric(page, "routing_model_loads_total", model="tiny-b", outcome="success") == 1
    assert metric(page, "routing_model_weight_bytes", model="tiny-b") == (repo / "tiny-b" / "head.safetensors"
                                                                        ).stat().st_size
    assert metric(page, "routing_model_info", model="tiny-b") == 1

    write_tiny_model(repo, tiny_backbone_dir, name="tiny-b", seed=11, max_length=24)  # retrained: new weights
    client.load_model("tiny-b", headers=AS_ADMIN)
    new = alone(repo / "tiny-b")
    assert all(close(g, w) for g, w in zip(scores(server, "tiny-b"), new, strict=True))
    assert not close(scores(server, "tiny-b")[0], alone(repo / "tiny")[0], atol=1e-3)  # not some other head

    client.unload_model("tiny-b", headers=AS_ADMIN)
    assert not client.is_model_ready("tiny-b", headers=AS_USER)
    assert states(client)["tiny-b"] == ("UNAVAILABLE", "unloaded")
    r = httpx.post(f"{server.url}/v1/models/tiny-b/classify", json={"inputs": ["x"]}, headers=AS_USER)
    assert r.status_code == 404 and "tiny-b" in r.json()["error"]["message"]
    page = httpx.get(f"{server.url}/metrics").text
    assert metric(page, "routing_model_unloads_total", model="tiny-b") == 1
    assert metric(page, "routing_model_info", model="tiny-b") == 0 and 'model="tiny-b",backbone' not in page
    client.unload_model("tiny-b", headers=AS_ADMIN)  # unloading what is not loaded: nothing to do
    assert scores(server, "tiny")  # the other model served throughout


def test_reload_and_unload_under_load_lose_no_answer(client: triton.InferenceServerClient, server: Server,
                                                     repo: Path, tiny_backbone_dir: Path) -> None:
    # requests keep coming for tiny-b while it is reloaded with other weights and then unloaded: every request
    # is answered 200 with the old head's or the new head's scores, or (after the unload) 404; nothing else
    client.load_model("tiny-b", headers=AS_ADMIN)
    old = alone(repo / "tiny-b", TEXTS[:2])
    write_tiny_model(repo, tiny_backbone_dir, name="tiny-b", seed=12, max_length=24)
    new = alone(repo / "tiny-b", TEXTS[:2])
    statuses: list[int] = []
    mixed: list[object] = []
    stop = threading.Event()

    async def load() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=AS_USER, timeout=60) as http:
            async def one() -> None:
                while not stop.is_set():
                    r = await http.post("/v1/models/tiny-b/classify", json={"inputs": TEXTS[:2]})
                    statuses.append(r.status_code)
                    if r.status_code == 200:
                        got = [res["scores"] for res in r.json()["results"]]
                        if not (all(map(close, got, old)) or all(map(close, got, new))):
                            mixed.append(got)
            await asyncio.gather(*(one() for _ in range(8)))

    thread = threading.Thread(target=lambda: asyncio.run(load()))
    thread.start()
    try:
        time.sleep(0.5)
        client.load_model("tiny-b", headers=AS_ADMIN)
        time.sleep(0.5)
        client.unload_model("tiny-b", headers=AS_ADMIN)
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
    assert not mixed, mixed[:2]
    assert statuses.count(200) > 10 and set(statuses) <= {200, 404}, sorted(set(statuses))
    assert statuses[-1] == 404 and 404 not in statuses[: statuses.index(404)]  # once gone, gone


def test_admin_key_is_required(server: Server) -> None:
    url = f"{server.url}/v2/repository/models/tiny-b/load"
    assert httpx.post(url).status_code == 401
    r = httpx.post(url, headers=AS_USER)
    assert r.status_code == 403 and "admin key" in r.json()["error"]
    assert httpx.post(f"{server.url}/v2/repository/index", headers=AS_USER).status_code == 403
    assert httpx.post(f"{server.url}/v2/repository/index", headers=AS_ADMIN).status_code == 200
    # the statistics are read with an inference key
    assert httpx.get(f"{server.url}/v2/models/stats").status_code == 401


def test_a_linked_model_folder_loads_reloads_when_relinked_and_unloads(client: triton.InferenceServerClient,
                                                                        server: Server, repo: Path) -> None:
    """A repository entry that is a symbolic link is followed, as at start: a new version is linked in and reloaded
    (before, the index listed it, and every load or unload of it answered 404 'no model folder')."""
    store = repo.parent / "store"
    client.load_model("linked", headers=AS_ADMIN)
    assert all(close(g, w) for g, w in zip(scores(server, "linked"), alone(store / "v1" / "linked"), strict=True))
    (repo / "linked.new").symlink_to(store / "v2" / "linked", target_is_directory=True)
    (repo / "linked.new").replace(repo / "linked")  # switched in one step
    client.load_model("linked", headers=AS_ADMIN)
    assert all(close(g, w) for g, w in zip(scores(server, "linked"), alone(store / "v2" / "linked"), strict=True))
    client.unload_model("linked", headers=AS_ADMIN)
    assert not client.is_model_ready("linked", headers=AS_USER)


@pytest.mark.parametrize(("verb", "body", "message"), [
    ("load", {"parameters": 5}, "parameters must be a JSON object, not a number (5)"),  # a 500 before
    ("load", {"parameters": ["config"]}, "parameters must be a JSON object, not a list"),  # a 500 before
    ("load", {"parameters": {"config": "{}"}}, "load parameters ['config'] are not supported"),
    ("unload", {"parameters": "x"}, "parameters must be a JSON object, not the string 'x'"),  # ignored before
    ("unload", {"parameters": {"unload_dependents": "yes"}}, "parameters.unload_dependents must be a bool"),
    ("unload", {"parameters": {"force": True}}, "unload parameters ['force'] are not supported"),
])
def test_control_parameters_are_checked(server: Server, verb: str, body: dict, message: str) -> None:
    r = httpx.post(f"{server.url}/v2/repository/models/tiny/{verb}", json=body, headers=AS_ADMIN)
    assert r.status_code == 400 and message in r.json()["error"], r.text
    assert httpx.post(f"{server.url}/v2/models/tiny/infer", headers=AS_USER, json={"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["still served"]}]}).status_code == 200


@pytest.mark.parametrize(("name", "status"), [("..", 404), ("UPPER", 400), (".hidden", 400), ("a..b", 400),
                                              ("nope", 404), ("a" * 300, 400)])  # a 500 before
def test_names_that_leave_the_repository_are_refused(server: Server, name: str, status: int) -> None:
    r = httpx.post(f"{server.url}/v2/repository/models/{name}/load", headers=AS_ADMIN)
    assert r.status_code == status and r.json()["error"], r.text
    for path in ("../tiny/load", "..%2Ftiny/load", "a%2Fb/load"):  # a slash never reaches a name
        assert httpx.post(f"{server.url}/v2/repository/models/{path}", headers=AS_ADMIN).status_code in (400, 404)


@pytest.mark.parametrize(("name", "problem"), [("bad-nan", "non-finite"), ("bad-truncated", "safetensors"),
                                               ("bad-labels", "labels"), ("bad-backbone", "backbone")])
def test_a_damaged_model_fails_to_load_and_the_others_serve(client: triton.InferenceServerClient, server: Server,
                                                            repo: Path, name: str, problem: str) -> None:
    before = scores(server, "tiny")
    failures = metric(httpx.get(f"{server.url}/metrics").text, "routing_model_loads_total", model="_other",
                      outcome="failure")
    with pytest.raises(InferenceServerException) as e:
        client.load_model(name, headers=AS_ADMIN)
    assert problem in str(e.value) and name in str(e.value)
    state, reason = states(client)[name]
    assert state == "UNAVAILABLE" and problem in reason
    assert reason.startswith(f"load failed: {repo / name}/"), reason  # the file and the problem, nothing before
    assert not client.is_model_ready(name, headers=AS_USER)
    assert scores(server, "tiny") == before
    page = httpx.get(f"{server.url}/metrics").text  # a model not named in ROUTING_METRICS_MODELS: counted as _other
    assert metric(page, "routing_model_loads_total", model="_other", outcome="failure") == failures + 1


def test_statistics(client: triton.InferenceServerClient, server: Server) -> None:
    before = client.get_inference_statistics("tiny", headers=AS_USER)["model_stats"][0]
    scores(server, "tiny")
    stats = client.get_inference_statistics("tiny", headers=AS_USER)["model_stats"][0]
    assert stats["name"] == "tiny" and stats["version"] == "1"
    assert stats["inference_count"] - before["inference_count"] == len(TEXTS)
    assert stats["execution_count"] > before["execution_count"] and stats["last_inference"] > 0
    inference = stats["inference_stats"]
    assert inference["success"]["count"] - before["inference_stats"]["success"]["count"] == 1
    assert inference["success"]["ns"] > before["inference_stats"]["success"]["ns"]
    assert inference["queue"]["count"] - before["inference_stats"]["queue"]["count"] >= len(TEXTS)
    assert inference["compute_infer"]["ns"] > 0 and stats["batch_stats"]
    every = client.get_inference_statistics(headers=AS_USER)["model_stats"]
    assert "tiny" in {s["name"] for s in every}
    with pytest.raises(InferenceServerException):
        client.get_inference_statistics("nope", headers=AS_USER)


def test_control_is_off_by_default(tiny: Server) -> None:
    r = httpx.post(f"{tiny.url}/v2/repository/models/tiny/load")
    assert r.status_code == 403 and "ROUTING_ADMIN_KEYS" in r.json()["error"]
    with pytest.raises(ValueError, match="admin_keys"):
        Settings(model_control="explicit")
    with pytest.raises(ValueError, match="differ"):
        Settings(admin_keys=["k"], api_keys=["k"])


def test_poll_mode_follows_the_repository(tmp_path: Path, tiny_backbone_dir: Path, logs: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()  # empty: the server starts without models, no default named
    s = Server(logs, model_repository=repo, model_control="poll", repository_poll_s=0.2, admin_keys=ADMIN).wait_ready()
    try:
        def ready(name: str) -> bool:
            return httpx.get(f"{s.url}/v2/models/{name}/ready").status_code == 200

        def until(check: object, timeout: float = 30) -> None:
            end = time.monotonic() + timeout
            while time.monotonic() < end and not check():  # type: ignore[operator]
                time.sleep(0.1)
            assert check(), "the repository change was not followed"  # type: ignore[operator]

        assert httpx.get(f"{s.url}/readyz").json()["models"] == []
        assert httpx.get(f"{s.url}/v1/models").json() == {"default": None, "models": [], "object": "list", "data": []}
        r = httpx.post(f"{s.url}/v1/classify", json={"inputs": ["x"]})
        assert r.status_code == 404 and "no default model" in r.json()["error"]["message"]
        r = httpx.post(f"{s.url}/v1/explain", json={"inputs": ["x"], "models": "all"})
        assert r.status_code == 404 and "no model is loaded" in r.json()["error"]["message"]
        write_tiny_model(repo, tiny_backbone_dir, name="tiny")
        until(lambda: ready("tiny"), timeout=120)  # the first model starts its backbone's process
        r = httpx.post(f"{s.url}/v1/classify", json={"inputs": TEXTS})  # the first model to serve is the default
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        # no model was loaded at start, so none has series of its own (ROUTING_METRICS_MODELS names some)
        page = httpx.get(f"{s.url}/metrics").text
        assert metric(page, "routing_texts_processed_total", model="_other") == len(TEXTS)
        assert metric(page, "routing_model_info", model="_other") == 1 and 'model="tiny"' not in page
        assert httpx.get(f"{s.url}/v1/models").json()["default"] == "tiny"
        r = httpx.post(f"{s.url}/v2/repository/models/tiny/load", headers=AS_ADMIN)
        assert r.status_code == 400 and "poll" in r.json()["error"]
        write_tiny_model(repo, tiny_backbone_dir, name="tiny-p", seed=7)
        until(lambda: ready("tiny-p"))
        first = scores(s, "tiny-p")
        write_tiny_model(repo, tiny_backbone_dir, name="tiny-p", seed=8)
        until(lambda: scores(s, "tiny-p") != first)
        assert all(close(g, w) for g, w in zip(scores(s, "tiny-p"), alone(repo / "tiny-p"), strict=True))
        shutil.rmtree(repo / "tiny-p")
        until(lambda: not ready("tiny-p"))
        assert ready("tiny")
        until(lambda: [e["name"] for e in httpx.post(f"{s.url}/v2/repository/index", headers=AS_ADMIN).json()]
              == ["tiny"])  # the folder gone, the index forgets it
        shutil.rmtree(repo / "tiny")  # the default model goes: a route without a model name says so
        until(lambda: not ready("tiny"))
        r = httpx.post(f"{s.url}/v1/classify", json={"inputs": ["x"]})
        assert r.status_code == 404 and "'tiny' (the default model" in r.json()["error"]["message"], r.text
    finally:
        s.stop()


def test_a_model_of_another_backbone_gets_its_own_process_and_frees_it_on_unload(
        client: triton.InferenceServerClient, server: Server, repo: Path, tiny_backbone_dir: Path) -> None:
    folder = write_tiny_model(repo, tiny_backbone_dir, name="tiny-other", seed=9)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["backbone"]["revision"] = "other"  # another backbone group (the same weights, loaded again)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    before = set(children(server.proc.pid))
    client.load_model("tiny-other", headers=AS_ADMIN)
    started = set(children(server.proc.pid)) - before
    assert len(started) == 1 and client.is_model_ready("tiny-other", headers=AS_USER)
    assert all(close(g, w) for g, w in zip(scores(server, "tiny-other"), alone(folder), strict=True))
    page = httpx.get(f"{server.url}/metrics").text
    assert metric(page, "routing_backbone_process_resident_memory_bytes", backbone="tiny-bert@other") > 0
    client.unload_model("tiny-other", headers=AS_ADMIN)
    time.sleep(0.5)
    assert not set(children(server.proc.pid)) & started  # its process has exited
    page = httpx.get(f"{server.url}/metrics").text
    assert metric(page, "routing_backbone_process_resident_memory_bytes", backbone="tiny-bert@other") == 0
    assert 'routing_queue_depth{backbone="tiny-bert@other"}' not in page
    assert scores(server, "tiny")


def test_a_backbone_of_the_same_name_and_revision_from_another_source_is_a_group_of_its_own(
        client: triton.InferenceServerClient, server: Server, repo: Path, tiny_backbone_dir: Path,
        tmp_path: Path) -> None:
    twin_dir = Path(shutil.copytree(tiny_backbone_dir, tmp_path / "tiny-bert-twin"))  # another source, same weights
    folder = write_tiny_model(repo, twin_dir, name="tiny-twin", seed=10)  # named tiny-bert@random, as tiny's
    try:
        client.load_model("tiny-twin", headers=AS_ADMIN)
        assert client.is_model_ready("tiny-twin", headers=AS_USER) and client.is_model_ready("tiny", headers=AS_USER)
        page = httpx.get(f"{server.url}/metrics").text
        assert 'routing_queue_depth{backbone="tiny-bert@random"}' in page  # tiny's group still there, by its name
        assert f'routing_queue_depth{{backbone="tiny-bert@random ({twin_dir})"}}' in page
        assert all(close(g, w) for g, w in zip(scores(server, "tiny-twin"), alone(folder), strict=True))
        assert all(close(g, w) for g, w in zip(scores(server, "tiny"), alone(repo / "tiny"), strict=True))
        client.unload_model("tiny-twin", headers=AS_ADMIN)
        time.sleep(0.5)
        page = httpx.get(f"{server.url}/metrics").text
        assert f'routing_queue_depth{{backbone="tiny-bert@random ({twin_dir})"}}' not in page
        assert 'routing_queue_depth{backbone="tiny-bert@random"}' in page and scores(server, "tiny")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_replicas_load_and_drop_a_head_in_every_process(repo: Path, logs: Path) -> None:
    s = Server(logs, model_repository=repo, models="tiny", default_model="tiny", model_control="explicit",
               admin_keys=ADMIN, model_replicas=2, max_batch_size=1).wait_ready()
    try:
        client = triton.InferenceServerClient(url=f"127.0.0.1:{s.port}")
        client.load_model("tiny-b", headers=AS_ADMIN)
        want = alone(repo / "tiny-b")

        async def together() -> list[list[dict[str, float]]]:  # batches of one text keep both processes busy
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                rs = await asyncio.gather(*(http.post("/v1/models/tiny-b/classify", json={"inputs": TEXTS})
                                            for _ in range(8)))
            return [[res["scores"] for res in r.json()["results"]] for r in rs]

        for got in asyncio.run(together()):
            assert all(close(g, w) for g, w in zip(got, want, strict=True))
        client.unload_model("tiny-b", headers=AS_ADMIN)
        assert not client.is_model_ready("tiny-b") and scores(s, "tiny")
    finally:
        s.stop()
