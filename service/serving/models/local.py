"""The engine side in this process's reach (:class:`LocalEngine`): the models of the settings loaded on backbone
groups (computing here, or in processes this one starts), controlled at runtime, heads cached within a budget. A
one-front server's app and the engine host behind several fronts both serve through it; a front of several reaches
the host's instead (:class:`~service.serving.remote.client.RemoteEngine`)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from service.config import Settings
from service.serving.core.lifecycle import Lifecycle
from service.serving.engine.group import LocalGroup
from service.serving.engine.process import BackboneProcess
from service.serving.engine.replicas import Replicas
from service.serving.models.cache import HeadCache
from service.serving.models.control import ModelControl
from service.serving.models.loader import LOADED_LATER, Loader, label_metrics, may_start_empty
from service.serving.models.registry import Registry
from service.serving.observe.metrics import Metrics

log = logging.getLogger("service.models")


class LocalEngine:
    """The models of ``settings`` in ``registry``, loaded from this process.

    Args:
        announce: tells whoever serves beside this process what it serves now (an engine host's fronts), once
            they serve it; called after every change of models.
    """

    def __init__(self, settings: Settings, registry: Registry, metrics: Metrics, lifecycle: Lifecycle,
                 announce: Callable[[], Awaitable[None]] | None = None) -> None:
        self.settings, self.registry, self.metrics, self.lifecycle = settings, registry, metrics, lifecycle
        self.loader = Loader(settings, registry, metrics)
        self.control = ModelControl(settings, registry, self.loader, metrics, announce)
        budget = settings.head_cache_bytes
        default = registry.default_model
        pinned = settings.models or ([default] if default is not None else [])
        self.cache = None if budget is None else HeadCache(settings.model_repository, registry, self.control, metrics,
                                                           budget, pinned)
        self.control.cache = self.cache

    async def start(self) -> None:
        """Load, warm up and start every backbone group; the lifecycle says how it went (on failure, why: the server
        then exits). A server stopped while loading (:meth:`stop_loading`) has no failure."""
        s = self.settings
        try:
            if not s.model_process:  # torch computes in this process (else each backbone's process sets its own)
                from service.threads import set_torch_threads

                threads = set_torch_threads(s.torch_threads)
                log.info("torch intra-op threads: %d; OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s", threads,
                         os.environ.get("OMP_WAIT_POLICY", "(runtime default)"),
                         os.environ.get("GOMP_SPINCOUNT", "(runtime default)"))
            names = self.loader.model_names(sorted(self.cache.pinned) if self.cache is not None else None)
            label_metrics(s, self.metrics, names)
            if not names and not may_start_empty(s):
                raise ValueError(f"no models in {s.model_repository} (ROUTING_MODEL_CONTROL=poll or explicit, or a "
                                 "head cache, ROUTING_HEAD_CACHE_BYTES, starts a server without any to load them while "
                                 "it runs)")
            if not names:
                log.warning("no models in %s yet: the server starts without any; %s", s.model_repository,
                            LOADED_LATER["cache" if self.cache is not None else s.model_control])
            elif self.registry.default_model not in names:
                raise ValueError(f"default model {self.registry.default_model!r} (behind /v1/classify and "
                                 f"/v1/explain) is not among the models to serve, {names} of {s.model_repository}: "
                                 "ROUTING_DEFAULT_MODEL names it")
            for folders in self.loader.backbone_groups(names):
                await self.loader.start_group(folders)
            self.control.start()
            if self.cache is not None:
                self.cache.start()
            self.lifecycle.loaded()
        except Exception as e:
            if self.loader.launches.stopped:  # the server stopped it: shutting down while loading is no failure
                log.info("loading stopped: the server is shutting down")
                return
            self.lifecycle.fail(f"{type(e).__name__}: {e}")
            log.error("model loading failed: %s", self.lifecycle.error)

    def stop_loading(self) -> int:
        """Stop the backbone processes still loading, and any started from now on; how many were loading."""
        return self.loader.launches.stop()

    @property
    def loading_stopped(self) -> bool:
        return self.loader.launches.stopped

    async def close(self, timeout_s: float) -> None:
        """Stop every backbone process still loading, stop every batcher, answering what is still queued within
        ``timeout_s``; close the backbones."""
        if loading := self.stop_loading():
            log.info("stopped %d backbone process%s still loading", loading, "es" * (loading > 1))
        await self.control.stop()
        if self.cache is not None:
            await self.cache.stop()
        groups = [g for g in self.registry.groups.values() if isinstance(g, LocalGroup)]
        for group in groups:
            await group.stop(timeout_s)
        loop = asyncio.get_running_loop()  # side by side: each backbone's process exits on its own time
        await asyncio.gather(*(loop.run_in_executor(None, g.close) for g in groups))

    async def scrape(self) -> bytes:
        """Readings of processes beside this one for ``/metrics``: none (this process's registry has them all)."""
        return b""

    def device_memory(self) -> list[dict[str, float | str]]:
        """CUDA memory per device over the backbones' processes (this one's only when a backbone computes here,
        so that a scrape never opens a CUDA context in the server's process): amounts summed."""
        engines = [g.engine for g in self.registry.groups.values() if isinstance(g, LocalGroup)]
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
        readings = [(name, g.engine.resident_bytes(), g.engine.restarts())
                    for name, g in self.registry.groups.items() if isinstance(g, LocalGroup)]
        return [(name, float(rss), restarts) for name, rss, restarts in readings if rss is not None]
