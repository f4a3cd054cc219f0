"""Several front processes over one engine host (``ROUTING_WORKERS`` > 1).

::

    supervisor (routing-service serve)
      ├── engine host (service.serving.host): the models, one batcher per backbone, the backbones' processes
      └── front 0 .. N-1: HTTP from one listening socket the supervisor opens, gRPC on one port (SO_REUSEPORT),
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
from collections.abc import Awaitable, Callable, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from service.config import Settings
from service.modeling.manifest import read_manifest
from service.modeling.tokenizer import ChunkTokenizer
from service.serving import errors
from service.serving.batcher import DeadlineExceeded, Draining, Overloaded
from service.serving.contract import Answer, ChunkWork, TextJob
from service.serving.errors import APIError
from service.serving.inference import Backbone
from service.serving.planner import Planner
from service.serving.wire import (
    Answered,
    Applied,
    BackboneInfo,
    Cancel,
    Control,
    Controlled,
    Hello,
    Job,
    Models,
    Refused,
    Run,
    Scrape,
    Scraped,
    frame,
    read_to_front,
)

if TYPE_CHECKING:
    from service.serving.state import AppState

log = logging.getLogger("service.fronts")


class HostGone(RuntimeError):
    """The engine host closed the connection (it exited)."""


ServeModels = Callable[["HostLink", Models], Awaitable[None]]
"""What a front does with the host's :class:`Models`: serve what they say (see :func:`serve_models`)."""


class HostLink:
    """A front's connection to the engine host: requests out, each answered to the coroutine that sent it; the
    host's models served as they change."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_models: ServeModels) -> None:
        self._reader, self._writer, self._on_models = reader, writer, on_models
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._listener: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, path: Path, front: int, on_models: ServeModels) -> HostLink:
        """The link to the host at ``path``, once ``on_models`` has served what the host serves."""
        reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
        writer.write(frame(Hello(front)))
        models = await read_to_front(reader)
        if not isinstance(models, Models):
            raise HostGone("the engine host did not say what it serves")
        link = cls(reader, writer, on_models)
        await on_models(link, models)
        link._listener = asyncio.create_task(link._listen(), name="host-link")
        return link

    @property
    def closed(self) -> bool:
        return self._listener is None or self._listener.done()

    async def _listen(self) -> None:
        try:
            while (msg := await read_to_front(self._reader)) is not None:
                if isinstance(msg, Models):
                    try:
                        await self._on_models(self, msg)
                    except Exception:  # the front serves what it could; the host's next change comes
                        log.exception("serving the engine host's models version %d failed", msg.version)
                    self._writer.write(frame(Applied(msg.version)))
                    continue
                future = self._waiting.pop(msg.id, None)
                if future is None or future.done():
                    continue
                if isinstance(msg, Answered):
                    future.set_result(msg.answers)
                elif isinstance(msg, Controlled | Scraped):
                    future.set_result(msg)
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
        return self._ask(lambda k: Run(k, backbone, [Job(j.encoding, j.asks) for j in jobs], deadline))

    def _ask(self, message: Callable[[int], Run | Control | Scrape]) -> tuple[int, asyncio.Future[Any]]:
        """Send ``message(k)`` under a new request number ``k``: ``k``, and the future its answer sets."""
        if self.closed:
            raise HostGone("the engine host has exited")
        k = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[k] = future
        self._writer.write(frame(message(k)))
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

    async def control(self, op: Literal["index", "load", "unload", "stats"], name: str = "", ready_only: bool = False,
                      names: list[str] | None = None) -> Controlled:
        """A repository request carried out by the host (for every front at once), or the models' statistics."""
        _, future = self._ask(lambda k: Control(k, op, name, ready_only, names or []))
        answer: Controlled = await future
        return answer

    async def scrape(self) -> bytes:
        """The host's readings for ``/metrics`` (see :meth:`~service.serving.metrics.Metrics.reading`)."""
        if self.closed:
            return b""
        _, future = self._ask(Scrape)
        answer: Scraped = await future
        return answer.text

    async def close(self) -> None:
        self._writer.close()
        if self._listener is not None:
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


async def serve_models(state: AppState, link: HostLink, models: Models) -> None:
    """Make ``state``'s inference serve what the host serves: a backbone group new here gets its front side (its
    tokenizer loaded off the event loop), one gone is dropped, heads added or retired on those that stay; each model
    name goes to the head the host serves it from (new requests take it at once), a name the host no longer serves
    is withdrawn (404 from now on)."""
    inference = state.inference
    loop = asyncio.get_running_loop()
    if not inference.backbones:  # the models served at start: which have series of their own
        state.label_metrics(list(models.served))
    by_key: dict[str, tuple[Backbone, str]] = {}  # head key -> its backbone here, its model's folder
    for info in models.backbones:
        backbone = inference.backbones.get(info.name)
        if backbone is None:
            planner = await loop.run_in_executor(None, RemotePlanner, info)
            backbone = Backbone(planner, RemoteBatcher(link, info.name))  # type: ignore[arg-type]
            inference.backbones[info.name] = backbone
        else:
            assert isinstance(backbone.engine, RemotePlanner)
            await loop.run_in_executor(None, backbone.engine.update, info)
        by_key.update((key, (backbone, folder)) for key, folder in info.folders.items())
    for name in [n for n in inference.models if n not in models.served]:
        inference.withdraw(name)
        state.metrics.unloaded(name)
    for name, key in models.served.items():
        if inference.heads.get(name) != key:
            backbone, folder = by_key[key]
            inference.serve(name, key, backbone)
            state.published(backbone, name, Path(folder),
                            float(backbone.engine.describe(key).get("load_seconds", 0.0)))
    for name in set(inference.backbones) - {info.name for info in models.backbones}:
        inference.backbones.pop(name)
    if models.default_model is not None:
        state.default_model = models.default_model


class RemoteControl:
    """The repository requests a front takes, carried out by the engine host's model control once for the whole
    server: a load or an unload returns after every front serves the change."""

    def __init__(self, link: HostLink) -> None:
        self.link = link

    async def entries(self, ready_only: bool = False) -> list[dict[str, str]]:
        return (await self._ask("index", ready_only=ready_only)).entries

    async def load(self, name: str) -> None:
        await self._ask("load", name)

    async def unload(self, name: str) -> None:
        await self._ask("unload", name)

    async def statistics(self, names: list[str]) -> dict[str, Any]:
        """Models ``names``' statistics as the host counts them (every front's requests)."""
        return (await self._ask("stats", names=names)).stats

    async def _ask(self, op: Literal["index", "load", "unload", "stats"], name: str = "", ready_only: bool = False,
                   names: list[str] | None = None) -> Controlled:
        try:
            got = await self.link.control(op, name, ready_only, names)
        except HostGone as e:
            raise errors.unavailable(str(e), "draining") from None
        if got.status != 200:
            raise APIError(got.status, got.message)
        return got

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


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

    def update(self, info: BackboneInfo) -> None:
        """The heads the host holds now: those added read from their folders, those gone dropped."""
        added = {key: read_manifest(Path(folder)) for key, folder in info.folders.items() if key not in self.manifests}
        self._descriptions = {**self._descriptions, **info.descriptions}
        if added:
            self._added(added)
        gone = [key for key in self.manifests if key not in info.folders]
        if gone:
            self._removed(gone)

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


if __name__ == "__main__":  # a front: python -m service.serving.fronts K HOST-SOCKET FD, settings on stdin
    from service.serving.server import run_front

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_front(Settings.model_validate_json(sys.stdin.read()), int(sys.argv[1]), Path(sys.argv[2]),
                       int(sys.argv[3])))
