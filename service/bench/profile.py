"""`routing-service bench profile`: where the served model's CPU goes, by part of the serving path.

The sampling profiler py-spy (the ``bench`` extra) starts the service as its child, so that it may read the
process without privileges, and samples the server's process and the backbone's process (``--subprocesses``;
threads py-spy finds idle are left out) while a closed loop of clients sends one text per request (or
``--per-request`` texts).
A sample belongs to the part of its deepest frame that matches one of :data:`PARTS` (a tokenizer call inside
a route counts as tokenizing, not as the route); samples of the server's start (imports, loading the model)
are left out. A part's cost is its share of its process's samples, and its time per text served (samples /
rate / texts answered, warm-up included): the time of the process's Python threads, which in the backbone's
process is its main thread (torch's OpenMP threads beside it are not sampled). The profiler takes CPU of
its own on the same cores: the throughput under it is printed beside the shares, which compare parts, not
servers. The pipe and its pickling are also measured directly (:func:`pipe_cost`): py-spy's idle test misses
some of the time a thread waits in the pipe, which the sampled share then counts.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.bench.load import closed_loop, run_async
from service.bench.report import echo, median_ms, table, write_json
from service.bench.server import LocalServer, children
from service.config import CPU_BATCH
from service.serving.core.work import RunBatch
from service.serving.engine.pipe import Computed
from service.serving.engine.process import _computed_part
from service.training.data import sample_test_texts

if TYPE_CHECKING:
    from service.serving.engine.engine import Engine

STARTUP = ("_find_and_load", "Engine.load", "lifespan", "load_backbone", "_load_head", "tune_garbage_collector")
"""Frames of the server's start: a sample with one of them on its stack is left out."""

PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tokenize", ("service/modeling/tokenizer.py", "tokenizers/")),
    ("pipe and pickling", ("multiprocessing/connection.py", "pickle", "copyreg.py")),
    ("request parsing", ("model_validate_json", "request_body_to_args", "service/serving/api/schemas.py")),
    ("response building", ("service/serving/pipeline/render.py", "service/serving/api/responses.py",
                           "service/modeling/views.py", "serialize_response", "serialize_json",
                           "starlette/responses.py")),
    ("model compute", ("service/serving/engine/engine.py", "service/serving/engine/gather.py",
                       "service/serving/engine/readout.py", "torch/", "transformers/", "service/modeling/backbone.py",
                       "service/modeling/head.py", "service/modeling/classifier.py", "service/routing/")),
    ("batcher", ("service/serving/engine/batcher.py",)),
    ("inference layer", ("service/serving/pipeline/inference.py", "service/serving/engine/planner.py",
                         "service/serving/engine/group.py", "service/serving/models/registry.py",
                         "service/serving/api/routes/")),
    ("middleware and metrics", ("service/serving/api/middleware.py", "service/serving/observe/metrics.py",
                                "prometheus_client/", "logging/")),
    ("HTTP stack", ("uvicorn/", "starlette/", "fastapi/", "service/serving/api/http11.py", "h11/")),
    ("event loop and threads", ("asyncio/", "uvloop/", "concurrent/futures/", "threading.py")),
)
"""Each part of the serving path and the frames (substrings of py-spy's ``function (file:line)``) that are it."""

OTHER = "other"
SERVER, MODEL = "server's process", "backbone's process"


def part_of(frames: list[str]) -> str | None:
    """The part a sample belongs to: that of its deepest frame matching :data:`PARTS` (:data:`OTHER` if none);
    None for a sample of the server's start."""
    if any(s in f for f in frames for s in STARTUP):
        return None
    for f in reversed(frames):
        for name, marks in PARTS:
            if any(m in f for m in marks):
                return name
    return OTHER


