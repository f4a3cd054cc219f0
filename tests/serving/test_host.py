"""The engine host's side of the wire, in this process: a change of models returns once every front connected says
it serves it (a front that leaves is not waited for); a repository request is answered with the host's own
status."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from service.config import Settings
from service.serving.host import EngineHost, _loop_factory
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
    server = await asyncio.start_unix_server(host.front, path=str(path))
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


def test_the_host_runs_on_uvloop_where_it_is_installed_else_on_asyncios_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every front's requests pass through the host's event loop: uvloop's where installed (less CPU a request), as
    uvicorn chooses for the fronts; asyncio's otherwise (the host still starts)."""
    uvloop = pytest.importorskip("uvloop")  # installed with uvicorn[standard], the service's dependency
    assert _loop_factory() is uvloop.new_event_loop
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: importing it fails
    assert _loop_factory() is None
