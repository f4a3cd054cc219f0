"""Several front processes over one engine host (``ROUTING_WORKERS`` > 1).

::

    supervisor (routing-service serve)
      ├── engine host (service.serving.host): the models, one batcher per backbone, the backbones' processes
      └── front 0 .. N-1: HTTP and gRPC on the same ports (SO_REUSEPORT: the kernel spreads the connections),
          each validating, tokenizing and rendering; typed messages to the host (service.serving.wire)

A front is the one-process server's app with its backbones replaced by their front sides: :class:`RemotePlanner`
(the manifests and the tokenizer, no weights) and :class:`RemoteBatcher` (what the inference layer submits goes to
the host, whose batcher mixes it with every other front's). Every protocol, limit and error stays the app's own.
The supervisor (:mod:`service.serving.supervisor`) starts the host and the fronts, and stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from service.config import Settings
from service.modeling.manifest import read_manifest
from service.modeling.tokenizer import ChunkTokenizer
from service.serving.batcher import DeadlineExceeded, Draining, Overloaded
from service.serving.contract import Answer, ChunkWork, TextJob
from service.serving.planner import Planner
from service.serving.wire import Answered, BackboneInfo, Cancel, Hello, Job, Models, Refused, Run, frame, read_to_front

log = logging.getLogger("service.fronts")


class HostGone(RuntimeError):
    """The engine host closed the connection (it exited)."""


class HostLink:
    """A front's connection to the engine host: requests out, each answered to the coroutine that sent it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, models: Models) -> None:
        self._reader, self._writer, self.models = reader, writer, models
        self._waiting: dict[int, asyncio.Future[list[Answer]]] = {}
        self._ids = itertools.count()
        self._listener = asyncio.create_task(self._listen(), name="host-link")

    @classmethod
    async def connect(cls, path: Path, front: int) -> HostLink:
        reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
        writer.write(frame(Hello(front)))
        models = await read_to_front(reader)
        if not isinstance(models, Models):
            raise HostGone("the engine host did not say what it serves")
        return cls(reader, writer, models)

    async def _listen(self) -> None:
        try:
            while (msg := await read_to_front(self._reader)) is not None:
                if isinstance(msg, Answered | Refused):
                    future = self._waiting.pop(msg.id, None)
                    if future is None or future.done():
                        continue
                    if isinstance(msg, Answered):
                        future.set_result(msg.answers)
                    else:
                        future.set_exception(_refusal(msg))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        for future in self._waiting.values():  # the host has gone: nothing will answer these
            if not future.done():
                future.set_exception(HostGone("the engine host exited while this request was computed"))
        self._waiting.clear()

    def send(self, backbone: str, jobs: list[TextJob], deadline: float) -> tuple[int, asyncio.Future[list[Answer]]]:
        """Send the jobs of one request to the host: its number, and the future of each job's answer (in order)."""
        if self._listener.done():
            raise HostGone("the engine host has exited")
        k = next(self._ids)
        future: asyncio.Future[list[Answer]] = asyncio.get_running_loop().create_future()
        self._waiting[k] = future
        self._writer.write(frame(Run(k, backbone, [Job(j.encoding, j.asks) for j in jobs], deadline)))
        return k, future

    async def wait(self, k: int, future: asyncio.Future[list[Answer]]) -> list[Answer]:
        """The answers of request ``k``; a cancelled caller cancels the request on the host."""
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.pop(k, None) is not None:
                with contextlib.suppress(ConnectionError):
                    self._writer.write(frame(Cancel(k)))
            raise

    def fail(self, k: int, exc: BaseException) -> bool:
        """Answer request ``k`` with ``exc`` now, and drop it on the host; False if it was answered already."""
        future = self._waiting.pop(k, None)
        if future is None or future.done():
            return False
        future.set_exception(exc)
        with contextlib.suppress(ConnectionError):
            self._writer.write(frame(Cancel(k)))
        return True

    async def close(self) -> None:
        self._writer.close()
        self._listener.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await self._listener