def split(lines: Iterable[str]) -> tuple[dict[str, collections.Counter[str]], dict[str, collections.Counter[str]]]:
    """Samples per process (:data:`SERVER`, :data:`MODEL`) and part, and the :data:`OTHER` samples per process and
    deepest frame, from py-spy's raw (collapsed) output with ``--subprocesses``: ``process <pid>:"<command>";
    frame;...;frame <count>`` per line, a child's process frame under its parent's."""
    out: dict[str, collections.Counter[str]] = {SERVER: collections.Counter(), MODEL: collections.Counter()}
    other: dict[str, collections.Counter[str]] = {SERVER: collections.Counter(), MODEL: collections.Counter()}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        processes = [f for f in frames if f.startswith("process ")]
        if not processes:
            continue
        code = [f for f in frames if not f.startswith("process ")]
        part = part_of(code)
        if part is None:
            continue
        proc = MODEL if "service.serving.engine.process" in processes[-1] else SERVER
        out[proc][part] += int(count)
        if part == OTHER:
            other[proc][code[-1] if code else "(no Python frame)"] += int(count)
    return out, other


def _stop(server: LocalServer) -> None:
    """Stop the service under py-spy (its child) with SIGTERM, so that it drains, and wait for py-spy to write."""
    for pid in children(server.proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    server.proc.wait(120)


def py_spy() -> str | None:
    """The py-spy program: on the PATH, or beside this Python (a virtual environment not activated)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def profile_level(spy_path: str, concurrency: int, seconds: float, rate: int, texts: list[str], log_dir: Path,
                  per_request: int = 1) -> dict[str, Any]:
    """One server profiled under ``concurrency`` clients, each sending ``per_request`` texts a request, for
    ``seconds`` (after 5 s of warm-up)."""
    raw = log_dir / f"profile-c{concurrency}.txt"
    spy = [spy_path, "record", "--subprocesses", "--nonblocking", "--rate", str(rate), "--format", "raw",
           "--output", str(raw), "--"]
    server = LocalServer(log_dir, wrap=spy)
    try:
        server.wait_ready()
        warm = run_async(closed_loop(server.url, "/v1/classify", texts, concurrency, 5.0, per_request=per_request))
        level = run_async(closed_loop(server.url, "/v1/classify", texts, concurrency, seconds,
                                      per_request=per_request))
    finally:
        _stop(server)
    if not raw.exists():
        raise RuntimeError(f"py-spy wrote no profile:\n{server.log()}")
    samples, other = split(raw.read_text().splitlines())
    served = warm.texts + level.texts
    parts = {proc: {name: {"samples": n, "share": n / max(1, sum(c.values())),
                           "ms_per_text": 1000 * n / rate / max(1, served)}
                    for name, n in c.most_common()}
             for proc, c in samples.items()}
    return {"concurrency": concurrency, "texts_per_request": per_request, "texts_per_s": level.texts / level.seconds,
            "mean_batch": level.batch_sum / max(1, level.batch_count), "texts_served": served, "parts": parts,
            "other_frames": {proc: dict(c.most_common(10)) for proc, c in other.items()}}


def _reply(conn: Connection, answer: bytes) -> None:
    """A stand-in for the backbone's process: answer every message with ``answer`` until the pipe closes."""
    with contextlib.suppress(EOFError):
        while True:
            conn.recv_bytes()
            conn.send_bytes(answer)


def _batch_pipe_cost(engine: Engine, size: int, texts: list[str], repeats: int) -> dict[str, float]:
    """:func:`pipe_cost` for one batch of ``size`` texts."""
    from service.serving.core.work import Task

    # a batch computes its texts' jobs once: every run gets them planned anew (the first plan is the message sent)
    plans = [[w for plan in engine.plan([Task(t) for t in texts[:size]]) for w in plan] for _ in range(7)]
    request = RunBatch(_computed_part(plans.pop()), [])  # as the server sends it
    request_bytes = bytes(ForkingPickler.dumps(request))  # before compute, as the server sends it
    answer = Computed(engine.run_chunks(plans.pop()), engine.device_memory(), 0)  # also the warm-up at this shape
    answer_bytes = bytes(ForkingPickler.dumps(answer))
    compute_ms = median_ms(lambda: engine.run_chunks(plans.pop()), len(plans))
    pickling_ms = (median_ms(lambda: ForkingPickler.dumps(request), repeats)
                   + median_ms(lambda: ForkingPickler.loads(request_bytes), repeats)
                   + median_ms(lambda: ForkingPickler.dumps(answer), repeats)
                   + median_ms(lambda: ForkingPickler.loads(answer_bytes), repeats))
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    child = spawn.Process(target=_reply, args=(theirs, answer_bytes), daemon=True)
    child.start()

    def round_trip() -> None:
        ours.send_bytes(request_bytes)
        ours.recv_bytes()

    try:
        round_trip()  # the child has started
        pipe_ms = median_ms(round_trip, repeats)
    finally:
        ours.close()
        child.join(10)
    return {"batch_size": size, "request_bytes": len(request_bytes), "answer_bytes": len(answer_bytes),
            "pickling_ms": pickling_ms, "pipe_round_trip_ms": pipe_ms, "compute_ms": compute_ms,
            "ms_per_text": (pickling_ms + pipe_ms) / size, "share_of_compute": (pickling_ms + pipe_ms) / compute_ms}


def pipe_cost(folder: Path, sizes: list[int], texts: list[str], repeats: int = 200) -> list[dict[str, float]]:
    """The pipe and its pickling per batch, measured directly (a sampling profiler also counts some of the time a
    thread waits in the pipe): the messages of a batch of each of ``sizes`` test texts as the server and the
    backbone's process exchange them (the planned chunks before compute, the answers after), each pickled and
    unpickled; and their bytes sent through a pipe to a process that answers with the answers' bytes (the pipe and
    the two wake-ups); against the batch's compute in this process (the engine alone, the model of ``folder``).
    Medians of ``repeats``."""
    from service.serving.engine.engine import Engine

    engine = Engine.load(folder)
    try:
        return [_batch_pipe_cost(engine, size, texts, repeats) for size in sizes]
    finally:
        engine.close()


def run(spy_path: str, levels: list[int], seconds: float, rate: int, repository: Path, out: Path,
        per_request: int = 1) -> None:
    texts = sample_test_texts("tweet-sentiment", 1000)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        for c in levels:
            echo(f"profiling a server at concurrency {c}, {per_request} text(s) a request, for {seconds:g} s ...",
                 err=True)
            results.append(profile_level(spy_path, c, seconds, rate, texts, Path(tmp), per_request))
    sizes = sorted({min(c * per_request, CPU_BATCH[0]) for c in levels})  # the server's batches
    echo(f"the pipe and its pickling, batches of {sizes} texts ...", err=True)
    pipe = pipe_cost(repository / "tweet-sentiment", sizes, texts)
    for r in results:
        echo(f"\nconcurrency {r['concurrency']} x {per_request} text(s): {r['texts_per_s']:.1f} texts/s under the "
             f"profiler, mean batch {r['mean_batch']:.1f}")
        for proc, parts in r["parts"].items():
            rows = [{"part": name, "share": f"{p['share']:.1%}", "ms / text": p["ms_per_text"]}
                    for name, p in parts.items()]
            echo(f"{proc}: {sum(p['ms_per_text'] for p in parts.values()):.2f} ms of its Python threads' "
                 "time per text")
            echo(table(rows, ["part", "share", "ms / text"]))
    echo("\nthe pipe and its pickling per batch, measured directly (medians)")
    echo(table(pipe, ["batch_size", "request_bytes", "answer_bytes", "pickling_ms", "pipe_round_trip_ms",
                      "compute_ms", "ms_per_text", "share_of_compute"]))
    summary: dict[str, Any] = {str(r["concurrency"]): {proc: {k: round(v["share"], 4) for k, v in parts.items()}
                                                        for proc, parts in r["parts"].items()} for r in results}
    summary["pipe_share_of_compute"] = {str(p["batch_size"]): round(p["share_of_compute"], 4) for p in pipe}
    path = write_json(out, "profile", {"levels": levels, "texts_per_request": per_request, "seconds": seconds,
                                       "rate_hz": rate, "command": " ".join(sys.argv)},
                      {"levels": results, "pipe": pipe}, summary)
    echo(f"\nwrote {path}", err=True)
