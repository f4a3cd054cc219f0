"""The engine host: the server's models, their batchers and their backbones' processes, without HTTP, serving the
front processes (``ROUTING_WORKERS`` > 1) over a Unix socket.

Every front tokenizes its requests' texts and sends them here as :class:`~service.serving.remote.wire.Run` messages;
each backbone's one batcher forms its batches from every front's texts (so batches do not shrink as fronts are added),
and its queue limit, the requests' deadlines and the drain hold for the server as a whole. A front whose client
has gone sends :class:`~service.serving.remote.wire.Cancel`, and what is still queued of that request is dropped, as a
client that leaves a one-process server. The backbones compute where the settings say (``ROUTING_MODEL_PROCESS``:
in processes of their own, as in a one-front server).

Started by the supervisor (:mod:`service.serving.supervisor`) as ``python -m service.serving.host SOCKET``, with the
server's settings as JSON on standard input; it writes one line to standard output once the models are loaded
(``ready``) or could not be (``failed: why``), and drains on SIGTERM: it answers every request already accepted,
then exits once every front has gone (or the drain timeout has passed).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import msgspec
import numpy as np

from service.collector import settle
from service.config import Settings
from service.serving.core.errors import APIError
from service.serving.core.keys import model_of
from service.serving.core.lifecycle import Lifecycle
from service.serving.core.results import Answer, Scores
from service.serving.engine.batcher import DeadlineExceeded, Draining, Overloaded
from service.serving.models.loader import default_model_at_start
from service.serving.models.local import LocalEngine
from service.serving.models.registry import Registry
from service.serving.observe.logs import setup_logging
from service.serving.observe.metrics import Metrics, record_frozen
from service.serving.remote import wire

log = logging.getLogger("service.host")


class EngineHost:
    """The models of ``settings`` (served through a :class:`LocalEngine`, no HTTP), answering fronts on ``path``."""

    def __init__(self, settings: Settings, path: Path) -> None:
        self.settings, self.path = settings, path
        self.metrics = Metrics(lambda: self.engine.device_memory(), lambda: self.engine.backbone_processes())
        self.lifecycle = Lifecycle()
        self.registry = Registry(default_model_at_start(settings))
        self.engine = LocalEngine(settings, self.registry, self.metrics, self.lifecycle, announce=self.broadcast)
        self.fronts: dict[wire.Outbox, int] = {}  # each front's connection -> the Models version it serves
        self.version = 0
        self._applied = asyncio.Event()  # set when a front says it serves a version, or goes
        self._controls: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    def models(self) -> wire.Models:
        """What the fronts serve: every backbone group, its heads and their folders, the head each name serves
        from."""
        backbones = []
        registry = self.registry
        for name, group in registry.groups.items():
            engine = group.planner
            folders = {key: str(self.settings.model_repository / model_of(key)) for key in engine.models}
            backbones.append(wire.BackboneInfo(name, folders, {k: group.describe(k) for k in engine.models},
                                               group.device, group.dtype))
        return wire.Models(self.version, backbones, dict(registry.heads), registry.default_model)

    async def broadcast(self) -> None:
        """Tell every front what the host serves now, and wait until each serves it (at most ``drain_timeout_s``: a
        front that does not say so by then is left behind, and logged)."""
        self.version += 1
        version, msg = self.version, self.models()
        for out in list(self.fronts):
            out.put(msg)
        try:
            async with asyncio.timeout(self.settings.drain_timeout_s):
                while not all(v >= version for v in self.fronts.values()):
                    self._applied.clear()
                    await self._applied.wait()
        except TimeoutError:
            log.warning("fronts %s did not apply models version %d in time",
                        [v for v in self.fronts.values() if v < version], version)

    async def serve(self) -> bool:
        """Load the models and answer the fronts until SIGTERM, then drain; False if the models could not load (a
        SIGTERM while they load stops their processes: True, and nothing served)."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the supervisor decides
        await self.engine.start()
        if self.engine.loading_stopped:
            return True
        if self.lifecycle.failed:
            print(f"failed: {self.lifecycle.error}", flush=True)
            return False
        record_frozen(settle())  # what was loaded, out of every garbage collection (see service.collector)
        server = await self.listen()
        print("ready", flush=True)
        async with server:
            await self._stopping.wait()
            log.info("draining: answering what the fronts sent (at most %.0f s)", self.settings.drain_timeout_s)
            self.lifecycle.drain()
            self.registry.flush()  # batches go without waiting to fill
            end = time.monotonic() + self.settings.drain_timeout_s
            while (self.fronts or not self.registry.idle) and time.monotonic() < end:
                await asyncio.sleep(0.02)
            server.close()
        await self.engine.close(timeout_s=1.0)
        self.lifecycle.stop()
        return True

    async def listen(self) -> asyncio.Server:
        """The fronts' socket, served."""
        return await asyncio.get_running_loop().create_unix_server(lambda: FrontConnection(self), path=str(self.path))

    def _stop(self) -> None:
        """SIGTERM: drain once loaded; while loading, stop the backbones' processes loading."""
        self._stopping.set()
        if self.lifecycle.loading:
            self.engine.stop_loading()

    def received(self, front: FrontConnection, msg: wire.ToHost) -> None:
        """A message of a front that said :class:`~service.serving.remote.wire.Hello`."""
        out = front.out
        if isinstance(msg, wire.Run):
            self._run(msg, front)
        elif isinstance(msg, wire.Cancel):
            if (answers := front.running.get(msg.id)) is not None:
                answers.cancel()
        elif isinstance(msg, wire.Applied):
            if out in self.fronts:
                self.fronts[out] = max(self.fronts[out], msg.version)
            self._applied.set()
        elif isinstance(msg, wire.Scrape):
            out.put(wire.Scraped(msg.id, self.metrics.reading()))
        elif isinstance(msg, wire.Control):
            self._controls.add(task := asyncio.create_task(self._control(msg, out)))
            task.add_done_callback(self._controls.discard)

    def joined(self, front: FrontConnection) -> None:
        """A front said hello: it is told what the host serves."""
        self.fronts[front.out] = self.version
        front.out.put(self.models())

    def left(self, front: FrontConnection) -> None:
        """A front has gone: nobody waits for its requests."""
        for answers in list(front.running.values()):
            answers.cancel()
        self.fronts.pop(front.out, None)
        self._applied.set()

    async def _control(self, msg: wire.Control, out: wire.Outbox) -> None:
        """A repository request, carried out by the host's model control (every front serves a change before it is
        answered: see :meth:`broadcast`)."""
        control = self.engine.control
        reply = wire.Controlled(msg.id, 200)
        try:
            if msg.op == "index":
                reply.entries = await control.entries(ready_only=msg.ready_only)
            elif msg.op == "stats":
                reply.stats = self.metrics.stats.json(msg.names)
            elif msg.op == "load":
                await control.load(msg.name)
            else:
                await control.unload(msg.name)
        except APIError as e:
            reply = wire.Controlled(msg.id, e.status, e.message)
        except Exception as e:
            reply = wire.Controlled(msg.id, 500, f"{type(e).__name__}: {e}")
        out.put(reply)

    def _run(self, msg: wire.Run, front: FrontConnection) -> None:
        """A front's request on its backbone's batcher, answered (:meth:`_answer`) with the texts' answers or why
        there are none; no task waits for it."""
        group = self.registry.groups.get(msg.backbone)
        if group is None:
            front.out.put(wire.Refused(msg.id, "failed", f"no backbone {msg.backbone!r} here"))
            return
        default = group.planner.default
        try:
            if msg.plain is not None:  # plain texts as arrays: batched in runs, no object a text
                ids, lengths = msg.plain.arrays()
                keys = [msg.plain.model or default]
            else:
                jobs = [job.text_job() for job in msg.jobs]
                keys = list({ask.model or default for job in jobs for ask in job.asks})
        except ValueError as e:  # a job asking no head, plain texts that do not add up: refused, the front's
            # connection kept
            front.out.put(wire.Refused(msg.id, "failed", str(e)))
            return
        started = time.perf_counter()
        self.registry.hold(keys)  # a retired head answers what it took before it goes
        answers = front.running[msg.id] = (group.submit(jobs, msg.deadline) if msg.plain is None
                                           else group.submit_plain(ids, lengths, msg.plain.model, msg.deadline))
        answers.add_done_callback(functools.partial(self._answer, front, msg.id, keys, started))

    def _answer(self, front: FrontConnection, k: int, keys: list[str], started: float,
                answers: asyncio.Future[list[Answer] | Scores]) -> None:
        """Request ``k`` of ``front`` is settled: its answers (a plain request's scores unread, where they came so) or
        its refusal go back, unless it was cancelled (its client or its front has gone, and nobody waits)."""
        front.running.pop(k, None)
        self.registry.release(keys)
        if answers.cancelled():
            return
        reply: wire.Answered | wire.Refused
        exc = answers.exception()
        if exc is not None:
            reply, ok = wire.Refused(k, *_refusal(exc)), False
        elif type(got := answers.result()) is Scores:
            reply, ok = wire.Answered(k, [], wire.Scored.of(got)), bool(np.isfinite(got.logits).all())
        else:
            got = cast(list[Answer], got)
            reply, ok = wire.Answered(k, got), all(not r.error for answer in got for r in answer)
        # every front's requests in one place (/v2/models/stats); their time here: queued and computed
        self.metrics.stats.answered(sorted({model_of(key) for key in keys}), time.perf_counter() - started, ok=ok)
        front.out.put(reply)