def _refusal(msg: Refused) -> Exception:
    """What the host's refusal is for the inference layer (the exceptions a batcher raises)."""
    if msg.kind == "overloaded":
        return Overloaded(msg.message)
    if msg.kind == "draining":
        return Draining(msg.message)
    if msg.kind == "deadline":
        return DeadlineExceeded(msg.message)
    return RuntimeError(msg.message)


class RemoteBatcher:
    """The front side of a backbone's batcher on the engine host: what the inference layer submits is sent there
    as its texts' jobs, and each text's answer comes back at its last chunk's place, as a batcher gives them. The
    queue limit and the deadline are the host's (for every front at once); this side only refuses while draining."""

    def __init__(self, link: HostLink, backbone: str) -> None:
        self.link, self.backbone = link, backbone
        self._accepting = True
        self._requests: set[int] = set()  # requests sent, not yet answered

    def start(self) -> None:
        pass

    @property
    def idle(self) -> bool:
        return not self._requests

    @property
    def queue_depth(self) -> int:
        return len(self._requests)

    def check_room(self, n: int) -> None:
        if not self._accepting:
            raise Draining(f"{self.backbone} is draining")

    async def submit(self, payloads: Sequence[ChunkWork], costs: Sequence[int], deadline: float,
                     groups: Sequence[Hashable] | None = None) -> list[Answer | None]:
        """The answers of ``payloads`` (chunks of whole texts, in order), each text's at its last chunk's place."""
        self.check_room(len(payloads))
        jobs = list(dict.fromkeys(w.job for w in payloads))
        try:
            k, future = self.link.send(self.backbone, jobs, deadline)
            self._requests.add(k)
            try:
                answers = await self.link.wait(k, future)
            finally:
                self._requests.discard(k)
        except HostGone as e:
            raise Draining(str(e)) from None
        by_job = dict(zip(jobs, answers, strict=True))
        return [by_job[w.job] if w.k == len(w.job.states) - 1 else None for w in payloads]

    def flush(self) -> None:
        pass  # the host's batcher flushes as the server drains (its SIGTERM comes with the fronts')

    def abort(self, reason: str) -> int:
        """Answer every request still waiting with :class:`Draining` now (503), and drop them on the host."""
        self._accepting = False
        return sum(self.link.fail(k, Draining(f"{self.backbone}: {reason}")) for k in list(self._requests))

    async def stop(self, drain_timeout: float) -> None:
        self._accepting = False
        end = time.monotonic() + drain_timeout
        while not self.idle and time.monotonic() < end:
            await asyncio.sleep(0.01)
        self.abort("stopped")


class RemotePlanner(Planner):
    """A backbone group on the engine host as a front sees it: its models' manifests and the backbone's tokenizer
    (no weights), and what the host says of each head."""

    def __init__(self, info: BackboneInfo) -> None:
        folders = [Path(f) for f in info.folders.values()]
        manifests = [read_manifest(f) for f in folders]
        super().__init__(manifests, ChunkTokenizer.load(manifests[0].backbone.source), list(info.folders))
        self.name = info.name
        self.device, self.dtype = info.device, info.dtype
        self._descriptions = info.descriptions

    def describe(self, model: str) -> dict[str, Any]:
        return dict(self._descriptions[model])

    def run_chunks(self, works: list[ChunkWork]) -> list[Answer | None]:
        raise RuntimeError("a front computes nothing: its batches go to the engine host (RemoteBatcher)")

    def add_heads(self, folders: Sequence[Path], keys: Sequence[str], warmup: bool = True) -> None:
        raise RuntimeError("several fronts serve the models loaded at start")

    def remove_heads(self, keys: Sequence[str]) -> None:
        raise RuntimeError("several fronts serve the models loaded at start")

    def resident_bytes(self) -> int | None:
        return None

    def restarts(self) -> int:
        return 0

    def device_memory(self) -> list[dict[str, float | str]]:
        return []

    def close(self, timeout_s: float = 10.0) -> None:
        pass


if __name__ == "__main__":  # a front: python -m service.serving.fronts K SOCKET, settings on stdin
    from service.serving.server import run_front

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_front(Settings.model_validate_json(sys.stdin.read()), int(sys.argv[1]), Path(sys.argv[2])))
