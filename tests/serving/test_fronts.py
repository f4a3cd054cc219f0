"""Several fronts over one engine host (ROUTING_WORKERS=2), against the one-front server side by side: the same
answers on every protocol, one backbone process, one queue, metrics of the whole server whichever front answers,
a drain that loses no accepted request, a front that dies started again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from pydantic import ValidationError

from service.bench.server import descendants, fronts_of, is_backbone_process
from service.config import Settings
from service.serving.supervisor import Backoff
from tests.conftest import write_tiny_model
from tests.serving.server import Server, in_flight, metric, side_by_side

TEXTS = ["a short text", "another text that is somewhat longer than the first one", "x"]


@pytest.fixture(scope="module")
def servers(tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """The tiny model served by one front, and by two fronts over an engine host, started together."""
    common = {"model_repository": tiny_repo, "default_model": "tiny", "max_wait_ms": 20}
    one, two = side_by_side(tmp_path_factory.mktemp("logs-fronts"), common, {**common, "workers": 2})
    yield one, two
    codes = [s.stop() for s in (one, two)]
    assert codes == [0, 0], [s.log_path.read_text()[-3000:] for s in (one, two)]


def reads(pid: int) -> int:
    """Read calls process ``pid`` has made (/proc/<pid>/io ``syscr``): a front reads only when a request or an answer
    for it comes in, and an idle front makes none, where its CPU time moves anyway (uvicorn's loop wakes ten times
    a second) and /proc/<pid>/stat counts it in 10 ms ticks that a front answering a few requests may not reach."""
    return int(Path(f"/proc/{pid}/io").read_text().split("syscr: ", 1)[1].split()[0])


def fronts(server: Server) -> list[int]:
    """The front processes of a server of several (running now)."""
    def command(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # it exited meanwhile
            return b""
    return [p for p in descendants(server.proc.pid) if b"service.serving.front" in command(p)]


def close(a: object, b: object, path: str = "") -> None:
    """``a`` and ``b`` (parsed JSON) equal, numbers within 1e-5."""
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        assert abs(a - b) <= 1e-5, (path, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert list(a) == list(b), path
        for k in a:
            close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, f"{path}[{k}]")
    else:
        assert a == b, (path, a, b)


REQUESTS = [
    ("/v1/classify", {"inputs": TEXTS}),
    ("/v1/classify", {"inputs": TEXTS, "explain": True, "method": "end_to_end"}),
    ("/v1/models/tiny/explain", {"inputs": TEXTS[:2], "target": "all", "include_matrix": True}),
    ("/v1/explain", {"inputs": TEXTS[:1], "method": "shares", "include_phi": True}),
    ("/v1/models/tiny:predict", {"instances": TEXTS}),
    ("/v1/models/tiny:explain", {"instances": [{"text": TEXTS[1]}], "target": "all"}),
    ("/v2/models/tiny/infer", {"id": "7", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [3],
                                                       "data": TEXTS}], "parameters": {"explain": True}}),
    ("/v1/models/tiny/classify", {"inputs": ["y" * 5000]}),  # 413: the same error from a front
    ("/v1/models/nope/classify", {"inputs": TEXTS}),  # 404
    ("/v1/classify", {"inputs": []}),  # 422
]


def test_a_server_started_without_a_number_of_fronts_counts_those_auto_chose(servers: tuple[Server, Server]) -> None:
    one, two = servers  # the first started without workers: auto, one on the CPU
    assert (one.fronts, two.fronts) == (1, 2) and (fronts_of(one.proc.pid), fronts_of(two.proc.pid)) == (1, 2)


def test_every_protocol_answers_as_one_front(servers: tuple[Server, Server]) -> None:
    one, two = servers
    for path, body in REQUESTS:
        want = httpx.post(one.url + path, json=body, timeout=60)
        for _ in range(4):  # new connections: the kernel spreads them over the fronts
            got = httpx.post(two.url + path, json=body, timeout=60)
            assert got.status_code == want.status_code, (path, got.text)
            close(got.json(), want.json(), path)
    inputs = [triton.InferInput("text", [len(TEXTS)], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_))
    outputs = [triton.InferRequestedOutput(n) for n in ("label", "probabilities")]
    answers = [triton.InferenceServerClient(f"127.0.0.1:{s.env['ROUTING_GRPC_PORT']}").infer("tiny", inputs,
                                                                                          outputs=outputs)
               for s in (one, two)]
    assert list(answers[0].as_numpy("label")) == list(answers[1].as_numpy("label"))
    np.testing.assert_allclose(answers[1].as_numpy("probabilities"), answers[0].as_numpy("probabilities"), atol=1e-5)


def test_one_backbone_process_serves_every_front(servers: tuple[Server, Server]) -> None:
    _, two = servers
    assert len(fronts(two)) == 2
    assert sum(map(is_backbone_process, descendants(two.proc.pid))) == 1


def test_metrics_count_every_front(servers: tuple[Server, Server]) -> None:
    """Requests over new connections land on either front; /metrics (answered by either) counts them all, and the
    engine host's batches with them."""
    _, two = servers
    page = lambda: httpx.get(f"{two.url}/metrics").text  # noqa: E731
    stats = lambda: httpx.get(f"{two.url}/v2/models/tiny/stats").json()["model_stats"][0]  # noqa: E731
    before, counted = page(), stats()
    was_read = {p: reads(p) for p in fronts(two)}
    n = 40
    for _ in range(n):
        assert httpx.post(f"{two.url}/v1/classify", json={"inputs": ["count me"]}).status_code == 200
    after, now = page(), stats()
    assert now["inference_stats"]["success"]["count"] - counted["inference_stats"]["success"]["count"] == n
    assert now["inference_count"] - counted["inference_count"] == n  # Triton's statistics, every front's requests
    ok = 'endpoint="/v1/classify",status="200"'
    assert (metric(after, "routing_requests_total", endpoint="/v1/classify", status="200")
            - metric(before, "routing_requests_total", endpoint="/v1/classify", status="200")) == n, ok
    assert metric(after, "routing_texts_processed_total", model="tiny") - metric(
        before, "routing_texts_processed_total", model="tiny") == n
    assert metric(after, "routing_batch_size_count") - metric(before, "routing_batch_size_count") >= 1
    assert metric(after, "routing_model_info", model="tiny") == 1  # each process says so; counted once
    assert metric(after, "routing_backbone_process_resident_memory_bytes", backbone="tiny-bert@random") > 1e6
    assert after.count("# TYPE routing_backbone_process_resident_memory_bytes") == 1  # the host's reading, once
    busy = [p for p, was in was_read.items() if reads(p) != was]
    assert len(busy) == 2, "both fronts answered some of the requests"


