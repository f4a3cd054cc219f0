"""A front's side of the engine host (``ROUTING_WORKERS`` > 1): the engine client a front serves through
(:class:`RemoteEngine`), each backbone group the host serves as the front reaches it (:class:`RemoteGroup`: the
manifests and the tokenizer here, no weights; what the pipeline submits goes to the host, whose batcher mixes it with
every other front's), and the repository requests carried out by the host (:class:`RemoteControl`).

::

    supervisor (routing-service serve)
      ├── engine host (service.serving.host): the models, one batcher per backbone, the backbones' processes
      └── front 0 .. N-1 (service.serving.front): HTTP from one listening socket the supervisor opens, gRPC on one
          port (SO_REUSEPORT), each validating, tokenizing and rendering; typed messages to the host

Every protocol, limit and error stays the front's app's own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from service.config import Settings
from service.modeling.manifest import read_manifest
from service.modeling.tokenizer import ChunkTokenizer
from service.serving.core import errors
from service.serving.core.errors import APIError
from service.serving.core.lifecycle import Lifecycle
from service.serving.core.results import Answer, Scores
from service.serving.core.work import TextJob
from service.serving.engine.batcher import Draining
from service.serving.engine.group import refused
from service.serving.engine.planner import Planner
from service.serving.engine.scores import read_answers
from service.serving.models.loader import label_metrics, publish
from service.serving.models.registry import Registry
from service.serving.observe.metrics import Metrics
from service.serving.remote.link import HostGone, HostLink
from service.serving.remote.wire import BackboneInfo, Controlled, Models

log = logging.getLogger("service.fronts")


class RemoteGroup:
    """A backbone group on the engine host as a front reaches it: its models' manifests and the backbone's tokenizer
    (no weights), what the host says of each head, and the host's batcher behind :meth:`submit`. The queue limit and
    the deadline are the host's (for every front at once); this side only refuses while draining."""

    def __init__(self, link: HostLink, info: BackboneInfo) -> None:
        folders = [Path(f) for f in info.folders.values()]
        manifests = [read_manifest(f) for f in folders]
        self.link = link
        self._planner = Planner(manifests, ChunkTokenizer.load(manifests[0].backbone.source), list(info.folders))
        self._planner.name = info.name
        self._device, self._dtype = info.device, info.dtype
        self._descriptions = info.descriptions
        self._accepting = True
        self._requests: set[asyncio.Future[list[Answer]]] = set()  # requests sent, not yet answered

    @property
    def planner(self) -> Planner:
        return self._planner

    @property
    def device(self) -> str:
        return self._device

    @property
    def dtype(self) -> str:
        return self._dtype

    def describe(self, key: str) -> dict[str, Any]:
        return dict(self._descriptions[key])

    def update(self, info: BackboneInfo) -> None:
        """The heads the host holds now: those added read from their folders, those gone dropped."""
        planner = self._planner
        added = {key: read_manifest(Path(folder)) for key, folder in info.folders.items()
                 if key not in planner.manifests}
        self._descriptions = {**self._descriptions, **info.descriptions}
        if added:
            planner.add(added)
        gone = [key for key in planner.manifests if key not in info.folders]
        if gone:
            planner.remove(gone)

    @property
    def idle(self) -> bool:
        return not self._requests

    def check_room(self, n: int) -> None:
        if not self._accepting:
            raise Draining(f"{self._planner.name} is draining")

    def submit(self, jobs: Sequence[TextJob], deadline: float) -> asyncio.Future[list[Answer]]:
        try:
            self.check_room(len(jobs))
            future = self.link.send(self._planner.name, jobs, deadline, self._read)
        except Draining as e:  # draining, or the host has gone (HostGone)
            return refused(e)
        self._requests.add(future)
        future.add_done_callback(self._requests.discard)
        return future

    def _read(self, scores: Scores) -> list[Answer]:
        """A plain request's texts' answers from their scores, as the host computed them."""
        return read_answers(scores, self._planner.manifests)

    def flush(self) -> None:
        pass  # the host's batcher flushes as the server drains (its SIGTERM comes with the fronts')

    def abort(self, reason: str) -> int:
        """Answer every request still waiting with :class:`Draining` now (503), and drop them on the host."""
        self._accepting = False
        answered = 0
        for future in list(self._requests):
            if not future.done():
                future.set_exception(Draining(f"{self._planner.name}: {reason}"))  # the link drops it on the host
                answered += 1
        return answered

    async def stop(self, timeout_s: float) -> None:
        self._accepting = False
        end = time.monotonic() + timeout_s
        while not self.idle and time.monotonic() < end:
            await asyncio.sleep(0.01)
        self.abort("stopped")


