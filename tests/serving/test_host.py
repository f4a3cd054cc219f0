"""The engine host's side of the wire, in this process: a change of models returns once every front connected says
it serves it (a front that leaves is not waited for); a repository request is answered with the host's own
status."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from service.config import Settings
from service.serving.core.results import Answer, Result
from service.serving.core.work import Ask, ChunkWork
from service.serving.engine.batcher import Batcher, BatchLimits
from service.serving.engine.group import LocalGroup
from service.serving.host import EngineHost, _loop_factory
from service.serving.observe.observer import NullObserver
from service.serving.remote import wire
from service.serving.remote.wire import Applied, Control, Controlled, Hello, Models, frame, read_to_front


async def _connect(path: Path, front: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Models]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(frame(Hello(front)))
    models = await read_to_front(reader)
    assert isinstance(models, Models)
    return reader, writer, models


async def test_a_change_of_models_returns_once_every_front_serves_it(tmp_path: Path) -> None:
    path = tmp_path / "host.sock"
    host = EngineHost(Settings(model_repository=tmp_path, default_model="none"), path)
    server = await host.listen()
    async with server:
        (r1, w1, first), (r2, w2, _) = await _connect(path, 1), await _connect(path, 2)
        assert first.version == 0 and first.served == {} and first.backbones == []
        change = asyncio.create_task(host.broadcast())
        seen = [await read_to_front(r) for r in (r1, r2)]
        assert [m.version for m in seen if isinstance(m, Models)] == [1, 1]
        w1.write(frame(Applied(1)))
        await asyncio.sleep(0.3)
        assert not change.done()  # front 2 has not said it serves version 1
        w2.write(frame(Applied(1)))
        await asyncio.wait_for(change, 5)
        change = asyncio.create_task(host.broadcast())
        for r in (r1, r2):
            await read_to_front(r)
        w1.write(frame(Applied(2)))
        w2.close()  # a front that leaves is not waited for
        await asyncio.wait_for(change, 5)
        w1.write(frame(Control(7, "load", "no-such-model")))
        answer = await read_to_front(r1)
        assert isinstance(answer, Controlled) and answer.id == 7 and answer.status == 404
        assert "no model folder 'no-such-model'" in answer.message
        w1.close()


class Drops(NullObserver[ChunkWork, Answer | None]):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def on_drop(self, reason: str, payloads: Sequence[ChunkWork]) -> None:
        self.reasons += [reason] * len(payloads)


async def test_requests_are_answered_refused_at_their_deadline_and_dropped_when_cancelled_or_their_front_goes(
        tmp_path: Path) -> None:
    """The host takes a front's requests with no task each: an answer goes back when the batch computes it, a refusal
    as soon as the deadline passes (the text is dropped from the queue as late), and a cancelled request, or one
    whose front has gone, gets no answer and is dropped from the queue before compute."""
    path = tmp_path / "host.sock"
    host = EngineHost(Settings(model_repository=tmp_path, default_model="none"), path)
    computing, release, computed = threading.Event(), threading.Event(), []

    def run_chunks(works: list[ChunkWork]) -> list[Answer | None]:
        computing.set()
        release.wait(10)
        computed.extend(w.ids for w in works)
        return [[Result(label=f"text {w.ids[0]}", scores={})] for w in works]

    drops = Drops()
    compute: Any = SimpleNamespace(default="m@1", name="b", models=[], device="cpu", dtype="float32")
    host.registry.groups["b"] = LocalGroup(compute, Batcher(run_chunks, BatchLimits(8, 1000, 0.001, 100), drops))
    host.registry.groups["b"].batcher.start()

    def run(k: int, seconds: float) -> bytes:
        return frame(wire.Run(k, "b", [wire.Job(((k, 100),), (Ask("m@1"),))], time.monotonic() + seconds))

    server = await host.listen()
    async with server:
        (r1, w1, _), (_, w2, _) = await _connect(path, 1), await _connect(path, 2)
        w1.write(run(1, 10))
        await asyncio.to_thread(computing.wait, 5)  # request 1 computes; the rest queue behind it
        w1.write(run(2, 0.2) + run(3, 10) + frame(wire.Cancel(3)))
        w2.write(run(4, 10))
        await asyncio.sleep(0.05)
        w2.close()  # front 2 goes, its request with it
        late = await asyncio.wait_for(read_to_front(r1), 5)
        assert isinstance(late, wire.Refused) and (late.id, late.kind) == (2, "deadline")
        assert "deadline passed" in late.message and not computed  # refused at its deadline, not after the batch
        release.set()
        answered = await asyncio.wait_for(read_to_front(r1), 5)
        assert isinstance(answered, wire.Answered) and answered.id == 1
        assert [[r.label for r in a] for a in answered.answers] == [["text 1"]]
        w1.write(run(5, 10))  # the next batch drops what nobody waits for, and computes request 5 alone
        answered = await asyncio.wait_for(read_to_front(r1), 5)
        assert isinstance(answered, wire.Answered) and answered.id == 5
        assert computed == [(1, 100), (5, 100)]
        w1.write(frame(wire.Run(6, "b", [wire.Job(((6, 100),), ())], time.monotonic() + 10)) + run(7, 10))
        refused = await asyncio.wait_for(read_to_front(r1), 5)  # a job that asks no head: refused alone
        assert isinstance(refused, wire.Refused) and (refused.id, refused.kind) == (6, "failed")
        assert "at least one head" in refused.message
        answered = await asyncio.wait_for(read_to_front(r1), 5)
        assert isinstance(answered, wire.Answered) and answered.id == 7 and computed[2:] == [(7, 100)]
        assert sorted(drops.reasons) == ["deadline", "disconnected", "disconnected"]
        assert not host.registry._using  # every request released the heads it held
        w1.close()
    await host.registry.groups["b"].batcher.stop(1)


def test_the_host_runs_on_uvloop_where_it_is_installed_else_on_asyncios_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every front's requests pass through the host's event loop: uvloop's where installed (less CPU a request), as
    uvicorn chooses for the fronts; asyncio's otherwise (the host still starts)."""
    uvloop = pytest.importorskip("uvloop")  # installed with uvicorn[standard], the service's dependency
    assert _loop_factory() is uvloop.new_event_loop
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: importing it fails
    assert _loop_factory() is None
