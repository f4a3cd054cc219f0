"""What the app holds while it runs: settings, metrics, the lifecycle, and the inference layer with one
engine + batcher per backbone group. Loading happens in the background so /healthz answers at once and
/readyz says when it is done."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from service.config import Settings
from service.modeling.manifest import WEIGHTS, ModelLoadError, discover, read_manifest
from service.serving import tracing
from service.serving.batcher import Batcher, BatchLimits
from service.serving.cache import HeadCache
from service.serving.control import ModelControl
from service.serving.errors import APIError
from service.serving.lifecycle import Lifecycle
from service.serving.metrics import Metrics
from service.serving.planner import Planner, backbone_key, model_of
from service.serving.worker import BackboneProcess, Launches, Replicas

if TYPE_CHECKING:
    from service.serving.fronts import HostLink
    from service.serving.inference import Backbone, Inference

log = logging.getLogger("service.state")
LOADED_LATER = {
    "poll": "a model folder written into it is loaded within ROUTING_REPOSITORY_POLL_S",
    "explicit": "POST /v2/repository/models/<name>/load (an admin key) loads a model folder written into it",
    "cache": "a request that names a model folder written into it loads that model (the head cache)",
}
"""How a server started without models comes to serve one: by ``model_control``, or with a head cache."""


def may_start_empty(settings: Settings) -> bool:
    """Whether models can come while the server runs (so that it may start without any): through
    ``/v2/repository`` or the repository's poll (``model_control``), or on a request's demand (a head cache)."""
    return settings.model_control != "none" or settings.head_cache_bytes is not None


def default_model_at_start(settings: Settings) -> str | None:
    """The model behind /v1/classify and /v1/explain as the server starts: ``default_model`` as set; when it was not
    set and its default (``tweet-sentiment``) does not serve, the first model that does (of ``models``, else the
    repository's first by name), so that a repository of one's own models serves without naming one; when it was not
    set and no model serves at start, None (the first model to serve becomes the default)."""
    if "default_model" in settings.model_fields_set:
        return settings.default_model  # named: the start's error if it does not serve, unless none does (see load)
    try:
        serving = settings.models or discover(settings.model_repository)
    except ModelLoadError:
        return settings.default_model  # the start says what is wrong with the repository
    if not serving:
        return None
    if settings.default_model in serving:
        return settings.default_model
    log.info("default model (behind /v1/classify and /v1/explain): %s, the first model to serve (%s is not among "
             "them; ROUTING_DEFAULT_MODEL names another)", serving[0], settings.default_model)
    return serving[0]


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    inference: Inference = field(init=False)
    control: ModelControl = field(init=False)
    cache: HeadCache | None = field(init=False)
    launches: Launches = field(default_factory=Launches)  # backbone processes loading (stopped on close)
    host: Path | None = None
    """The engine host's socket when this is one of several fronts (its models are served there), else None."""
    link: HostLink | None = field(default=None, init=False)
    announce: Callable[[], Awaitable[None]] | None = field(default=None, init=False)
    """An engine host's: tell every front what it serves now, once they serve it (see ``ModelControl``)."""
    default_model: str | None = field(init=False)
    """The model behind /v1/classify and /v1/explain (see :func:`default_model_at_start`); None while no model has
    served yet in a server started without any."""

    def __post_init__(self) -> None:
        from service.serving.inference import Inference

        self.default_model = default_model_at_start(self.settings)
        self.inference = Inference(self.settings, self.lifecycle, self.metrics.stats)
        self.control = ModelControl(self)
        budget = self.settings.head_cache_bytes
        pinned = self.settings.models or ([self.default_model] if self.default_model is not None else [])
        self.cache = None if budget is None else HeadCache(self, budget, pinned)
        self.inference.cache = self.cache

    def default(self) -> str:
        """The model behind /v1/classify and /v1/explain: 404 while there is none (a server started without
        models, none served since)."""
        if self.default_model is None:
            raise APIError(404, "no default model: the server started without models and none has served since "
                                "(GET /v1/models lists those loaded; /v1/models/{model}/... names one)")
        return self.default_model

    def model_names(self, repository: Path) -> list[str]:
        """The models to load at start: ``models``, or every folder of the repository (with a head cache, only the
        pinned ones: the others load on demand)."""
        available = discover(repository)
        wanted = sorted(self.cache.pinned) if self.cache is not None else self.settings.models or available
        unknown = sorted(set(wanted) - set(available))
        if unknown:
            raise ValueError(f"models {unknown} not found in {repository} (available: {available})")
        return list(wanted)

    def backbone_groups(self, names: list[str]) -> list[list[Path]]:
        """The model folders of ``names`` by the backbone they name (source and revision), in order."""
        repo = self.settings.model_repository
        groups: dict[tuple[str, str], list[Path]] = {}
        for name in names:
            groups.setdefault(backbone_key(read_manifest(repo / name)), []).append(repo / name)
        return list(groups.values())

    async def load(self) -> None:
        """Load, warm up and start every backbone group; on failure record why (the server then exits)."""
        s = self.settings
        if self.host is not None:
            return await self._connect()
        try:
            if not s.model_process:  # torch computes in this process (else each backbone's process sets its own)
                from service.threads import set_torch_threads

                threads = set_torch_threads(s.torch_threads)
                log.info("torch intra-op threads: %d; OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s", threads,
                         os.environ.get("OMP_WAIT_POLICY", "(runtime default)"),
                         os.environ.get("GOMP_SPINCOUNT", "(runtime default)"))
            names = self.model_names(s.model_repository)
            self.label_metrics(names)
            if not names and not may_start_empty(s):
                raise ValueError(f"no models in {s.model_repository} (ROUTING_MODEL_CONTROL=poll or explicit, or a "
                                 "head cache, ROUTING_HEAD_CACHE_BYTES, starts a server without any to load them while "
                                 "it runs)")
            if not names:
                log.warning("no models in %s yet: the server starts without any; %s", s.model_repository,
                            LOADED_LATER["cache" if self.cache is not None else s.model_control])
            elif self.default_model not in names:
                raise ValueError(f"default model {self.default_model!r} (behind /v1/classify and /v1/explain) is not "
                                 f"among the models to serve, {names} of {s.model_repository}: "
                                 "ROUTING_DEFAULT_MODEL names it")
            for folders in self.backbone_groups(names):
                await self.start_backbone(folders)
            self.control.start()
            if self.cache is not None:
                self.cache.start()
            self.lifecycle.loaded()
        except Exception as e:
            if self.launches.stopped:  # the server stopped it: shutting down while loading is no failure
                log.info("loading stopped: the server is shutting down")
                return
            self.lifecycle.fail(f"{type(e).__name__}: {e}")
            log.error("model loading failed: %s", self.lifecycle.error)

    def label_metrics(self, names: list[str]) -> None:
        """The models with series of their own (``metrics_models``; ``names``: those served at start)."""
        chosen = self.settings.metrics_models
        self.metrics.label_models(None if chosen == ["all"] else names if chosen == ["pinned"] else chosen)

    async def _connect(self) -> None:
        """A front of several: serve what the engine host serves (tokenizers and manifests here, its weights and
        batchers there), as it changes; on failure record why (the front then exits)."""
        from service.serving.fronts import HostLink, RemoteControl, serve_models

        assert self.host is not None
        try:
            self.link = await HostLink.connect(self.host, os.getpid(), functools.partial(serve_models, self))
            self.control = RemoteControl(self.link)  # type: ignore[assignment]
            self.lifecycle.loaded()
        except Exception as e:
            self.lifecycle.fail(f"{type(e).__name__}: {e}")
            log.error("the engine host's models could not be served: %s", self.lifecycle.error)

    async def start_backbone(self, folders: list[Path], keys: list[str] | None = None) -> Backbone:
        """Load the models of ``folders`` (naming one backbone) on a new backbone group, each head under its key
        in ``keys`` (default: its model's name), start its batcher and serve them.

        Raises:
            ModelLoadError, ModelProcessError, NonFiniteScores: the models could not load (nothing is served).
        """
        from service.serving.inference import Backbone

        s = self.settings
        t0 = time.perf_counter()
        log.info("loading models %s on one backbone", [f.name for f in folders])
        engine = await asyncio.get_running_loop().run_in_executor(None, self._load_backbone, folders, keys)
        engine.name = self.inference.group_name(engine)
        size, tokens = s.batch_limits(str(engine.device))
        limits = BatchLimits(max_batch_size=size, max_batch_tokens=tokens, max_wait_s=s.max_wait_ms / 1000,
                             max_queue=s.max_queue)
        observer = self.metrics.observer(engine.name, engine.runner_devices)
        if tracing.enabled():  # each batch's span, linked to its texts' requests
            observer = tracing.TracedBatches(observer, engine.name)
        batcher = Batcher(engine.runners, limits, observer, engine.name)
        batcher.start()
        backbone = Backbone(engine, batcher)
        self.inference.add(backbone)
        seconds = time.perf_counter() - t0
        for folder, key in zip(folders, engine.models, strict=True):
            self.published(backbone, model_of(key), folder, seconds)
        log.info("backbone %s with models %s ready on %s in %.1f s", engine.name, engine.models, engine.device,
                 seconds)
        return backbone

    def published(self, backbone: Backbone, name: str, folder: Path, seconds: float) -> None:
        """Metrics of model ``name`` (its folder ``folder``), now served on ``backbone``; the default model, when
        the server started without one, is the first to serve."""
        if self.default_model is None:
            self.default_model = name
            log.info("default model (behind /v1/classify and /v1/explain): %s, the first model to serve", name)
        engine = backbone.engine
        weights = folder / WEIGHTS
        self.metrics.loaded(name, engine.manifests[self.inference.heads[name]].backbone.name, str(engine.device),
                            str(engine.dtype).removeprefix("torch."), seconds,
                            weights.stat().st_size if weights.is_file() else 0)

    def _load_backbone(self, folders: list[Path], keys: list[str] | None = None) -> Planner:
        """The models of ``folders`` on one backbone (heads under ``keys``), as the settings say: in this process,
        a process of its own, or several."""
        s = self.settings
        if not s.model_process:
            from service.serving.engine import Engine  # torch, in this process only then

            return Engine.load(folders, s.engine_devices()[0], s.dtype, s.warmup, keys)
        devices = s.engine_devices()
        if len(devices) > 1:
            return Replicas(folders, devices, s.dtype, s.warmup, s.torch_threads, keys, self.launches)
        return BackboneProcess(folders, devices[0], s.dtype, s.warmup, s.torch_threads, keys=keys,
                               launches=self.launches)

    def start_draining(self) -> None:
        """New requests get 503 from here on; requests already being handled still reach the batchers."""
        self.lifecycle.drain()
        for backbone in self.inference.backbones.values():
            backbone.batcher.flush()

    @property
    def idle(self) -> bool:
        return self.lifecycle.in_flight == 0 and all(b.batcher.idle for b in self.inference.backbones.values())

    def device_memory(self) -> list[dict[str, float | str]]:
        """CUDA memory per device over the backbones' processes (this one's only when a backbone computes here,
        so that a scrape never opens a CUDA context in the server's process): amounts summed."""
        engines = [b.engine for b in self.inference.backbones.values()]
        own = [e for e in engines if not isinstance(e, BackboneProcess | Replicas)]  # computing in this process
        readings = (own[0].device_memory() if own else []) + [  # one reading of this process's devices
            d for e in engines if isinstance(e, BackboneProcess | Replicas) for d in e.device_memory()]
        merged: dict[str, dict[str, float | str]] = {}
        for d in readings:
            if d["device"] not in merged:
                merged[d["device"]] = dict(d)
                continue
            into = merged[d["device"]]
            for key in ("allocated", "reserved", "peak"):
                into[key] = float(into[key]) + float(d[key])
        return list(merged.values())

    def backbone_processes(self) -> list[tuple[str, float, int]]:
        """Each backbone computing in processes of its own (none for those computing in this one): its name, their
        resident memory summed over its replicas, and how many times they were started again after exiting."""
        readings = [(name, b.engine.resident_bytes(), b.engine.restarts())
                    for name, b in self.inference.backbones.items()]
        return [(name, float(rss), restarts) for name, rss, restarts in readings if rss is not None]

    def abort(self, reason: str) -> int:
        """Answer every text still queued or computing with 'shutting down' (503); how many there were."""
        return sum(b.batcher.abort(reason) for b in self.inference.backbones.values())

    async def close(self, timeout_s: float) -> None:
        """Stop every backbone process still loading, stop every batcher, answering what is still queued within
        ``timeout_s``; close the backbones."""
        if loading := self.launches.stop():
            log.info("stopped %d backbone process%s still loading", loading, "es" * (loading > 1))
        await self.control.stop()
        if self.cache is not None:
            await self.cache.stop()
        backbones = list(self.inference.backbones.values())
        for backbone in backbones:
            await backbone.batcher.stop(timeout_s)
        loop = asyncio.get_running_loop()  # side by side: each backbone's process exits on its own time
        await asyncio.gather(*(loop.run_in_executor(None, b.engine.close) for b in backbones))
        if self.link is not None:
            await self.link.close()
        self.lifecycle.stop()
