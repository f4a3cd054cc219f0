"""A backbone group loaded where it computes: the planning of a :class:`~service.serving.engine.planner.Planner` and
the weights behind it. :class:`~service.serving.engine.engine.Engine` computes in this process,
:class:`~service.serving.engine.process.BackboneProcess` in a process of its own and
:class:`~service.serving.engine.replicas.Replicas` in several; the batcher runs each batch on one of their
:attr:`Compute.runners`, and model control loads and drops heads on them."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from service.serving.core.results import Answer
from service.serving.core.work import ChunkWork
from service.serving.engine.planner import Planner

Runner = Callable[[list[ChunkWork]], list[Answer | None]]
"""Computes a batch of chunks, each text completed in it answered at its last chunk's place (None elsewhere)."""
AsyncRunner = Callable[[list[ChunkWork]], Awaitable[list[Answer | None]]]
"""A :data:`Runner` the event loop awaits (a batch computed in another process, whose pipe the loop reads)."""


class Compute(Planner, abc.ABC):
    """A backbone group's planning and what computes it: its weights, loaded somewhere."""

    device: Any  # where the heads compute (``torch.device`` in this process, its name for a process of its own)
    dtype: Any
    takes_runs = False
    """Whether its runners take runs of plain texts (:class:`~service.serving.core.work.PlainRun`) beside chunks."""

    @abc.abstractmethod
    def add_heads(self, folders: Sequence[Path], keys: Sequence[str], warmup: bool = True) -> None:
        """Load the heads of ``folders`` (models naming this backbone) onto it under ``keys``: all or none, while
        batches go on.

        Raises:
            ModelLoadError: a folder is damaged or names another backbone.
            NonFiniteScores, ModelProcessError: a head failed its warm-up, or the backbone's process failed.
        """

    @abc.abstractmethod
    def remove_heads(self, keys: Sequence[str]) -> None:
        """Drop these heads (the caller has answered all their work); their memory goes with them."""

    @abc.abstractmethod
    def run_chunks(self, works: list[ChunkWork]) -> list[Answer | None]:
        """Compute a batch of chunks; each text completed in it is answered at its last chunk's place."""

    @abc.abstractmethod
    def describe(self, model: str) -> dict[str, Any]:
        """What ``/v1/models`` says of head ``model``."""

    @abc.abstractmethod
    def device_memory(self) -> list[dict[str, float | str]]:
        """CUDA memory of the devices this backbone's process uses (empty on CPU)."""

    async def attach(self) -> None:
        """Compute on behalf of the running event loop from now on (before the loop's batcher takes
        :attr:`runners`): nothing to do where the weights are in this process."""

    @property
    def runners(self) -> list[Runner] | list[AsyncRunner]:
        """What computes batches, one batch at a time each: the batcher sends each batch to a free one and
        keeps a text's chunks on one (it holds their states until the last). Functions the batcher calls in a
        worker thread, or coroutine functions it awaits on its loop (once :meth:`attach` made them so)."""
        return [self.run_chunks]

    @property
    def runner_devices(self) -> list[str]:
        """The device each of :attr:`runners` computes on."""
        return [str(self.device)]

    def resident_bytes(self) -> int | None:
        """Resident memory of the backbone's own processes (None: it computes in the server's process)."""
        return None

    def restarts(self) -> int:
        """Times the backbone's own processes were started again after exiting (0: it computes in the server's
        process)."""
        return 0

    def close(self) -> None:
        """Release what the backbone holds beyond this object (a process of its own)."""