def test_one_queue_for_the_whole_server(tiny_repo: Path, tmp_path: Path) -> None:
    """The queue limit holds for the server as a whole: texts held in flight through both fronts fill it, and the
    next text gets 503 whichever front takes it."""
    (server,) = side_by_side(tmp_path, {"model_repository": tiny_repo, "default_model": "tiny", "workers": 2,
                                        "max_queue": 8, "max_batch_size": 1, "max_wait_ms": 0})
    try:
        os.kill(next(p for p in descendants(server.proc.pid) if is_backbone_process(p)), signal.SIGSTOP)
        answers: list[httpx.Response | httpx.TransportError] = []
        # one text first, for the batcher to take to the (stopped) backbone: sent with the rest, the ninth could come
        # before the batcher took the first, and find the queue full (seen once)
        first = in_flight(server, [{"inputs": ["text 0"]}], answers.append)
        time.sleep(0.5)
        held = in_flight(server, [{"inputs": [f"text {k}"]} for k in range(1, 9)], answers.append, already=1)  # queued
        refused = [httpx.post(f"{server.url}/v1/classify", json={"inputs": ["one more"]}) for _ in range(4)]
        assert [r.status_code for r in refused] == [503] * 4 and all(r.headers.get("retry-after") for r in refused)
        assert "overloaded" in refused[0].json()["error"]["message"]
        os.kill(next(p for p in descendants(server.proc.pid) if is_backbone_process(p)), signal.SIGCONT)
        first.join()
        held.join()
        assert [a.status_code for a in answers if isinstance(a, httpx.Response)] == [200] * 9
    finally:
        for p in descendants(server.proc.pid):
            if is_backbone_process(p):
                os.kill(p, signal.SIGCONT)
        assert server.stop() == 0


