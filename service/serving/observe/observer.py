"""What a batcher reports of its batches (:class:`BatchObserver`), for the metrics and the traces to read: the
batcher itself knows nothing of either (see :mod:`service.serving.engine.batcher`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

P = TypeVar("P")
R = TypeVar("R")


class BatchObserver(Protocol[P, R]):
    """What the batcher reports, for metrics; every method must be cheap and never raise. ``payloads`` are
    the items concerned; ``results`` a batch's answers in the same order, None when the batch failed; ``runner`` the
    index of the runner that computed it."""

    def on_queue_depth(self, depth: int) -> None: ...
    def on_drop(self, reason: str, payloads: Sequence[P]) -> None: ...
    def on_batch(self, payloads: Sequence[P], results: Sequence[R] | None, cost: int,
                 waits: Sequence[float], seconds: float, runner: int) -> None: ...


class NullObserver(Generic[P, R]):
    """Reports to nobody."""

    def on_queue_depth(self, depth: int) -> None:
        pass

    def on_drop(self, reason: str, payloads: Sequence[P]) -> None:
        pass

    def on_batch(self, payloads: Sequence[P], results: Sequence[R] | None, cost: int,
                 waits: Sequence[float], seconds: float, runner: int) -> None:
        pass
