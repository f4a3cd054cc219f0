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
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from service.collector import settle
from service.config import Settings
from service.serving.core.errors import APIError
from service.serving.core.keys import model_of
from service.serving.core.lifecycle import Lifecycle
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
        self._applied = asyncio.Condition()
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
            async with asyncio.timeout(self.settings.drain_timeout_s), self._applied:
                await self._applied.wait_for(lambda: all(v >= version for v in self.fronts.values()))
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
        server = await asyncio.start_unix_server(self.front, path=str(self.path))
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

    def _stop(self) -> None:
        """SIGTERM: drain once loaded; while loading, stop the backbones' processes loading."""
        self._stopping.set()
        if self.lifecycle.loading:
            self.engine.stop_loading()

    async def front(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One front's connection: its requests, each answered on its own task, until it closes."""
        hello = await wire.read_to_host(reader)
        if not isinstance(hello, wire.Hello):
            writer.close()
            return
        out = wire.Outbox(writer)  # what this front is answered in one turn of the loop goes in one write
        self.fronts[out] = self.version
        out.put(self.models())
        running: dict[int, asyncio.Task[None]] = {}
        try:
            while (msg := await wire.read_to_host(reader)) is not None:
                if isinstance(msg, wire.Run):
                    task = asyncio.create_task(self._run(msg, out))
                    running[msg.id] = task
                    task.add_done_callback(lambda _, k=msg.id: running.pop(k, None))
                elif isinstance(msg, wire.Cancel) and msg.id in running:
                    running[msg.id].cancel()
                elif isinstance(msg, wire.Applied):
                    async with self._applied:
                        self.fronts[out] = max(self.fronts.get(out, 0), msg.version)
                        self._applied.notify_all()
                elif isinstance(msg, wire.Scrape):
                    out.put(wire.Scraped(msg.id, self.metrics.reading()))
                elif isinstance(msg, wire.Control):
                    self._controls.add(task := asyncio.create_task(self._control(msg, out)))
                    task.add_done_callback(self._controls.discard)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:  # the front has gone: nobody waits for its requests
            for task in list(running.values()):
                task.cancel()
            async with self._applied:
                self.fronts.pop(out, None)
                self._applied.notify_all()
            writer.close()
            log.info("front %d disconnected", hello.front)

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

    async def _run(self, msg: wire.Run, out: wire.Outbox) -> None:
        """A front's request on its backbone's batcher, answered with the texts' answers or why there are none."""
        group = self.registry.groups.get(msg.backbone)
        reply: wire.Answered | wire.Refused
        if group is None:
            reply = wire.Refused(msg.id, "failed", f"no backbone {msg.backbone!r} here")
        else:
            jobs = [job.text_job() for job in msg.jobs]
            keys = list({ask.model or group.planner.default for job in jobs for ask in job.asks})
            started = time.perf_counter()
            try:
                with self.registry.holding(keys):  # a retired head answers what it took before it goes
                    reply = wire.Answered(msg.id, await group.submit(jobs, msg.deadline))
            except Overloaded as e:
                reply = wire.Refused(msg.id, "overloaded", str(e))
            except Draining as e:
                reply = wire.Refused(msg.id, "draining", str(e))
            except DeadlineExceeded as e:
                reply = wire.Refused(msg.id, "deadline", str(e))
            except Exception as e:  # the batch failed: the front answers 500 with why
                reply = wire.Refused(msg.id, "failed", f"{type(e).__name__}: {e}")
            # every front's requests in one place (/v2/models/stats); their time here: queued and computed
            self.metrics.stats.answered(sorted({model_of(k) for k in keys}), time.perf_counter() - started,
                                        ok=isinstance(reply, wire.Answered) and all(
                                            not r.error for answer in reply.answers for r in answer))
        out.put(reply)


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
