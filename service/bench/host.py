"""The engine host's own CPU a request (``routing-service bench host``): every front's requests pass through its one
event loop, so its CPU a request caps a server of several fronts (one core: about 5,000 requests/s at 0.2 ms).

The host of a version (this one, or a ``--baseline`` checkout's) runs in a process of its own with a stand-in
backbone (a batch sleeps ``batch_ms``, answering each text one fixed result), its metrics in multiprocess mode and
its loaded objects frozen out of the collector, as served; one stand-in front, a process of this version, keeps
``concurrency`` requests of ``texts_per_request`` texts in flight on the host's socket, each answer followed by the
next request. The versions are measured in turns, each round a fresh pair of processes; the host's CPU (``/proc``)
and the requests answered are counted over ``seconds`` after a warm-up of 2,000 answers (500 of several texts).

With ``backbone_process``, the stand-in backbone computes as served: in a process of its own (a stand-in for the
backbone's process, which takes plain batches as arrays and answers scores), reached by the version's own
:class:`~service.serving.engine.process.BackboneProcess` over its pipe, on the bundled model's manifest (its labels);
the stand-in process's CPU is not the host's."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from service.bench import report
from service.bench.server import cpu_seconds

HOST = """
import asyncio, sys, time
from pathlib import Path
from types import SimpleNamespace

path, batch_ms, model = sys.argv[1], float(sys.argv[2]), sys.argv[3]
from service.collector import settle
from service.config import Settings
from service.serving.core.results import Result
from service.serving.engine.batcher import Batcher, BatchLimits
from service.serving.engine.group import LocalGroup
from service.serving.host import EngineHost, _loop_factory
from service.serving.observe.metrics import BatchMetrics

answer = Result(label="positive", scores={"negative": 0.1, "neutral": 0.2, "positive": 0.7}, logits=[0.1, 0.2, 0.3])

def run_chunks(works):
    time.sleep(batch_ms / 1000)
    return [[answer] for _ in works]

async def main():
    host = EngineHost(Settings(model_repository=Path(path).parent, default_model="none"), Path(path))
    if model:  # the version's own pipe to a stand-in of the backbone's process (both start `python -m <__name__> FD`)
        from service.serving.engine import process
        process.__name__ = "standin_backbone"
        compute = process.BackboneProcess(Path(model), device="cpu", warmup=False, keys=["m@1"],
                                          chunker=SimpleNamespace(), launches=None)
        compute.name = "b"
        if hasattr(compute, "attach"):
            await compute.attach()
        runners = compute.runners
    else:
        compute = SimpleNamespace(default="m@1", name="b", models=[], device="cpu", dtype="float32", takes_runs=False)
        runners = run_chunks
    batcher = Batcher(runners, BatchLimits(512, 16384, 0.002, 100000), BatchMetrics(host.metrics, "b", ["cpu"]))
    host.registry.groups["b"] = LocalGroup(compute, batcher)
    batcher.start()
    if hasattr(host, "listen"):
        server = await host.listen()
    else:  # a version whose host serves a stream per front
        server = await asyncio.start_unix_server(host.front, path=path)
    settle()
    print("ready", flush=True)
    async with server:
        await asyncio.Event().wait()

factory = _loop_factory()
with asyncio.Runner(loop_factory=factory) as runner:
    runner.run(main())
"""

STANDIN = """
import os, sys, time
from multiprocessing.connection import Connection

import numpy as np

from service.serving.core.results import Result
from service.serving.engine.pipe import Computed, ComputedPlain, Loaded, RunPlain

conn = Connection(int(sys.argv[1]))
seconds = float(os.environ["STANDIN_BATCH_MS"]) / 1000
load = conn.recv()
conn.send(Loaded({key: {} for key in load.keys}, "cpu", "float32", [], plain=True))
answer = Result(label="positive", scores={"negative": 0.1, "neutral": 0.2, "positive": 0.7}, logits=[0.1, 0.2, 0.3])
while True:
    try:
        msg = conn.recv()
        if msg is None:
            break
        time.sleep(seconds)
        phases = {"encode": seconds / 2, "heads": seconds / 2, "host": 0.0}
        if isinstance(msg, RunPlain):
            conn.send(ComputedPlain(np.zeros((len(msg.lengths), 3), np.float32), phases, [], 0))
        else:
            conn.send(Computed([[answer for _ in w.job.asks] for w in msg.works], [], 0))
    except (EOFError, OSError):  # the host went away (its pipe closed, perhaps with a batch unread or unanswered)
        break