def test_a_drain_answers_every_accepted_request_and_a_dead_front_is_started_again(tiny_repo: Path,
                                                                                   tmp_path: Path) -> None:
    (server,) = side_by_side(tmp_path, {"model_repository": tiny_repo, "default_model": "tiny", "workers": 2})
    try:
        killed = fronts(server)[0]
        os.kill(killed, signal.SIGKILL)
        for _ in range(300):  # started again; the server answers meanwhile through the other front
            answer = httpx.post(f"{server.url}/v1/classify", json={"inputs": ["still here"]}, timeout=30)
            assert answer.status_code == 200
            if len(now := fronts(server)) == 2 and killed not in now:
                break
            time.sleep(0.1)
        assert len(fronts(server)) == 2 and killed not in fronts(server)
        assert "front 0 exited" in server.log() or "front 1 exited" in server.log()
        backbone = next(p for p in descendants(server.proc.pid) if is_backbone_process(p))
        os.kill(backbone, signal.SIGSTOP)  # requests pile up in flight
        answers: list[httpx.Response | httpx.TransportError] = []
        held = in_flight(server, [{"inputs": [f"drained {k}"]} for k in range(12)], answers.append)
        server.proc.send_signal(signal.SIGTERM)  # the supervisor: every front drains
        time.sleep(0.5)
        os.kill(backbone, signal.SIGCONT)
        held.join()
        assert server.proc.wait(60) == 0
        assert len(answers) == 12 and all(isinstance(a, httpx.Response) and a.status_code == 200 for a in answers), [
            a if isinstance(a, Exception) else a.status_code for a in answers]
    finally:
        if server.proc.poll() is None:  # the test failed before its drain
            server.stop()


