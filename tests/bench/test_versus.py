"""`bench serve` against peers: each server is measured while the others are paused (SIGSTOP), so an idle
server that polls takes no CPU from the one measured, the engine alone while every server is paused, and every
server goes on (and stops) afterwards."""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.bench import serve, versus
from service.bench.load import metrics_stats
from service.bench.serve import Offline
from service.bench.server import ServerProcess, children, free_port, ready_together
from service.bench.server import process_state as state
from tests.serving.server import Server


def test_a_free_port_is_never_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    offered = iter([50001, 50001, 50002])  # the system offers one free port twice in a row

    class Socket:
        def __enter__(self) -> Socket:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr("service.bench.server.socket.socket", Socket)
    monkeypatch.setattr("service.bench.server._GIVEN", set(), raising=False)
    assert [free_port(), free_port()] == [50001, 50002]


def test_pause_stops_the_server_and_every_process_it_started_until_resume(tmp_path: Path) -> None:
    script = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
              " time.sleep(60)")
    server = ServerProcess(tmp_path, [sys.executable, "-c", script], dict(os.environ), "tree", free_port())
    end = time.monotonic() + 10
    while not children(server.proc.pid) and time.monotonic() < end:
        time.sleep(0.05)
    kids = children(server.proc.pid)
    try:
        (child,) = kids
        server.pause()
        assert state(server.proc.pid) == "T" and state(child) == "T"
        server.resume()
        assert state(server.proc.pid) != "T" and state(child) != "T"
        server.pause()
        assert server.stop(timeout=10) == -signal.SIGTERM  # a paused server still stops
    finally:
        server.stop(timeout=10)
        for pid in kids:
            os.kill(pid, signal.SIGKILL)


def test_servers_started_together_are_all_stopped_when_one_fails_to_start(tmp_path: Path) -> None:
    started: list[ServerProcess] = []

    def sleeper() -> ServerProcess:
        started.append(ServerProcess(tmp_path, [sys.executable, "-c", "import time; time.sleep(60)"],
                                     dict(os.environ), "sleeper", free_port()))
        return started[-1]

    def broken() -> ServerProcess:
        raise RuntimeError("cannot start")

    with pytest.raises(RuntimeError, match="cannot start"):
        ready_together([sleeper, sleeper, broken])
    assert len(started) == 2 and all(s.proc.poll() is not None for s in started)


def test_each_contender_is_measured_while_the_others_are_paused(pair: list[Server]) -> None:
    servers = pair  # stopped at the end of the session, where they must exit cleanly after these pauses
    contenders = [versus.Contender(f"s{k}", s, "/v1/classify", metrics_stats(s.url), s.cpu)
                  for k, s in enumerate(servers)]
    seen: list[tuple[str, list[str]]] = []

    def measure(c: versus.Contender) -> dict[str, Any]:
        others = [o for o in contenders if o is not c]
        pids = [p for o in others for p in (o.server.proc.pid, *children(o.server.proc.pid))]
        seen.append((c.name, [state(p) for p in pids]))
        assert state(c.server.proc.pid) != "T"
        return {"throughput": 1.0, "p99_ms": 1.0, "mean_batch": 1.0}

    def engine() -> float:  # the model function alone: every server paused
        seen.append((versus.ENGINE, [state(p) for s in servers for p in (s.proc.pid, *children(s.proc.pid))]))
        return 2.0

    per, alone = versus.rows_in_turns(contenders, measure, 2, "test", ["a short text", "another one"])
    with_engine, engine_rounds = versus.rows_in_turns(contenders, measure, 3, "test", ["a short text"], engine=engine)
    after = [state(p) for s in servers for p in (s.proc.pid, *children(s.proc.pid))]
    e = versus.ENGINE
    # every round, the order rotating; the engine's turn rotates with the servers'
    assert [name for name, _ in seen] == ["s0", "s1", "s1", "s0", "s0", "s1", e, "s1", e, "s0", e, "s0", "s1"]
    assert all(states and set(states) == {"T"} for _, states in seen)  # the others (and their models' processes)
    assert "T" not in after  # all going on again
    assert {n: len(rows) for n, rows in per.items()} == {"s0": 2, "s1": 2} and alone == []
    assert {n: len(rows) for n, rows in with_engine.items()} == {"s0": 3, "s1": 3} and engine_rounds == [2.0] * 3
    assert all(httpx.post(f"{s.url}/v1/classify", json={"inputs": ["hi"]}, timeout=30).status_code == 200
               for s in servers)  # serving again after the pauses


