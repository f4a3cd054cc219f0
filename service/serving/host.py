"""The engine host: the server's models, their batchers and their backbones' processes, without HTTP, serving the
front processes (``ROUTING_WORKERS`` > 1) over a Unix socket.

Every front tokenizes its requests' texts and sends them here as :class:`~service.serving.wire.Run` messages; each
backbone's one batcher forms its batches from every front's texts (so batches do not shrink as fronts are added),
and its queue limit, the requests' deadlines and the drain hold for the server as a whole. A front whose client
has gone sends :class:`~service.serving.wire.Cancel`, and what is still queued of that request is dropped, as a
client that leaves a one-process server. The backbones compute where the settings say (``ROUTING_MODEL_PROCESS``:
in processes of their own, as in a one-front server).

Started by the supervisor (:mod:`service.serving.fronts`) as ``python -m service.serving.host SOCKET``, with the
server's settings as JSON on standard input; it writes one line to standard output once the models are loaded
(``ready``) or could not be (``failed: why``), and drains on SIGTERM: it answers every request already accepted,
then exits once every front has gone (or the drain timeout has passed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from pathlib import Path

from service.config import Settings
from service.serving.batcher import DeadlineExceeded, Draining, Overloaded
from service.serving.contract import TextJob, answers_of
from service.serving.logs import setup_logging
from service.serving.metrics import Metrics
from service.serving.planner import model_of
from service.serving.state import AppState
from service.serving.wire import (
    Answered,
    BackboneInfo,
    Cancel,
    Hello,
    Models,
    Refused,
    Run,
    frame,
    read_to_host,
)

log = logging.getLogger("service.host")


class EngineHost:
    """The models of ``settings`` (an :class:`AppState` that serves no HTTP), answering fronts on ``path``."""

    def __init__(self, settings: Settings, path: Path) -> None:
        self.settings, self.path = settings, path
        metrics = Metrics(lambda: self.state.device_memory(), lambda: self.state.backbone_processes())
        self.state = AppState(settings=settings, metrics=metrics)
        self.fronts: set[asyncio.StreamWriter] = set()
        self._stopping = asyncio.Event()

    def models(self) -> Models:
        """What the fronts serve: every backbone group, its heads and their folders."""
        backbones = []
        for name, backbone in self.state.inference.backbones.items():
            engine = backbone.engine
            folders = {key: str(self.settings.model_repository / model_of(key)) for key in engine.models}
            backbones.append(BackboneInfo(name, folders, {k: engine.describe(k) for k in engine.models},
                                          str(engine.device), str(engine.dtype).removeprefix("torch.")))
        return Models(backbones, self.state.default_model)

    async def serve(self) -> bool:
        """Load the models and answer the fronts until SIGTERM, then drain; False if the models could not load."""
        await self.state.load()
        if self.state.lifecycle.failed:
            print(f"failed: {self.state.lifecycle.error}", flush=True)
            return False
        server = await asyncio.start_unix_server(self._front, path=str(self.path))
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stopping.set)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # Ctrl-C reaches the group: the supervisor decides
        print("ready", flush=True)
        async with server:
            await self._stopping.wait()
            log.info("draining: answering what the fronts sent (at most %.0f s)", self.settings.drain_timeout_s)
            self.state.start_draining()  # batches go without waiting to fill
            end = time.monotonic() + self.settings.drain_timeout_s
            while (self.fronts or not self.state.idle) and time.monotonic() < end:
                await asyncio.sleep(0.02)
            server.close()
        await self.state.close(timeout_s=1.0)
        return True

    async def _front(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One front's connection: its requests, each answered on its own task, until it closes."""
        hello = await read_to_host(reader)
        if not isinstance(hello, Hello):
            writer.close()
            return
        self.fronts.add(writer)
        writer.write(frame(self.models()))
        running: dict[int, asyncio.Task[None]] = {}
        try:
            while (msg := await read_to_host(reader)) is not None:
                if isinstance(msg, Run):
                    task = asyncio.create_task(self._run(msg, writer))
                    running[msg.id] = task
                    task.add_done_callback(lambda _, k=msg.id: running.pop(k, None))
                elif isinstance(msg, Cancel) and msg.id in running:
                    running[msg.id].cancel()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:  # the front has gone: nobody waits for its requests
            for task in list(running.values()):
                task.cancel()
            self.fronts.discard(writer)
            writer.close()
            log.info("front %d disconnected", hello.front)

    async def _run(self, msg: Run, writer: asyncio.StreamWriter) -> None:
        """A front's request on its backbone's batcher, answered with the texts' answers or why there are none."""
        backbone = self.state.inference.backbones.get(msg.backbone)
        reply: Answered | Refused
        if backbone is None:
            reply = Refused(msg.id, "failed", f"no backbone {msg.backbone!r} here")
        else:
            jobs = [TextJob.of(job.encoding, job.asks) for job in msg.jobs]
            chunks = [w for job in jobs for w in job.chunks()]
            try:
                got = await backbone.batcher.submit(chunks, [w.cost for w in chunks], msg.deadline,
                                                    groups=[w.job for w in chunks])
                reply = Answered(msg.id, answers_of(chunks, got))
            except Overloaded as e:
                reply = Refused(msg.id, "overloaded", str(e))
            except Draining as e:
                reply = Refused(msg.id, "draining", str(e))
            except DeadlineExceeded as e:
                reply = Refused(msg.id, "deadline", str(e))
            except Exception as e:  # the batch failed: the front answers 500 with why
                reply = Refused(msg.id, "failed", f"{type(e).__name__}: {e}")
        with contextlib.suppress(ConnectionError):
            writer.write(frame(reply))


def main(path: Path) -> int:
    settings = Settings.model_validate_json(sys.stdin.read())
    setup_logging(settings)
    host = EngineHost(settings, path)
    ok = asyncio.run(host.serve())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