class FrontConnection(asyncio.Protocol):
    """One front's connection to the host: its messages handled as they arrive (each request on its batcher, no
    task a request), until it closes; the first must be :class:`~service.serving.remote.wire.Hello`."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.frames = wire.Frames(wire.TO_HOST)
        self.running: dict[int, asyncio.Future[list[Answer]] | asyncio.Future[list[Answer] | Scores]] = {}
        # request id -> its answers, not yet settled
        self.front: int | None = None  # which front, once it said hello

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream's (uvloop's are not asyncio's subclasses)
        self.out = wire.Outbox(self.transport)  # what this front is answered in one turn of the loop goes in one write

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.frames.feed(data)
        except msgspec.DecodeError:
            log.exception("front %s sent what is not a message: its connection is closed", self.front)
            self.transport.close()
            return
        for msg in messages:
            if self.front is None:
                if not isinstance(msg, wire.Hello):
                    self.transport.close()
                    return
                self.front = msg.front
                self.host.joined(self)
            else:
                self.host.received(self, msg)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.front is not None:
            self.host.left(self)
            log.info("front %d disconnected", self.front)


def _refusal(exc: BaseException) -> tuple[wire.Refusal, str]:
    """Why a request got no answers, as the front reads it."""
    if isinstance(exc, Overloaded):
        return "overloaded", str(exc)
    if isinstance(exc, Draining):
        return "draining", str(exc)
    if isinstance(exc, DeadlineExceeded):
        return "deadline", str(exc)
    return "failed", f"{type(exc).__name__}: {exc}"  # the batch failed: the front answers 500 with why


def main(path: Path) -> int:
    settings = Settings.model_validate_json(sys.stdin.read())
    setup_logging(settings)
    host = EngineHost(settings, path)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        ok = runner.run(host.serve())
    return 0 if ok else 1


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (as uvicorn chooses for the fronts), else asyncio's: every request
    of every front passes through this process's loop. With the tiny test model, two fronts and 64 clients on the
    2-core CPU, the host's CPU a request was 0.118, 0.103 and 0.093 ms against 0.128, 0.110 and 0.117 with asyncio's
    loop, three runs of each in turns."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