def connections_held(pid: int, port: int) -> int:
    """Established TCP connections to ``port`` on this machine that process ``pid`` holds (its file descriptors'
    sockets, read against /proc/net/tcp)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # local port; ESTABLISHED
            inodes.add(fields[9])
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            links.append(os.readlink(fd))
    return sum(link.startswith("socket:[") and link[8:-1] in inodes for link in links)


def test_a_burst_of_connections_is_shared_by_the_fronts(servers: tuple[Server, Server]) -> None:
    """Connections queued while the fronts were not running (a load generator opening its connections at once) are
    taken by every front, not by the first to wake: each accepts one at a time. (uvloop's own server, which each
    front used before, accepts every queued connection when woken: 32 and 0 here.)"""
    _, two = servers
    port = int(two.url.rsplit(":", 1)[1])
    pids = fronts(two)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    clients = []
    try:
        for _ in range(32):  # queued by the kernel (the handshake needs no front)
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    try:
        for _ in range(100):
            held = [connections_held(pid, port) for pid in pids]
            if sum(held) == 32:
                break
            time.sleep(0.05)
        assert sum(held) == 32 and min(held) >= 4, held
    finally:
        for c in clients:
            c.close()


def test_several_fronts_have_no_head_cache_yet() -> None:
    with pytest.raises(ValidationError, match="workers > 1 and a head cache"):
        Settings(workers=2, head_cache_bytes=10_000_000)


def test_a_model_loaded_through_the_repository_api_answers_from_every_front(tiny_backbone_dir: Path,
                                                                              tmp_path: Path) -> None:
    """A load (or an unload) through either front returns once every front serves the change: requests over new
    connections right after it, spread over both fronts, all get the new model (or all 404). The model loaded names a
    backbone of its own (a copy of the tiny one's folder): each front then loads its tokenizer before it serves it."""
    repo = tmp_path / "repo"
    write_tiny_model(repo, tiny_backbone_dir, name="tiny")
    folder = write_tiny_model(repo, Path(shutil.copytree(tiny_backbone_dir, tmp_path / "backbone-b")), name="tiny-b",
                              seed=1)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["backbone"]["revision"] = "copy"  # a group of its own, by its name too
    (folder / "manifest.json").write_text(json.dumps(manifest))
    admin = {"headers": {"Authorization": "Bearer admin-key"}, "timeout": 120}  # a new backbone's process: seconds
    server, alone = side_by_side(tmp_path, {"model_repository": repo, "models": "tiny", "default_model": "tiny",
                                            "workers": 2, "model_control": "explicit", "admin_keys": "admin-key",
                                            "metrics_models": "all"},  # tiny-b loaded later: series of its own
                                 {"model_repository": repo, "models": "tiny-b", "default_model": "tiny-b"})
    try:
        try:  # tiny-b's answers as a server that loads it at start gives them
            want = httpx.post(f"{alone.url}/v1/models/tiny-b/classify", json={"inputs": TEXTS}).json()
        finally:
            assert alone.stop() == 0

        def everywhere(path: str, expect: int) -> list[httpx.Response]:
            was_read = {p: reads(p) for p in fronts(server)}
            got = [httpx.post(f"{server.url}{path}", json={"inputs": TEXTS}) for _ in range(30)]  # new connections
            assert [r.status_code for r in got] == [expect] * 30, [r.text for r in got if r.status_code != expect]
            moved = [p for p, was in was_read.items() if reads(p) != was]
            assert len(moved) == 2, "both fronts answered"
            return got

        everywhere("/v1/models/tiny-b/classify", 404)
        index = httpx.post(f"{server.url}/v2/repository/index", json={}, **admin).json()
        assert {e["name"]: e["state"] for e in index} == {"tiny": "READY", "tiny-b": "UNAVAILABLE"}
        assert httpx.post(f"{server.url}/v2/repository/models/tiny-b/load", json={}, **admin).status_code == 200
        for r in everywhere("/v1/models/tiny-b/classify", 200):
            close(r.json(), want)
        page = httpx.get(f"{server.url}/metrics").text
        assert metric(page, "routing_model_info", model="tiny-b") == 1
        assert metric(page, "routing_model_weight_bytes", model="tiny-b") > 0
        assert httpx.post(f"{server.url}/v2/repository/models/tiny-b/load", json={}, **admin).status_code == 200
        everywhere("/v1/models/tiny-b/classify", 200)  # reloaded: answers on
        bad = httpx.post(f"{server.url}/v2/repository/models/nope/load", json={}, **admin)
        assert bad.status_code == 404 and "no model folder 'nope'" in bad.json()["error"]
        assert httpx.post(f"{server.url}/v2/repository/models/tiny-b/unload", json={}, **admin).status_code == 200
        everywhere("/v1/models/tiny-b/classify", 404)
        everywhere("/v1/models/tiny/classify", 200)
        page = httpx.get(f"{server.url}/metrics").text  # the unloaded model's gauges go, as with one front
        assert [line for line in page.splitlines() if line.startswith(("routing_model_info{", "routing_model_weight"))
                and 'model="tiny-b"' in line] == []
        assert metric(page, "routing_model_info", model="tiny") == 1
        assert "Removal of labels" not in server.log()
        models = httpx.get(f"{server.url}/v1/models").json()["models"]
        assert [m["name"] for m in models] == ["tiny"]
    finally:
        assert server.stop() == 0


async def test_a_cancelled_request_is_dropped_on_the_host(servers: tuple[Server, Server]) -> None:
    """A client that leaves: its front cancels the request on the host, which drops what is queued of it (counted
    as dropped, never computed)."""
    _, two = servers
    backbone = next(p for p in descendants(two.proc.pid) if is_backbone_process(p))
    before = httpx.get(f"{two.url}/metrics").text
    os.kill(backbone, signal.SIGSTOP)
    try:
        async with httpx.AsyncClient(base_url=two.url, timeout=60) as client:
            first = asyncio.create_task(client.post("/v1/classify", json={"inputs": ["computing"]}))
            await asyncio.sleep(0.5)  # the first batch holds the (stopped) backbone
            gone = asyncio.create_task(client.post("/v1/classify", json={"inputs": ["leaving", "too"]}))
            await asyncio.sleep(0.5)
            gone.cancel()
            await asyncio.sleep(0.5)
            os.kill(backbone, signal.SIGCONT)
            assert (await first).status_code == 200
    finally:
        os.kill(backbone, signal.SIGCONT)
    for _ in range(100):
        after = httpx.get(f"{two.url}/metrics").text
        if metric(after, "routing_dropped_texts_total", reason="disconnected") > metric(
                before, "routing_dropped_texts_total", reason="disconnected"):
            break
        await asyncio.sleep(0.05)
    assert metric(after, "routing_dropped_texts_total", reason="disconnected") - metric(
        before, "routing_dropped_texts_total", reason="disconnected") == 2
    assert json.loads(httpx.post(f"{two.url}/v1/classify", json={"inputs": ["after"]}).text)["results"]


def test_devices_spread_texts_over_an_engine_on_each(tiny_repo: Path, tmp_path: Path) -> None:
    """ROUTING_DEVICES=cpu,cpu: an engine process on each device (two "devices" here, both the CPU), each batch to
    the first engine free; /metrics says what each engine computed, by its index and device."""
    (server,) = side_by_side(tmp_path, {"model_repository": tiny_repo, "default_model": "tiny", "workers": 2,
                                        "devices": "cpu,cpu", "max_batch_size": 1, "max_wait_ms": 0})
    try:
        assert sum(map(is_backbone_process, descendants(server.proc.pid))) == 2

        async def many() -> list[int]:  # more texts than one engine takes at once: both compute
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                got = await asyncio.gather(*(client.post("/v1/classify", json={"inputs": [f"spread {k}"]})
                                             for k in range(40)))
            return [r.status_code for r in got]

        assert asyncio.run(many()) == [200] * 40
        page = httpx.get(f"{server.url}/metrics").text
        done = [metric(page, "routing_engine_batches_total", engine=str(k), device="cpu") for k in (0, 1)]
        assert min(done) >= 1 and sum(done) == metric(page, "routing_batch_size_count") >= 40, done
        assert min(metric(page, "routing_engine_busy_seconds_total", engine=str(k)) for k in (0, 1)) > 0
    finally:
        assert server.stop() == 0


def test_devices_are_named_once_per_engine() -> None:
    assert Settings(devices="cpu,cpu").engine_devices() == ["cpu", "cpu"]
    assert Settings(model_replicas=3).engine_devices() == ["auto"] * 3
    for bad, why in (({"devices": "tpu"}, "not cpu or cuda"), ({"devices": "cpu,cpu", "model_process": False},
                                                                  "need model_process"),
                     ({"devices": "cpu,cpu", "model_replicas": 2}, "name a device once per engine process")):
        with pytest.raises(ValidationError, match=why):
            Settings(**bad)


def test_a_front_that_keeps_exiting_soon_after_starting_waits_longer_each_time() -> None:
    backoff = Backoff(stable_s=30.0, first_s=1.0, max_s=8.0)
    assert [backoff.exited(2.0) for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]  # doubling, then at most max_s
    assert backoff.exited(45.0) == 0.0  # a front that served a while starts again at once
    assert backoff.exited(0.5) == 1.0  # and a short run after that starts the doubling again
