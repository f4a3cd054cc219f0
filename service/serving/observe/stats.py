"""Per-model inference statistics in the shape of Triton's statistics extension (``GET /v2/models/stats``):
counts and cumulative nanoseconds, fed by the inference layer (requests answered or failed) and the batchers
(queue waits, batches). No torch, no HTTP."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Duration:
    """How many, and their total time in nanoseconds (Triton's ``StatisticDuration``)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStats:
    """One model's figures since it was first loaded (a reload keeps them; an unload drops them).

    ``success`` / ``fail``: requests that asked the model, answered or failed, with their time in the server
    (a request asking several models counts once for each); ``queue``: chunks, with the time each waited for
    its batch; ``compute_infer``: batches that ran the model, with their compute time (a batch's time counts
    whole for each model it ran); ``inference_count``: texts answered; ``execution_count``: those batches."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    by_batch_size: dict[int, Duration] = field(default_factory=dict)

    def json(self, name: str) -> dict[str, Any]:
        zero = Duration().json()
        return {
            "name": name, "version": "1", "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count, "execution_count": self.execution_count,
            "inference_stats": {"success": self.success.json(), "fail": self.fail.json(), "queue": self.queue.json(),
                                "compute_input": zero, "compute_infer": self.compute_infer.json(),
                                "compute_output": zero, "cache_hit": zero, "cache_miss": zero},
            "batch_stats": [{"batch_size": size, "compute_input": zero, "compute_infer": d.json(),
                             "compute_output": zero} for size, d in sorted(self.by_batch_size.items())],
        }


class InferenceStats:
    """Every model's :class:`ModelStats`, by model name."""

    def __init__(self) -> None:
        self.models: dict[str, ModelStats] = {}

    def loaded(self, name: str) -> None:
        self.models.setdefault(name, ModelStats())

    def unloaded(self, name: str) -> None:
        self.models.pop(name, None)

    def answered(self, models: Iterable[str], seconds: float, ok: bool) -> None:
        """A request that asked ``models`` was answered (``ok``) or failed after ``seconds``."""
        for name in models:
            stats = self.models.get(name)
            if stats is not None:
                (stats.success if ok else stats.fail).add(seconds)

    def batch(self, chunks: Counter[str], texts: Counter[str], waits: dict[str, float], size: int,
              seconds: float) -> None:
        """A batch of ``size`` chunks ran: per model, its chunks, the texts it answered and the chunks' total
        wait in the queue."""
        now_ms = int(time.time() * 1000)
        for name, n in chunks.items():
            stats = self.models.get(name)
            if stats is None:
                continue
            stats.queue.add(waits.get(name, 0.0), n)
            if texts.get(name):
                stats.inference_count += texts[name]
                stats.last_inference_ms = now_ms
            stats.execution_count += 1
            stats.compute_infer.add(seconds)
            stats.by_batch_size.setdefault(size, Duration()).add(seconds)

    def json(self, names: Iterable[str]) -> dict[str, Any]:
        """Triton's ``{"model_stats": [...]}`` for ``names``."""
        return {"model_stats": [self.models.get(n, ModelStats()).json(n) for n in names]}