def test_the_engine_alone_computes_the_clients_batches_and_each_server_gets_its_share(
        tiny_repo: Path, pair: list[Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.serving.engine.engine import Engine

    texts = [f"text number {k}" + " more" * (k % 5) for k in range(12)]
    offline = Offline(tiny_repo, "tiny", texts, "cpu")
    batches: list[list[str]] = []
    run = Engine.run

    def recording(self: Engine, tasks: list) -> list:
        batches.append([t.text for t in tasks])
        return run(self, tasks)

    monkeypatch.setattr(Engine, "run", recording)
    assert offline.in_order(4, 0.0) > 0
    # warm-up, then a whole pass: client w of 4 sends texts w, w + 4, ... so round r's batch is texts[4r : 4r + 4]
    assert batches == [texts[:4], texts[:4], texts[4:8], texts[8:]]
    monkeypatch.setattr(Engine, "run", run)

    contenders = [versus.Contender(name, s, "/v1/classify", metrics_stats(s.url), s.cpu)
                  for name, s in zip((versus.THIS, "other"), pair, strict=True)]
    result = versus.compare(contenders, texts, [1, 2], 0.3, 1, [],
                            engine={1: functools.partial(offline.in_order, 1, 0.3)})
    one, two = result["closed"][1], result["closed"][2]
    limit = one[versus.ENGINE]["throughput"]
    assert limit > 0 and len(one[versus.ENGINE]["rounds"]) == 1
    assert {n: m["of_engine_alone"] for n, m in one["summary"].items()} == pytest.approx(
        {n: m["throughput"] / limit for n, m in one["summary"].items()})
    assert versus.ENGINE not in two and all("of_engine_alone" not in m for m in two["summary"].values())

    runs = {"batching": [{"concurrency": 1, "throughput": 1.0, "p50_ms": 1.0, "p99_ms": 1.0, "mean_batch": 1.0,
                          "model_busy": 0.5, "batch_ms": 1.0}]}
    limits = {"by_batch_size": {1: limit}, "best_batch_size": 1, "throughput": limit, "worker_thread_throughput": limit,
              "server_max_batch_size": 1}
    summary = serve.report_all(runs, limits, None, None, None, None, result, 1, 5.0, tmp_path / "serve.json", {})
    assert set(summary["peers_of_engine_alone"]) == {1}  # only where the engine alone was measured
    assert summary["peers_of_engine_alone"][1] == pytest.approx(
        {n: m["of_engine_alone"] for n, m in one["summary"].items()})
    assert (tmp_path / "serve.json").exists()


def test_the_closed_loops_send_the_texts_a_request_asked(pair: list[Server], monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench serve --texts-per-request 3``: every closed loop of the comparison sends requests of 3 texts, counted
    in texts (the warm-up before each turn sends one)."""
    contenders = [versus.Contender(name, s, "/v1/classify", metrics_stats(s.url), s.cpu)
                  for name, s in zip((versus.THIS, "other"), pair, strict=True)]
    sent: list[int] = []
    real = versus.closed_loop

    def spy(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs.get("per_request", 1))
        return real(*args, **kwargs)

    monkeypatch.setattr(versus, "closed_loop", spy)
    result = versus.compare(contenders, [f"text {k}" for k in range(12)], [2], 0.3, 1, [], per_request=3)
    assert sent == [1, 3, 1, 3] and result["texts_per_request"] == 3
    rows = [r for rounds in result["closed"][2]["rounds"].values() for r in rounds]
    assert len(rows) == 2 and all(r["texts_per_request"] == 3 and r["errors"] == 0 for r in rows)
    assert all(r["throughput"] > 0 for r in rows)


def test_this_service_with_several_fronts_is_a_contender_of_its_own(tiny_repo: Path, tmp_path: Path) -> None:
    """``bench serve --workers 2``: the same service with two fronts beside the one-front server, measured in turns;
    its CPU counts every process of it (supervisor, fronts, engine host: server; backbone: models), and the engine
    host's apart."""
    contenders = versus.start([], tiny_repo, "tiny", "cpu", 4, 2.0, tmp_path, None, [2])
    try:
        assert [c.name for c in contenders] == [versus.THIS, f"{versus.THIS}, 2 fronts"]
        result = versus.compare(contenders, ["a short text", "another one"], [2], 0.5, 1, [])
        summary = result["closed"][2]["summary"]
        assert all(m["throughput"] > 0 for m in summary.values())
        assert all(0 < m["front_cpu_ms"] < m["server_cpu_ms"] for m in summary.values())  # per text: fronts, all
        two = summary[contenders[1].name]
        assert 0 < two["host_cpu_ms"] < two["front_cpu_ms"] and "host_cpu_ms" not in summary[versus.THIS]
        cpu = contenders[1].cpu()
        assert cpu is not None and cpu["server"] > 0 and cpu["models"] > 0 and 0 < cpu["host"] < cpu["server"]
        pss = versus.memory(contenders)
        assert set(pss) == {c.name for c in contenders} and all(m["backbones"] > 0 for m in pss.values())
        assert pss[contenders[1].name]["server"] > pss[versus.THIS]["server"]  # two fronts, a host, a supervisor
    finally:
        versus.stop(contenders)


def test_another_checkout_serves_the_model_from_its_own_models(tmp_path: Path) -> None:
    """A baseline checkout reads the model from its own tree, whose manifest it knows (an earlier version refuses
    this one's fields); this checkout, and one without the model, from the repository given."""
    from service.bench import report

    repo, old = tmp_path / "repo", tmp_path / "old"
    (repo / "m").mkdir(parents=True)
    (old / "models" / "m").mkdir(parents=True)
    assert report.repository_for(old, repo, "m") == (old / "models").resolve()
    assert report.repository_for(old, repo, "n") == repo.resolve()
    this = Path(report.__file__).resolve().parents[2]
    assert report.repository_for(this, repo, "tweet-sentiment") == repo.resolve()


def test_the_contenders_start_with_their_own_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This service with its default fronts (no ROUTING_WORKERS), each number of fronts asked, and a baseline
    checkout serving the model from its own models folder, every one with the batch settings given."""
    started: list[dict[str, Any]] = []

    class Fake:
        url, cpu = "http://127.0.0.1:9", None

        def __init__(self, logs: Path, **settings: Any) -> None:
            started.append(settings)

    monkeypatch.setattr(versus, "LocalServer", Fake)
    monkeypatch.setattr(versus, "ready_together", lambda starts: [start() for start in starts])
    repo, old = tmp_path / "repo", tmp_path / "old"
    (old / "models" / "m").mkdir(parents=True)
    contenders = versus.start([], repo, "m", "cpu", 32, 5.0, tmp_path, old, [1, 2])
    assert [c.name for c in contenders] == ["routing-service", "routing-service, 1 front", "routing-service, 2 fronts",
                                            "baseline"]
    assert "workers" not in started[0] and [s.get("workers") for s in started[1:3]] == [1, 2]
    assert [s["model_repository"] for s in started] == [repo.resolve()] * 3 + [(old / "models").resolve()]
    assert started[3]["checkout"] == old and all(s["max_batch_size"] == 32 for s in started)
