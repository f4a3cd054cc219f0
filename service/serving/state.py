"""What the app holds while it runs: settings, metrics, and one engine + batcher per model.
Loading happens in the background so /healthz answers at once and /readyz says when it is done."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from service.config import Settings
from service.modeling.repository import discover
from service.serving.batcher import Batcher, BatchLimits
from service.serving.contract import ChunkWork, Result
from service.serving.engine import Engine, Planner, device_memory
from service.serving.metrics import Metrics
from service.serving.worker import ModelProcess, Replicas
from service.threads import set_torch_threads

log = logging.getLogger("service.state")


@dataclass
class Served:
    engine: Planner  # an Engine in this process, a ModelProcess, or Replicas
    batcher: Batcher[ChunkWork, Result | None]


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    models: dict[str, Served] = field(default_factory=dict)
    # the one owner of the server's state: loading -> ok -> draining -> stopped, or loading -> failed
    status: Literal["loading", "ok", "draining", "stopped", "failed"] = "loading"
    error: str | None = None
    in_flight: int = 0

    @property
    def ready(self) -> bool:
        return self.status == "ok"

    def model_names(self, repository: Path) -> list[str]:
        available = discover(repository)
        wanted = self.settings.models or available
        unknown = sorted(set(wanted) - set(available))
        if unknown:
            raise ValueError(f"models {unknown} not found in {repository} (available: {available})")
        return list(wanted)

    async def load(self) -> None:
        """Load, warm up and start every model; on failure record why (the server then exits)."""
        s = self.settings
        loop = asyncio.get_running_loop()
        try:
            threads = set_torch_threads(s.torch_threads)
            log.info("torch intra-op threads: %d; OMP_WAIT_POLICY=%s", threads,
                     os.environ.get("OMP_WAIT_POLICY", "(runtime default)"))
            names = self.model_names(s.model_repository)
            if not names:
                raise ValueError(f"no models in {s.model_repository}")
            if s.default_model not in names:
                raise ValueError(f"default model {s.default_model!r} is not among the loaded models {names}")
            for name in names:
                t0 = time.perf_counter()
                log.info("loading model %s", name)
                folder = s.model_repository / name
                engine = await loop.run_in_executor(None, self._load_model, folder)
                limits = BatchLimits(max_batch_size=s.max_batch_size, max_batch_tokens=s.max_batch_tokens,
                                     max_wait_s=s.max_wait_ms / 1000, max_queue=s.max_queue)
                batcher: Batcher[ChunkWork, Result | None] = Batcher(engine.runners, limits,
                                                                     self.metrics.observer(name), name)
                batcher.start()
                self.models[name] = Served(engine, batcher)
                self.metrics.model_load.labels(name).set(time.perf_counter() - t0)
                self.metrics.model_info.labels(name, engine.manifest.backbone.name, str(engine.device),
                                               str(engine.dtype).removeprefix("torch.")).set(1)
                log.info("model %s ready on %s in %.1f s", name, engine.device, time.perf_counter() - t0)
            self.status = "ok"
        except Exception as e:
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("model loading failed: %s", self.error)

    def _load_model(self, folder: Path) -> Planner:
        """The model in ``folder`` as the settings say: in this process, a process of its own, or several."""
        s = self.settings
        if not s.model_process:
            return Engine.load(folder, s.device, s.dtype, s.warmup)
        if s.model_replicas > 1:
            return Replicas(folder, s.device, s.dtype, s.warmup, s.torch_threads, s.model_replicas)
        return ModelProcess(folder, s.device, s.dtype, s.warmup, s.torch_threads)

    def start_draining(self) -> None:
        """New requests get 503 from here on; requests already being handled still reach the batcher."""
        if self.status in ("ok", "loading"):
            self.status = "draining"
        for served in self.models.values():
            served.batcher.flush()

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and all(m.batcher.idle for m in self.models.values())

    def device_memory(self) -> list[dict[str, float | str]]:
        """CUDA memory per device over the models' processes (this one's only when a model computes here,
        so that a scrape never opens a CUDA context in the server's process): amounts summed."""
        own = any(isinstance(m.engine, Engine) for m in self.models.values())
        readings = (device_memory() if own else []) + [
            d for m in self.models.values() if not isinstance(m.engine, Engine) for d in m.engine.device_memory()]
        merged: dict[str, dict[str, float | str]] = {}
        for d in readings:
            if d["device"] not in merged:
                merged[d["device"]] = dict(d)
                continue
            into = merged[d["device"]]
            for key in ("allocated", "reserved", "peak"):
                into[key] = float(into[key]) + float(d[key])
        return list(merged.values())

    def model_memory(self) -> list[tuple[str, float]]:
        """Resident memory of each model's own processes, summed over its replicas (none for models computing
        in this one)."""
        readings = [(name, m.engine.resident_bytes()) for name, m in self.models.items()]
        return [(name, float(rss)) for name, rss in readings if rss is not None]

    def abort(self, reason: str) -> int:
        """Answer every text still queued or computing with 'shutting down' (503); how many there were."""
        return sum(served.batcher.abort(reason) for served in self.models.values())

    async def close(self, timeout_s: float) -> None:
        """Stop every batcher, answering what is still queued within ``timeout_s``; close the models."""
        for served in self.models.values():
            await served.batcher.stop(timeout_s)
        loop = asyncio.get_running_loop()  # side by side: each model's process exits on its own time
        await asyncio.gather(*(loop.run_in_executor(None, served.engine.close) for served in self.models.values()))
        if self.status != "failed":
            self.status = "stopped"
