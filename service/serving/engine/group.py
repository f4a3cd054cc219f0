"""One backbone group as the request pipeline reaches it: the interface (:class:`BackboneGroup`) and its local
implementation (:class:`LocalGroup`: the loaded backbone and its batcher, in this process's reach). The remote one,
a front's side of a group on the engine host, is :class:`~service.serving.remote.client.RemoteGroup`.

The pipeline plans a text's jobs with the group's :attr:`~BackboneGroup.planner` and submits them; each job comes
back answered, whether its chunks were batched here or on the host. A submission is a future, not a coroutine: the
engine host answers every front's requests from callbacks, with no task a request."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np

from service.serving.core.results import Answer, Scores, WorkAnswer, answers_of
from service.serving.core.work import RUN_TEXTS, PlainRun, TextJob, Work
from service.serving.engine.batcher import Batcher
from service.serving.engine.compute import Compute
from service.serving.engine.planner import Planner
from service.serving.engine.scores import read_answers


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
    batcher: Batcher[Work, WorkAnswer]

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

    def submit_plain(self, ids: np.ndarray, lengths: np.ndarray, model: str | None, deadline: float
                     ) -> asyncio.Future[Scores | list[Answer]]:
        """:meth:`submit` for plain texts given side by side (token ids ``ids [T]`` back to back, ``lengths [s]``,
        each asking head ``model`` for its scores alone): runs of them (:class:`PlainRun`) where the engine takes
        them, a unit of the batcher's each, with no object a text, answered with their :class:`Scores` unread where
        every run's came so (see :func:`_joined`); else a job each, answered as :meth:`submit`."""
        if not self.engine.takes_runs:
            return self.submit(PlainRun(ids, lengths, model, 0, 0).jobs(), deadline)
        limits = self.batcher.limits
        runs = PlainRun.split(ids, lengths, model, min(RUN_TEXTS, limits.max_batch_size),
                              limits.max_batch_tokens // 4)  # (at most a quarter of a batch: one left out of a
        # batch that it does not fit into leaves little room unused)
        try:
            return self.batcher.enqueue(runs, [r.cost for r in runs], deadline, functools.partial(_joined, self.engine),
                                        sizes=[r.size for r in runs], peaks=[r.peak for r in runs])
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


def _joined(planner: Planner, runs: list[WorkAnswer]) -> Scores | list[Answer]:
    """A plain request's answer from its runs': their :class:`Scores` as one where each run's came so, on one head
    (the front that asked reads them); else each text's :data:`Answer`, the scores read here."""
    if all(type(r) is Scores for r in runs) and len({cast(Scores, r).key for r in runs}) == 1:
        blocks = cast(list[Scores], runs)
        return blocks[0] if len(blocks) == 1 else Scores(np.concatenate([r.logits for r in blocks]), blocks[0].key)
    answers: list[Answer] = []
    for r in runs:
        if type(r) is Scores:
            answers.extend(read_answers(r, planner.manifests))
        else:
            answers.extend(cast(list[Answer], r))
    return answers