"""


def _front(path: str, concurrency: int, seconds: float, host_pid: int, out: Any, texts_per_request: int = 1,
           plain: bool = False) -> None:
    """The stand-in front: ``concurrency`` requests in flight; puts (answers, host CPU seconds, wall seconds).
    ``plain``: the host's wire takes plain texts as such (:class:`~service.serving.remote.wire.Plain`)."""
    from service.modeling.encoding import Encoding
    from service.serving.core.work import Ask, TextJob
    from service.serving.remote import wire

    async def go() -> None:
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 24)
        writer.write(wire.frame(wire.Hello(0)))
        frames = wire.Frames(msgspec.msgpack.Decoder(wire.ToFront))
        arrived: list[object] = []

        async def read() -> object:
            while not arrived:
                data = await reader.read(1 << 16)
                if not data:
                    raise ConnectionError("the host closed the connection")
                arrived.extend(frames.feed(data))
            return arrived.pop(0)

        await read()  # what the host serves
        ids = (101, *range(2000, 2012), 102)
        jobs = [TextJob.of(Encoding.of_chunks((ids,)), [Ask("m@1")])] * texts_per_request
        sent = 0

        def run() -> bytes:  # as the version's fronts send it: plain texts as such where its wire has them
            nonlocal sent
            sent += 1
            deadline = time.monotonic() + 60
            if plain:
                return wire.frame(wire.Run.of(sent, "b", jobs, deadline))
            return wire.frame(wire.Run(sent, "b", [wire.Job((ids,), (Ask("m@1"),))] * texts_per_request, deadline))

        writer.write(b"".join(run() for _ in range(concurrency)))
        answered, start, cpu0, n0 = 0, 0.0, 0.0, 0
        while True:
            await read()
            answered += 1
            if answered == (2000 if texts_per_request == 1 else 500):  # warmed up
                start, cpu0, n0 = time.perf_counter(), cpu_seconds(host_pid) or 0.0, answered
            elif start and time.perf_counter() - start >= seconds:
                out.put((answered - n0, (cpu_seconds(host_pid) or 0.0) - cpu0, time.perf_counter() - start))
                return
            writer.write(run())

    asyncio.run(go())


def measure(tree: Path, concurrency: int, seconds: float, batch_ms: float, texts_per_request: int = 1,
            backbone_process: bool = False) -> dict[str, float]:
    """One round of the host of the checkout at ``tree``: requests a second, and its CPU microseconds a request and
    a text."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "host.sock")
        env_dir = Path(tmp) / "metrics"
        env_dir.mkdir()
        (Path(tmp) / "standin_backbone.py").write_text(STANDIN)
        model = str(tree / "models" / "tweet-sentiment") if backbone_process else ""
        host = subprocess.Popen([sys.executable, "-c", HOST, path, str(batch_ms), model], cwd=tree,
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(env_dir),
                                     "PYTHONPATH": os.pathsep.join([str(tree), tmp]),
                                     "STANDIN_BATCH_MS": str(batch_ms)})
        try:
            if host.stdout is None or host.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the host of {tree} did not start (code {host.poll()})")
            context = multiprocessing.get_context("fork")
            out = context.Queue()
            plain = "class Plain(" in (tree / "service" / "serving" / "remote" / "wire.py").read_text()
            front = context.Process(target=_front, args=(path, concurrency, seconds, host.pid, out,
                                                                texts_per_request, plain))
            front.start()
            n, cpu, wall = out.get(timeout=seconds + 120)
            front.join(10)
        finally:
            host.kill()
            host.wait()
    return {"requests_per_s": n / wall, "host_us_per_request": 1e6 * cpu / n,
            "host_us_per_text": 1e6 * cpu / (n * texts_per_request), "requests": n}


def run(root: Path, baseline: Path | None, concurrencies: list[int], seconds: float, rounds: int, batch_ms: float,
        out: Path, texts_per_request: int = 1, backbone_process: bool = False) -> dict[str, Any]:
    """Every version at every concurrency, ``rounds`` turns (each version first in every other round); prints a
    table, writes the JSON."""
    versions = {"this": root, **({"baseline": baseline} if baseline is not None else {})}
    results: dict[str, dict[str, list[dict[str, float]]]] = {str(c): {v: [] for v in versions}
                                                             for c in concurrencies}
    for c in concurrencies:
        for r in range(rounds):
            for name in report.in_turns(list(versions), r):
                row = measure(versions[name], c, seconds, batch_ms, texts_per_request, backbone_process)
                results[str(c)][name].append(row)
                report.echo(f"bench host: c={c} round {r + 1} {name}: {row['requests_per_s']:.0f} requests/s, "
                            f"{row['host_us_per_request']:.1f} us of host CPU a request "
                            f"({row['host_us_per_text']:.1f} a text)", err=True)
    summary: dict[str, Any] = {}
    for c, by in results.items():
        mean = {v: sum(r["host_us_per_request"] for r in rows) / len(rows) for v, rows in by.items()}
        summary[f"c{c}"] = {"host_us_per_request": mean,
                            "host_us_per_text": {v: u / texts_per_request for v, u in mean.items()}}
        if "baseline" in mean:  # the means' ratio, and each round's (the versions side by side in it)
            rounds_ratio = report.round_ratios(by["this"], by["baseline"], "host_us_per_request")
            summary[f"c{c}"].update(this_over_baseline=mean["this"] / mean["baseline"],
                                    this_over_baseline_rounds=rounds_ratio,
                                    this_over_baseline_median_round=statistics.median(rounds_ratio))
    settings = {"baseline": str(baseline) if baseline else None, "concurrency": concurrencies, "seconds": seconds,
                "rounds": rounds, "batch_ms": batch_ms, "texts_per_request": texts_per_request,
                "backbone_process": backbone_process}
    rows = [{"level": c, **{f"{v} us": u for v, u in s["host_us_per_request"].items()},
             "this/baseline": s.get("this_over_baseline", "")} for c, s in summary.items()]
    report.echo(report.table(rows, ["level", *(f"{v} us" for v in versions), "this/baseline"]))
    path = report.write_json(out, "host", settings, results, summary)
    report.echo(f"wrote {path}")
    return {"settings": settings, "results": results, "summary": summary}
