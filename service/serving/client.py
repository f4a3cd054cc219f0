"""The engine client: one interface (:class:`EngineClient`) for what the app needs of the engine side, with a local
implementation (:class:`~service.serving.models.local.LocalEngine`: the models loaded from this process) and a remote
one (:class:`~service.serving.remote.client.RemoteEngine`: a front of several, over the engine host), chosen by
:func:`make_client` alone. Either fills the one :class:`~service.serving.models.registry.Registry` the request
pipeline reads, with groups of one interface (:class:`~service.serving.engine.group.BackboneGroup`)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from service.config import Settings
from service.serving.core.lifecycle import Lifecycle
from service.serving.models.cache import HeadCache
from service.serving.models.control import Control
from service.serving.models.local import LocalEngine
from service.serving.models.registry import Registry
from service.serving.observe.metrics import Metrics
from service.serving.remote.client import RemoteEngine


class EngineClient(Protocol):
    """The engine side as the app serves it."""

    @property
    def control(self) -> Control:
        """The repository requests (index, load, unload, statistics)."""
        ...

    @property
    def cache(self) -> HeadCache | None:
        """The head cache, when heads load on a request's demand."""
        ...

    async def start(self) -> None:
        """Load the models (or connect to what serves them) and fill the registry; the lifecycle says how it went."""
        ...

    def stop_loading(self) -> int:
        """Stop what is still loading (a server shutting down); how many backbone processes were."""
        ...

    @property
    def loading_stopped(self) -> bool:
        """Whether :meth:`stop_loading` was called."""
        ...

    async def close(self, timeout_s: float) -> None:
        """Answer what is still queued within ``timeout_s``; release the backbones (or the link)."""
        ...

    async def scrape(self) -> bytes:
        """Prometheus text of the readings only processes beside this one hold (the engine host's)."""
        ...

    def device_memory(self) -> list[dict[str, float | str]]:
        """CUDA memory per device of the backbones computing from here."""
        ...

    def backbone_processes(self) -> list[tuple[str, float, int]]:
        """Each backbone's own processes: its name, their resident memory, their restarts."""
        ...


def make_client(settings: Settings, registry: Registry, metrics: Metrics, lifecycle: Lifecycle,
                host: Path | None = None) -> EngineClient:
    """The engine client for a server of ``settings``: over the engine host at ``host`` (a front of several), else
    the models loaded from this process."""
    if host is not None:
        return RemoteEngine(settings, registry, metrics, lifecycle, host)
    return LocalEngine(settings, registry, metrics, lifecycle)
