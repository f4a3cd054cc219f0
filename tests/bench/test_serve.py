"""The parts of `bench serve` on the tiny model: the long text is what it says, the offline limit is
measured on the main thread with the worker-thread figure beside it, the interference figure comes
from real requests against a real server, and the CPU each part used is read from the processes."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from service.bench import load, serve
from service.bench.server import children, cpu_seconds
from service.modeling.backbone import Backbone
from tests.serving.server import Server


def test_long_text_has_one_token_per_character(tiny_backbone_dir: Path) -> None:
    text = serve.long_text(2001)
    assert len(text) == 2001 and text == serve.long_text(2001)  # seeded
    (enc,) = Backbone(str(tiny_backbone_dir), max_length=16).encode([text])
    n_text = sum(not s for s in enc.special)
    assert n_text == 2001


def test_offline_limit_runs_the_engine_on_the_main_thread(tiny_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.serving.engine.engine import Engine

    calls: list[tuple[str, int]] = []
    run = Engine.run

    def recording(self: Engine, tasks: list) -> list:
        calls.append((threading.current_thread().name, len(tasks)))
        return run(self, tasks)

    monkeypatch.setattr(Engine, "run", recording)
    texts = ["a short text", "another one", "and a third, longer text than the others"] * 4
    offline = serve.Offline(tiny_repo, "tiny", texts, "cpu")
    calls.clear()  # the engine's warm-up at load (a batch of 3, in a worker thread): not the limit's
    out = serve.offline_limit(offline, [2, 4, 8], 0.3, max_batch_size=4)
    assert set(out["by_batch_size"]) == {2, 4, 8} and out["best_batch_size"] in (2, 4)  # 8: more than the server forms
    assert out["throughput"] == max(out["by_batch_size"][b] for b in (2, 4)) > 0 and out["worker_thread_throughput"] > 0
    # each batch size on the main thread, and the best one in a worker thread beside it (what each call held, not
    # how many calls fit in the time: that depends on the machine's load)
    assert {size for thread, size in calls if thread == "MainThread"} >= {2, 4, 8}
    assert max(size for thread, size in calls if thread == "bench-model") == out["best_batch_size"]


def test_the_offline_limit_needs_a_batch_size_the_server_may_form() -> None:
    from typer.testing import CliRunner

    from service.cli import app

    res = CliRunner().invoke(app, ["bench", "serve", "--offline-batch-sizes", "64,128", "--max-batch-size", "32"])
    assert res.exit_code == 2 and "at most --max-batch-size (32)" in res.output and "Traceback" not in res.output
    with pytest.raises(ValueError, match="max_batch_size 32"):
        serve.offline_limit(None, [64], 0.1, 32)  # type: ignore[arg-type]  # refused before anything runs


def test_paired_rounds_alternate_served_and_offline(tiny_repo: Path, pair: list[Server]) -> None:
    texts = ["a short text", "another one", "and a third, longer text than the others"] * 4
    offline = serve.Offline(tiny_repo, "tiny", texts, "cpu")
    out = serve.paired_rounds(pair[0].url, texts, 4, offline, 4, 0.5, 2)  # the tiny model's server, in its process
    assert len(out["served"]) == len(out["offline"]) == 2 and min(out["served"] + out["offline"]) > 0
    assert out["ratio"] == pytest.approx(sum(out["served"]) / sum(out["offline"]))


def test_alternating_measures_every_server_every_round(pair: list[Server]) -> None:
    texts = ["a short text", "another one"]
    out = serve.alternating({"process": pair[0].url, "thread": pair[1].url}, texts, 2, 0.3, 2)
    assert set(out["throughput"]) == {"process", "thread"} and all(len(v) == 2 for v in out["throughput"].values())
    assert all(v > 0 for v in out["mean"].values())
    assert out["mean"]["thread"] == pytest.approx(sum(out["throughput"]["thread"]) / 2)


def test_alongside_measures_the_other_settings_in_turns_and_stops_them(tiny_repo: Path, tmp_path: Path) -> None:
    texts = ["a short text", "another one"]
    cfg = {"model_repository": tiny_repo, "default_model": "tiny", "max_wait_ms": 1, "model_process": False}
    started: list[Server] = []
    asked: list[dict] = []

    def start(settings: dict) -> Server:
        asked.append(settings)
        started.append(Server(tmp_path, **settings))
        return started[-1]

    first = start(cfg).wait_ready()
    try:
        out = serve.alongside(start, cfg, False, texts, 2, 0.3, 2, first.url)
    finally:
        first.stop()
    mine, other, unbatched = "model_process=False", "model_process=True", "model_process=False, no batching"
    assert set(out["throughput"]) == {mine, other, unbatched}
    assert all(len(v) == 2 and min(v) > 0 for v in out["throughput"].values())
    m = out["mean"]
    assert out["process_over_thread"] == pytest.approx(m[other] / m[mine])  # this server ran the model in a thread
    assert out["batching_on_over_off"] == pytest.approx(m[mine] / m[unbatched])
    assert all(s.proc.poll() is not None for s in started)  # the servers it started are stopped
    assert [(a["model_process"], a.get("max_batch_size")) for a in asked] == [(False, None), (True, None), (False, 1)]


def test_closed_loop_counts_answers_batches_and_cpu(pair: list[Server]) -> None:
    srv = pair[0]  # the tiny model's server, the model in its own process
    level = load.run_async(load.closed_loop(srv.url, "/v1/classify", ["one text", "another text"], 4, 1.0,
                                              cpu=srv.cpu))
    mine = os.sched_getaffinity(0)
    bad = load.run_async(load.closed_loop(srv.url, "/v1/classify", [""], 2, 0.3, cpus=[max(mine)]))  # empty: 422
    assert bad.load_cpus == (max(mine),) and os.sched_getaffinity(0) == mine  # sent from here, on that CPU alone
    model_pids = children(srv.proc.pid)
    assert level.errors == 0 and level.texts == len(level.latencies) > 4
    assert level.batch_count >= 1 and level.batch_sum >= level.batch_count  # read from the server's /metrics
    assert bad.texts == 0 and bad.errors > 0
    assert len(model_pids) == 1  # the tiny model's process
    assert level.cpu_s is not None and set(level.cpu_s) == {"server", "models", "load_generator"}
    assert all(level.cpu_s[part] > 0 for part in serve.CPU_PARTS)  # the model process's CPU counted too
    split = serve.cpu_split(level.row())
    assert split["server_cpu_ms"] == pytest.approx(1000 * level.cpu_s["server"] / level.texts)
    assert 0 <= split["models_share"] < 1
    assert bad.cpu_s is None and serve.cpu_split(bad.row()) == {}  # not asked for: nothing made up


def test_the_load_spreads_over_processes_and_counts_them_all(pair: list[Server]) -> None:
    srv = pair[0]
    last = max(os.sched_getaffinity(0))  # the load processes on a CPU of their own (where the machine has some)
    level = load.run_async(load.closed_loop(srv.url, "/v1/classify", ["one text", "another text", "a third"], 5,
                                              1.0, cpu=srv.cpu, processes=2, per_request=3, cpus=[last]))
    row = level.row()
    assert level.errors == 0 and len(level.latencies) > 2 and level.processes == 2
    assert level.load_cpus == (last,) and row["load_cpus"] == [last]
    assert level.texts == 3 * len(level.latencies) and row["throughput"] == pytest.approx(3 * row["requests_per_s"])
    assert level.cpu_s is not None and level.cpu_s["load_generator"] > 0 and level.batch_sum >= level.batch_count >= 1
    assert load._spread(5, 2) == [(0, 3), (3, 2)] and load._spread(2, 4) == [(0, 1), (1, 1)]  # every client once

    # open loop: each process sends its own seeded Poisson arrivals at half the rate, every one of them
    rate, seconds = 30.0, 1.0
    opened = load.run_async(load.open_loop(srv.url, "/v1/classify", ["one text"], rate, seconds, seed=5,
                                             processes=2))
    assert opened.load_cpus == tuple(sorted(os.sched_getaffinity(0)))  # none asked: where this process runs
    scheduled = 0
    for p in range(2):
        rng, at = random.Random(5 + 7919 * p), 0.0
        while at < seconds:
            scheduled += 1
            at += rng.expovariate(rate / 2)
    assert opened.errors == 0 and len(opened.latencies) == scheduled and opened.processes == 2

    # a load process that fails (no texts to send) is reported, not waited for
    with pytest.raises(RuntimeError, match="load process 1 of the load generator exited"):
        load.in_processes([load.Clients(srv.url, "/v1/classify", ["a text"], 2, 0.2, count=1),
                           load.Clients(srv.url, "/v1/classify", [], 2, 0.2, first=1, count=1)])


def test_cpu_seconds_and_children_read_this_machines_processes() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; sum(range(10**7)); time.sleep(30)"])
    try:
        end = time.monotonic() + 20
        while (cpu_seconds(child.pid) or 0) == 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert child.pid in children(os.getpid())
        assert (cpu_seconds(child.pid) or 0) > 0
        before = cpu_seconds(os.getpid(), exited_children=True) or 0
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds(child.pid) is None  # gone: nothing to read
    assert (cpu_seconds(os.getpid(), exited_children=True) or 0) > before  # its CPU now counts as an exited child's


def test_interference_sends_short_requests_while_the_long_text_is_served(tiny_repo: Path, tmp_path: Path) -> None:
    srv = Server(tmp_path, model_repository=tiny_repo, default_model="tiny", max_batch_tokens=64,
                 max_wait_ms=0, log_level="debug").wait_ready()
    try:
        out = asyncio.run(serve.interference(srv.url, ["a short text", "another"], serve.long_text(4000), n_idle=5,
                                             server_log=srv.full_log))
    finally:
        srv.stop()
    assert out["batches_alone"] > 10  # the long text's chunks ran over many batches
    assert out["short_requests"] >= 1 and out["short_max_ms"] >= out["short_p50_ms"] > 0
    assert out["limit_ms"] == pytest.approx(3 * out["idle_p50_ms"] + out["one_batch_ms"])
    assert out["one_batch_is"] == "longest" and out["one_batch_ms"] >= out["mean_batch_ms"] > 0
    assert out["met"] == (out["short_max_ms"] <= out["limit_ms"])


def test_replicas_paired_alternates_a_replicated_server_and_its_offline_limit(tiny_repo: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    texts = ["a short text", "another one", "and a third, longer text than the others"] * 4
    cfg = {"model_repository": tiny_repo, "default_model": "tiny", "max_wait_ms": 1}
    started: list[Server] = []
    offline: list[serve.ReplicasOffline] = []
    fed: list[bool] = []

    def start(settings: dict) -> Server:
        started.append(Server(tmp_path, **settings))
        return started[-1]

    class Watched(serve.ReplicasOffline):  # the offline limit of 2 processes: does each compute in every round?
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            offline.append(self)

        def throughput(self, bs: int, seconds: float) -> float:
            pids = [m.pid for m in self.model.processes]
            before = [cpu_seconds(p) or 0.0 for p in pids]
            out = super().throughput(bs, seconds)
            fed.append(all((cpu_seconds(p) or 0.0) > b for p, b in zip(pids, before, strict=True)))
            return out

    monkeypatch.setattr(serve, "ReplicasOffline", Watched)
    out = serve.replicas_paired(start, cfg, 2, tiny_repo, "tiny", texts, "cpu", 2, 2, 0.3, 2)
    assert fed == [True, True]  # both rounds fed every process
    assert all(m._proc.poll() is not None for m in offline[0].model.processes)  # and it closed them
    assert out["replicas"] == 2 and len(out["served"]) == len(out["offline"]) == 2
    assert min(out["served"] + out["offline"]) > 0
    assert out["ratio"] == pytest.approx(sum(out["served"]) / sum(out["offline"]))
    (srv,) = started
    assert srv.proc.poll() is not None and "computes in 2 processes" in srv.log_path.read_text()
