"""Models loaded, reloaded and unloaded while the server runs (Triton's model repository extension), through
``/v2/repository`` (``model_control=explicit``) or by watching the repository folder (``poll``).

A model whose backbone is already loaded loads as a head onto it (the head's folder read and checked, one
warm-up batch); a model of another backbone starts a backbone group of its own. A reload loads the new head
beside the old one and then points the model's name at it in one step: requests accepted before go on with
the old head, new ones take the new one, and the old head is dropped once the last request that holds it is
answered. An unload withdraws the name first (new requests get 404), waits for what it accepted, then drops
the head, and with the last head of a backbone its process and memory. One change at a time; a model that
fails to load leaves every other model serving as it was, and its reason shows in the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from service.config import Settings
from service.modeling.manifest import MANIFEST, MODEL_NAME, NAME_RULE, WEIGHTS, ModelLoadError, discover, read_manifest
from service.serving.core.errors import APIError
from service.serving.core.keys import backbone_key, head_key
from service.serving.engine.group import BackboneGroup, LocalGroup
from service.serving.models.loader import Loader, publish
from service.serving.models.registry import Registry
from service.serving.observe.metrics import Metrics

log = logging.getLogger("service.control")
ModelState = Literal["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]


@dataclass(frozen=True)
class IndexEntry:
    """One model folder of the repository (or a model still serving whose folder is gone)."""

    name: str
    state: ModelState
    reason: str = ""

    def json(self) -> dict[str, str]:
        return {"name": self.name, "version": "1", "state": self.state, "reason": self.reason}


def signature(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """What tells a changed model folder: its manifest's and weights' modification times and sizes."""
    out = []
    for name in (MANIFEST, WEIGHTS):
        with contextlib.suppress(OSError):
            st = (folder / name).stat()
            out.append((name, st.st_mtime_ns, st.st_size))
    return tuple(out)


class Control(Protocol):
    """The repository requests the API takes (Triton's model repository and statistics extensions): carried out here
    (:class:`ModelControl`), or by the engine host for every front at once
    (:class:`~service.serving.remote.client.RemoteControl`)."""

    async def entries(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index, as the API answers it."""
        ...

    async def load(self, name: str) -> Any:
        """Load or reload model ``name`` from its folder (APIError 400/404 when it cannot)."""
        ...

    async def unload(self, name: str) -> None:
        """Stop serving model ``name``, once what it accepted is answered."""
        ...

    async def statistics(self, names: list[str]) -> dict[str, Any]:
        """Models ``names``' inference statistics (Triton's shape)."""
        ...

    def start(self) -> None:
        """Begin (in ``poll`` mode, watching the repository)."""
        ...

    async def stop(self) -> None:
        """Stop watching."""
        ...


class HeadEvents(Protocol):
    """Who hears of heads loaded and unloaded through model control (the head cache)."""

    def loaded(self, name: str) -> None: ...
    def forget(self, name: str) -> None: ...


def local(group: BackboneGroup) -> LocalGroup:
    """``group`` as model control changes it: loaded from this process (the engine host's, or a one-front
    server's)."""
    assert isinstance(group, LocalGroup), f"backbone group {group.planner.name} is not loaded here"
    return group


class ModelControl:
    """Index, load, reload and unload models of the repository while the server runs."""

    def __init__(self, settings: Settings, registry: Registry, loader: Loader, metrics: Metrics,
                 announce: Callable[[], Awaitable[None]] | None = None) -> None:
        self.settings, self.registry, self.loader, self.metrics = settings, registry, loader, metrics
        self.announce = announce
        """Tell whoever serves beside this process (the fronts of an engine host) what is served now, once they serve
        it (see :meth:`_announce`)."""
        self.cache: HeadEvents | None = None
        """The head cache, when there is one (models not in memory load on a request's demand)."""
        self._lock = asyncio.Lock()  # one change at a time
        self._generation: dict[str, int] = {}  # model -> reloads so far (its head keys stay unique)
        self._status: dict[str, tuple[ModelState, str]] = {}  # models not simply READY or never touched
        self._seen: dict[str, tuple[tuple[str, int, int], ...]] = {}  # model -> its folder when last loaded or tried
        self._poller: asyncio.Task[None] | None = None

    @property
    def repository(self) -> Path:
        return self.settings.model_repository

    def start(self) -> None:
        """Note the folders of the models loaded at start; in ``poll`` mode, start watching the repository."""
        for name in self.registry.models:
            self._seen[name] = signature(self.repository / name)
        if self.settings.model_control == "poll" and self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="repository-poll")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    def folder(self, name: str) -> Path:
        """The repository folder of model ``name``: 400 for a name no model folder may have (a slash, ``..``),
        404 when the repository has no such model folder. A name reaches nothing but an entry of the repository
        folder; an entry that is a symbolic link (a version switched by relinking, a mounted volume) is followed, as
        when the server starts."""
        if not MODEL_NAME.fullmatch(name) or ".." in name:
            raise APIError(400, f"invalid model name {name!r}: a model is named by its folder in the repository "
                                f"({NAME_RULE}, no '..')")
        folder = self.repository.resolve() / name
        if not (folder / MANIFEST).is_file():
            raise APIError(404, f"no model folder {name!r} in the repository")
        return folder

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model folder of the repository (and every model serving), with its state."""
        try:
            names = set(discover(self.repository))
        except ModelLoadError:
            names = set()
        entries = []
        for name in sorted(names | set(self.registry.models) | set(self._status)):
            status = self._status.get(name)
            if status is not None and status[0] in ("LOADING", "UNLOADING"):
                entry = IndexEntry(name, *status)
            elif name in self.registry.models:
                entry = IndexEntry(name, "READY")
            elif status is not None:
                entry = IndexEntry(name, "UNAVAILABLE", status[1])
            else:
                entry = IndexEntry(name, "UNAVAILABLE", "not in memory: loads on its first request"
                                   if self.cache is not None else "not loaded")
            if not ready_only or entry.state == "READY":
                entries.append(entry)
        return entries

    async def entries(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index (see :meth:`index`) as the API answers it."""
        return [e.json() for e in self.index(ready_only)]

    async def statistics(self, names: list[str]) -> dict[str, Any]:
        """Models ``names``' inference statistics (Triton's shape)."""
        return self.metrics.stats.json(names)

    async def load(self, name: str) -> float:
        """Load model ``name`` from its folder, or reload it if it serves; returns the seconds it took.

        Raises:
            APIError: 400/404 for the name (see :meth:`folder`); 400 when the model fails to load (the message
                names the file and the problem; what served before serves on).
        """
        folder = self.folder(name)
        t0 = time.perf_counter()
        failed = (await self.load_many({name: folder}))[name]
        if failed is not None:
            raise failed
        return time.perf_counter() - t0

    async def load_many(self, folders: dict[str, Path]) -> dict[str, APIError | None]:
        """Load (or reload) the models of ``folders`` (by name; checked with :meth:`folder`), the heads of one loaded
        backbone in one change of its process. Each name's failure, None for those loaded; a failure leaves what
        served before serving."""
        async with self._lock:
            for name, folder in folders.items():
                self._status[name] = ("LOADING", "")
                self._seen[name] = signature(folder)
            t0 = time.perf_counter()
            errors = await self._load(folders)
            await self._announce()  # the retired heads dropped
            seconds = time.perf_counter() - t0
            out: dict[str, APIError | None] = {}
            for name, folder in folders.items():
                e = errors.get(name)
                out[name] = None if e is None else self._failed(name, e)
                if e is None:
                    self._status.pop(name, None)
                    if self.cache is not None:
                        self.cache.loaded(name)
                    self.metrics.model_loads.labels(self.metrics.model_label(name), "success").inc()
                    log.info("model %s loaded from %s in %.3f s", name, folder, seconds)
            return out

    def _failed(self, name: str, e: Exception) -> APIError:
        why = str(e) if isinstance(e, ModelLoadError) else f"{type(e).__name__}: {e}"
        reason = f"load failed: {why}"
        self._status[name] = ("UNAVAILABLE", reason)
        self.metrics.model_loads.labels(self.metrics.model_label(name), "failure").inc()
        log.error("model %s: %s", name, reason)
        return APIError(400, f"model {name}: {reason}")

    async def _announce(self) -> None:
        """Tell whoever serves beside this process (the fronts of an engine host) what is served now, and wait until
        they serve it: before a retired head waits for the requests that hold it, no new one may take it."""
        if self.announce is not None:
            await self.announce()

    def _next_key(self, name: str) -> str:
        """A new head key for model ``name`` (unique: its old head may still answer what it accepted)."""
        self._generation[name] = self._generation.get(name, 0) + 1
        return head_key(name, self._generation[name])

    async def _load(self, folders: dict[str, Path]) -> dict[str, Exception]:
        """Load the models of ``folders``; what failed, by name."""
        registry = self.registry
        errors: dict[str, Exception] = {}
        by_backbone: dict[str, list[str]] = {}  # a loaded backbone's name -> the models to load onto it
        for name, folder in folders.items():
            try:
                manifest = await asyncio.to_thread(read_manifest, folder)
                target = next((b for b in registry.groups.values() if b.planner.key == backbone_key(manifest)),
                              None)
                if target is None:  # a backbone not loaded yet: a group of its own (it serves the name when ready)
                    old = (registry.models[name], registry.heads[name]) if name in registry.models else None
                    await self.loader.start_group([folder], [self._next_key(name)])
                    await self._announce()
                    if old is not None:
                        await self._retire(*old)
                else:
                    by_backbone.setdefault(target.planner.name, []).append(name)
            except Exception as e:
                errors[name] = e
        for backbone_name, names in by_backbone.items():
            target = local(registry.groups[backbone_name])
            t0 = time.perf_counter()
            keys = {name: self._next_key(name) for name in names}
            try:
                await asyncio.to_thread(target.engine.add_heads, [folders[n] for n in names], list(keys.values()),
                                        self.settings.warmup)
                loaded = names
            except Exception as e:  # one damaged folder fails the change: each alone tells which
                if len(names) == 1:
                    errors[names[0]] = e
                    continue
                loaded = []
                for name in names:
                    keys[name] = self._next_key(name)
                    try:
                        await asyncio.to_thread(target.engine.add_heads, [folders[name]], [keys[name]],
                                                self.settings.warmup)
                        loaded.append(name)
                    except Exception as e1:
                        errors[name] = e1
            for name in loaded:
                old = (registry.models[name], registry.heads[name]) if name in registry.models else None
                registry.serve(name, keys[name], target)
                publish(registry, self.metrics, target, name, folders[name], time.perf_counter() - t0)
                await self._announce()
                if old is not None:
                    await self._retire(*old)
        return errors

    async def unload(self, name: str) -> None:
        """Stop serving model ``name``: new requests get 404 at once, those accepted are answered, then its head
        (and with the last head of a backbone, the backbone's process) is released. A model not serving: nothing
        to do. Raises APIError 400/404 for the name (see :meth:`folder`) unless the model serves."""
        registry = self.registry
        if name not in registry.models:
            self.folder(name)
            return
        async with self._lock:
            if name not in registry.models:
                return
            group, key = registry.models[name], registry.heads[name]
            self._status[name] = ("UNLOADING", "")
            registry.withdraw(name)
            await self._announce()
            try:
                await self._retire(group, key)
            finally:
                self.metrics.unloaded(name)
                self._status[name] = ("UNAVAILABLE", "unloaded")
                if self.cache is not None:
                    self.cache.forget(name)
                await self._announce()
            log.info("model %s unloaded", name)

    async def evict(self, names: Sequence[str]) -> None:
        """Drop the heads of models ``names`` from memory, their names still servable (the head cache brings them
        back on the next request that names them), the heads of one backbone in one change of its process. The
        cache evicts only heads no request holds."""
        registry = self.registry
        async with self._lock:
            by_backbone: dict[str, list[str]] = {}  # backbone -> the head keys to drop
            for name in names:
                if name not in registry.models:
                    continue
                group, key = registry.models[name], registry.heads[name]
                registry.withdraw(name)
                self.metrics.unloaded(name, count=False)
                self._status[name] = ("UNAVAILABLE", "evicted from the head cache: loads on the next request")
                by_backbone.setdefault(group.planner.name, []).append(key)
            for backbone_name, keys in by_backbone.items():
                await self._retire(registry.groups[backbone_name], *keys)
            log.debug("heads of models %s evicted", list(names))

    async def _retire(self, group: BackboneGroup, *keys: str) -> None:
        """Drop heads ``keys`` of ``group`` (in one change of its process) once no request holds them (no new one can
        take them): with the backbone's last heads, stop its batcher and close its process."""
        s = self.settings
        for key in keys:
            if not await self.registry.released(key, s.max_request_timeout_s + s.drain_timeout_s):
                log.warning("head %s still held by requests after their longest deadline; dropping it", key)
        loaded = local(group)
        engine = loaded.engine
        if set(engine.models) <= set(keys):
            await loaded.stop(s.drain_timeout_s)
            await asyncio.to_thread(loaded.close)
            self.registry.groups.pop(engine.name, None)
            self.metrics.closed(engine.name)
            log.info("backbone %s closed: no model left on it", engine.name)
        else:
            await asyncio.to_thread(engine.remove_heads, list(keys))

    async def _poll(self) -> None:
        """Every ``repository_poll_s``: load new folders, reload changed ones, unload the removed."""
        while True:
            await asyncio.sleep(self.settings.repository_poll_s)
            try:
                await self.sync()
            except Exception:  # a bad folder must not stop the watching
                log.exception("polling the model repository failed")

    async def sync(self) -> None:
        """One pass of ``poll`` mode over the repository (a failed load is retried only once its folder changes)."""
        try:
            names = set(discover(self.repository))
        except ModelLoadError as e:
            log.error("model repository: %s", e)
            return
        for name in sorted(names):
            folder = self.repository / name
            if self.cache is not None and name not in self.registry.models:
                continue  # with a head cache, a model not in memory loads when a request names it
            if signature(folder) != self._seen.get(name):
                with contextlib.suppress(APIError):  # logged, and shown in the index
                    await self.load(name)
        for name in sorted(set(self.registry.models) - names):
            await self.unload(name)
        for name in set(self._seen) - names:  # a folder gone: the index forgets it once it no longer serves
            if name not in self.registry.models:
                self._seen.pop(name, None)
                self._status.pop(name, None)
