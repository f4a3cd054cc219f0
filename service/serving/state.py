"""The composition root: what the app holds while it runs (settings, metrics, the lifecycle, the model registry, the
engine client chosen by :func:`~service.serving.client.make_client`, and the request pipeline over them), built once
per process. Loading happens in the background so /healthz answers at once and /readyz says when it is done."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from service.config import Settings
from service.serving.client import EngineClient, make_client
from service.serving.core.errors import APIError
from service.serving.core.lifecycle import Lifecycle
from service.serving.models.cache import HeadCache
from service.serving.models.control import Control
from service.serving.models.loader import default_model_at_start
from service.serving.models.registry import Registry
from service.serving.observe.metrics import Metrics
from service.serving.pipeline.inference import Inference


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    host: Path | None = None
    """The engine host's socket when this is one of several fronts (its models are served there), else None."""
    registry: Registry = field(init=False)
    client: EngineClient = field(init=False)
    inference: Inference = field(init=False)

    def __post_init__(self) -> None:
        self.registry = Registry(default_model_at_start(self.settings))
        self.client = make_client(self.settings, self.registry, self.metrics, self.lifecycle, self.host)
        self.inference = Inference(self.settings, self.lifecycle, self.registry, self.metrics.stats, self.client.cache)

    @property
    def control(self) -> Control:
        return self.client.control

    @property
    def cache(self) -> HeadCache | None:
        return self.client.cache

    @property
    def default_model(self) -> str | None:
        """The model behind /v1/classify and /v1/explain; None while no model has served yet in a server started
        without any."""
        return self.registry.default_model

    def default(self) -> str:
        """The model behind /v1/classify and /v1/explain: 404 while there is none (a server started without
        models, none served since)."""
        if self.registry.default_model is None:
            raise APIError(404, "no default model: the server started without models and none has served since "
                                "(GET /v1/models lists those loaded; /v1/models/{model}/... names one)")
        return self.registry.default_model

    async def load(self) -> None:
        """Load (or connect to) the models; on failure the lifecycle says why (the server then exits)."""
        await self.client.start()

    def start_draining(self) -> None:
        """New requests get 503 from here on; requests already being handled still reach the batchers."""
        self.lifecycle.drain()
        self.registry.flush()

    @property
    def idle(self) -> bool:
        return self.lifecycle.in_flight == 0 and self.registry.idle

    def device_memory(self) -> list[dict[str, float | str]]:
        return self.client.device_memory()

    def backbone_processes(self) -> list[tuple[str, float, int]]:
        return self.client.backbone_processes()

    def abort(self, reason: str) -> int:
        """Answer every text still queued or computing with 'shutting down' (503); how many there were."""
        return self.registry.abort(reason)

    async def close(self, timeout_s: float) -> None:
        """Answer what is still queued within ``timeout_s``, release the backbones (or the link to the host)."""
        await self.client.close(timeout_s)
        self.lifecycle.stop()
