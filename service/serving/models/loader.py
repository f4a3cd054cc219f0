"""Loading backbone groups in this process's reach: which models load at start and which is the default, a group's
backbone loaded where the settings say (in this process, in a process of its own, or in several) with its batcher,
and what a served model's metrics say. Model control (:mod:`service.serving.models.control`) loads through it while
the server runs."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from service.config import Settings, cuda_here
from service.modeling.manifest import WEIGHTS, ModelLoadError, discover, read_manifest
from service.serving.core.keys import backbone_key, model_of
from service.serving.engine.batcher import Batcher, BatchLimits
from service.serving.engine.compute import Compute
from service.serving.engine.group import BackboneGroup, LocalGroup
from service.serving.engine.pipe import BucketPlan
from service.serving.engine.process import BackboneProcess, Launches
from service.serving.engine.replicas import Replicas
from service.serving.models.registry import Registry
from service.serving.observe import tracing
from service.serving.observe.metrics import Metrics

log = logging.getLogger("service.loader")
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


def label_metrics(settings: Settings, metrics: Metrics, names: list[str]) -> None:
    """The models with series of their own (``metrics_models``; ``names``: those served at start)."""
    chosen = settings.metrics_models
    metrics.label_models(None if chosen == ["all"] else names if chosen == ["pinned"] else chosen)


def publish(registry: Registry, metrics: Metrics, group: BackboneGroup, name: str, folder: Path,
            seconds: float) -> None:
    """Model ``name`` (its folder ``folder``) now serves on ``group``: its metrics; the default model, when the
    server started without one, is the first to serve."""
    if registry.default_model is None:
        registry.default_model = name
        log.info("default model (behind /v1/classify and /v1/explain): %s, the first model to serve", name)
    weights = folder / WEIGHTS
    metrics.loaded(name, group.planner.manifests[registry.heads[name]].backbone.name, group.device, group.dtype,
                   seconds, weights.stat().st_size if weights.is_file() else 0)


class Loader:
    """Starts backbone groups as the settings say, registering each in ``registry`` and its metrics in ``metrics``;
    the processes it starts are in :attr:`launches` while they load (a server shutting down stops them there)."""

    def __init__(self, settings: Settings, registry: Registry, metrics: Metrics) -> None:
        self.settings, self.registry, self.metrics = settings, registry, metrics
        self.launches = Launches()

    def model_names(self, pinned: list[str] | None) -> list[str]:
        """The models to load at start: ``models``, or every folder of the repository (``pinned``, with a head
        cache: only those, the others load on demand)."""
        repository = self.settings.model_repository
        available = discover(repository)
        wanted = pinned if pinned is not None else self.settings.models or available
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

    async def start_group(self, folders: list[Path], keys: list[str] | None = None) -> LocalGroup:
        """Load the models of ``folders`` (naming one backbone) on a new backbone group, each head under its key
        in ``keys`` (default: its model's name), start its batcher and serve them.

        Raises:
            ModelLoadError, ModelProcessError, NonFiniteScores: the models could not load (nothing is served).
        """
        s = self.settings
        t0 = time.perf_counter()
        log.info("loading models %s on one backbone", [f.name for f in folders])
        engine = await asyncio.get_running_loop().run_in_executor(None, self._load, folders, keys)
        await engine.attach()  # its processes' pipes read on this loop: the batcher awaits their batches here
        engine.name = self.registry.unique_name(engine.name, engine.key[0])
        device = str(engine.device)
        size, tokens = s.batch_limits(device)
        limits = BatchLimits(max_batch_size=size, max_batch_tokens=tokens, max_wait_s=s.batch_wait_ms(device) / 1000,
                             max_queue=s.max_queue)
        observer = self.metrics.observer(engine.name, engine.runner_devices)
        if tracing.enabled():  # each batch's span, linked to its texts' requests
            observer = tracing.TracedBatches(observer, engine.name)
        batcher = Batcher(engine.runners, limits, observer, engine.name)
        batcher.start()
        group = LocalGroup(engine, batcher)
        self.registry.add(group)
        seconds = time.perf_counter() - t0
        for folder, key in zip(folders, engine.models, strict=True):
            publish(self.registry, self.metrics, group, model_of(key), folder, seconds)
        log.info("backbone %s with models %s ready on %s in %.1f s", engine.name, engine.models, engine.device,
                 seconds)
        return group

    def _load(self, folders: list[Path], keys: list[str] | None = None) -> Compute:
        """The models of ``folders`` on one backbone (heads under ``keys``), as the settings say: in this process,
        a process of its own, or several."""
        s = self.settings
        devices = s.engine_devices()
        plan = bucket_plan(s, devices[0])
        if not s.model_process:
            from service.serving.engine.engine import Engine  # torch, in this process only then

            return Engine.load(folders, devices[0], s.dtype, s.warmup, keys, plan, s.batch_invariance)
        in_flight = s.in_flight(devices[0])
        if len(devices) > 1:
            return Replicas(folders, devices, s.dtype, s.warmup, s.torch_threads, keys, self.launches, plan,
                            in_flight, s.batch_invariance)
        return BackboneProcess(folders, devices[0], s.dtype, s.warmup, s.torch_threads, keys=keys,
                               launches=self.launches, buckets=plan, in_flight=in_flight,
                               batch_invariance=s.batch_invariance)


def bucket_plan(settings: Settings, device: str) -> BucketPlan:
    """The shape buckets ``settings`` ask of a backbone on ``device`` (``auto``: a GPU where there is one), chosen for
    the batcher's limits there."""
    resolved = device if device != "auto" else ("cuda" if cuda_here() else "cpu")
    size, tokens = settings.batch_limits(resolved)
    return BucketPlan(settings.buckets, size, tokens)
