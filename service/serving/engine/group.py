"""One backbone group as the request pipeline reaches it: the interface (:class:`BackboneGroup`) and its local
implementation (:class:`LocalGroup`: the loaded backbone and its batcher, in this process's reach). The remote one,
a front's side of a group on the engine host, is :class:`~service.serving.remote.client.RemoteGroup`.

The pipeline plans a text's jobs with the group's :attr:`~BackboneGroup.planner` and submits them; each job comes
back answered, whether its chunks were batched here or on the host. A submission is a future, not a coroutine: the
engine host answers every front's requests from callbacks, with no task a request."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from service.serving.core.results import Answer, answers_of
from service.serving.core.work import ChunkWork, TextJob
from service.serving.engine.batcher import Batcher
from service.serving.engine.compute import Compute
from service.serving.engine.planner import Planner


class BackboneGroup(Protocol):
    """A loaded backbone group (a backbone and every head on it) as the pipeline and model metrics use it.

    Refusals are the batcher's exceptions (:class:`~service.serving.engine.batcher.Overloaded`, ``Draining``,
    ``DeadlineExceeded``); a batch that failed raises what it failed with."""

    @property
    def planner(self) -> Planner:
        """The models' manifests and the tokenizer: how texts become jobs."""
        ...

    @property
    def device(self) -> str:
        """Where the heads compute (a device's name)."""
        ...

    @property
    def dtype(self) -> str:
        """The backbone's precision (``float32``, ``bfloat16``, ...)."""
        ...

    def describe(self, key: str) -> dict[str, Any]:
        """What ``GET /v1/models/{model}`` says of head ``key``."""
        ...

    def check_room(self, n: int) -> None:
        """Raise ``Overloaded`` (or ``Draining``) unless ``n`` more texts may queue now."""
        ...

    def submit(self, jobs: Sequence[TextJob], deadline: float) -> asyncio.Future[list[Answer]]:
        """The future of every job computed (its chunks batched with other requests'): each job's answer in order, or
        the refusal or failure as its exception (never raised here); cancelling it drops what is still queued."""
        ...

    @property
    def idle(self) -> bool:
        """Nothing queued or computing for this group."""
        ...

    def flush(self) -> None:
        """Batches go without waiting to fill (the server drains)."""
        ...

    def abort(self, reason: str) -> int:
        """Answer everything queued or computing with ``Draining`` now; how many texts there were."""
        ...

    async def stop(self, timeout_s: float) -> None:
        """Take nothing more; answer what was accepted within ``timeout_s``, the rest with ``Draining``."""
        ...


def refused(exc: Exception) -> asyncio.Future[list[Answer]]:
    """A submission answered with ``exc`` at once (what :meth:`BackboneGroup.submit` returns when it cannot queue)."""
    future: asyncio.Future[list[Answer]] = asyncio.get_running_loop().create_future()
    future.set_exception(exc)
    return future


def credit_methods(group: BackboneGroup, key: str) -> list[str]:
    """The credit methods head ``key`` of ``group`` answers (see :meth:`BackboneGroup.describe`)."""
    return list(group.describe(key)["credit_methods"])


@dataclass
class LocalGroup:
    """A backbone group loaded from this process (computing in it, or in processes of its own that it started) and
    its batcher, which mixes the chunks of every head on it."""

    engine: Compute
    batcher: Batcher[ChunkWork, Answer | None]

    @property
    def planner(self) -> Planner:
        return self.engine

    @property
    def device(self) -> str:
        return str(self.engine.device)

    @property
    def dtype(self) -> str:
        return str(self.engine.dtype).removeprefix("torch.")

    def describe(self, key: str) -> dict[str, Any]:
        return self.engine.describe(key)

    def check_room(self, n: int) -> None:
        self.batcher.check_room(n)

    def submit(self, jobs: Sequence[TextJob], deadline: float) -> asyncio.Future[list[Answer]]:
        chunks = [w for job in jobs for w in job.chunks()]
        try:
            return self.batcher.enqueue(chunks, [w.cost for w in chunks], deadline, lambda got: answers_of(chunks, got),
                                        groups=[w.job for w in chunks])
        except Exception as e:  # refused (Overloaded, Draining)
            return refused(e)

    @property
    def idle(self) -> bool:
        return self.batcher.idle

    def flush(self) -> None:
        self.batcher.flush()

    def abort(self, reason: str) -> int:
        return self.batcher.abort(reason)

    async def stop(self, timeout_s: float) -> None:
        await self.batcher.stop(timeout_s)

    def close(self) -> None:
        """Release the backbone (its processes exit); after :meth:`stop`."""
        self.engine.close()