class RemoteControl:
    """The repository requests a front takes, carried out by the engine host's model control once for the whole
    server: a load or an unload returns after every front serves the change."""

    def __init__(self, link: HostLink | None = None) -> None:
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
        if self.link is None:
            raise errors.unavailable("not connected to the engine host yet", "loading")
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


class RemoteEngine:
    """The engine host's models served by a front (its socket at ``path``): ``registry`` made to serve what the host
    serves, as it changes."""

    cache = None  # a head cache needs one front (the settings refuse it with several)

    def __init__(self, settings: Settings, registry: Registry, metrics: Metrics, lifecycle: Lifecycle,
                 path: Path) -> None:
        self.settings, self.registry, self.metrics, self.lifecycle = settings, registry, metrics, lifecycle
        self.path = path
        self.link: HostLink | None = None
        self.control = RemoteControl()

    async def start(self) -> None:
        """Connect to the host and serve what it serves (tokenizers and manifests here, its weights and batchers
        there); the lifecycle says how it went (on failure, why: the front then exits)."""
        try:
            self.link = await HostLink.connect(self.path, os.getpid(), self._serve)
            self.control.link = self.link
            self.lifecycle.loaded()
        except Exception as e:
            self.lifecycle.fail(f"{type(e).__name__}: {e}")
            log.error("the engine host's models could not be served: %s", self.lifecycle.error)

    def stop_loading(self) -> int:
        return 0  # nothing loads here

    @property
    def loading_stopped(self) -> bool:
        return False

    async def _serve(self, link: HostLink, models: Models) -> None:
        """Serve what the host serves: a backbone group new here gets its front side (its tokenizer loaded off the
        event loop), one gone is dropped, heads added or retired on those that stay; each model name goes to the head
        the host serves it from (new requests take it at once), a name the host no longer serves is withdrawn (404
        from now on)."""
        registry = self.registry
        loop = asyncio.get_running_loop()
        if not registry.groups:  # the models served at start: which have series of their own
            label_metrics(self.settings, self.metrics, list(models.served))
        by_key: dict[str, tuple[RemoteGroup, str]] = {}  # head key -> its group here, its model's folder
        for info in models.backbones:
            group = registry.groups.get(info.name)
            if group is None:
                group = await loop.run_in_executor(None, RemoteGroup, link, info)
                registry.groups[info.name] = group
            else:
                assert isinstance(group, RemoteGroup)
                await loop.run_in_executor(None, group.update, info)
            by_key.update((key, (group, folder)) for key, folder in info.folders.items())
        for name in [n for n in registry.models if n not in models.served]:
            registry.withdraw(name)
            self.metrics.unloaded(name)
        for name, key in models.served.items():
            if registry.heads.get(name) != key:
                group, folder = by_key[key]
                registry.serve(name, key, group)
                publish(registry, self.metrics, group, name, Path(folder),
                        float(group.describe(key).get("load_seconds", 0.0)))
        for name in set(registry.groups) - {info.name for info in models.backbones}:
            registry.groups.pop(name)
        if models.default_model is not None:
            registry.default_model = models.default_model

    async def close(self, timeout_s: float) -> None:
        """Answer what is still waiting on the host within ``timeout_s`` (503 after), and close the link."""
        for group in list(self.registry.groups.values()):
            await group.stop(timeout_s)
        if self.link is not None:
            await self.link.close()

    async def scrape(self) -> bytes:
        """The host's readings for ``/metrics`` (its backbones' processes, CUDA memory)."""
        return b"" if self.link is None else await self.link.scrape()

    def device_memory(self) -> list[dict[str, float | str]]:
        return []  # read on the host (see :meth:`scrape`)

    def backbone_processes(self) -> list[tuple[str, float, int]]:
        return []
