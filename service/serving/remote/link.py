"""A front's connection to the engine host (``ROUTING_WORKERS`` > 1): requests out as typed messages
(:mod:`service.serving.remote.wire`), each answered to the coroutine that sent it; the host's models served as they
change (the front's :class:`~service.serving.remote.client.RemoteEngine` says how)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from service.serving.core.results import Answer, Scores
from service.serving.core.work import TextJob
from service.serving.engine.batcher import DeadlineExceeded, Draining, Overloaded
from service.serving.remote.wire import (
    TO_FRONT,
    Answered,
    Applied,
    Cancel,
    Control,
    Controlled,
    Frames,
    Hello,
    Models,
    Outbox,
    Refused,
    Run,
    Scrape,
    Scraped,
    ToFront,
    frame,
    read_to_front,
)

log = logging.getLogger("service.fronts")


class HostGone(Draining):
    """The engine host closed the connection (it exited): what waits on it is refused as a draining server's."""


ReadScores = Callable[[Scores], list[Answer]]
"""How a front reads a plain request's scores into its texts' answers (with the manifests of the heads it serves)."""
ServeModels = Callable[["HostLink", Models], Awaitable[None]]
"""What a front does with the host's :class:`Models`: serve what they say (see :func:`serve_models`)."""


class HostLink:
    """A front's connection to the engine host: requests out, each answered to the coroutine that sent it; the
    host's models served as they change."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_models: ServeModels) -> None:
        self._reader, self._writer, self._on_models = reader, writer, on_models
        self._out = Outbox(writer)  # every message of one event-loop turn in one write
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._reads: dict[int, ReadScores] = {}  # requests of plain texts: how their scores are read
        self._ids = itertools.count()
        self._listener: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, path: Path, front: int, on_models: ServeModels) -> HostLink:
        """The link to the host at ``path``, once ``on_models`` has served what the host serves."""
        reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
        writer.write(frame(Hello(front)))
        models = await read_to_front(reader)
        if not isinstance(models, Models):
            raise HostGone("the engine host did not say what it serves")
        link = cls(reader, writer, on_models)
        await on_models(link, models)
        link._listener = asyncio.create_task(link._listen(), name="host-link")
        return link

    @property
    def closed(self) -> bool:
        return self._listener is None or self._listener.done()

    async def _listen(self) -> None:
        frames = Frames(TO_FRONT)  # every message the bytes of one read hold, with one await for them all
        try:
            while data := await self._reader.read(1 << 20):
                for msg in frames.feed(data):
                    await self._received(msg)
        except ConnectionError:
            pass
        for future in self._waiting.values():  # the host has gone: nothing will answer these
            if not future.done():
                future.set_exception(HostGone("the engine host exited while this request was computed"))
        self._waiting.clear()

    async def _received(self, msg: ToFront) -> None:
        if isinstance(msg, Models):
            try:
                await self._on_models(self, msg)
            except Exception:  # the front serves what it could; the host's next change comes
                log.exception("serving the engine host's models version %d failed", msg.version)
            self._out.put(Applied(msg.version))
            return
        future = self._waiting.pop(msg.id, None)
        if future is None or future.done():
            return
        if isinstance(msg, Answered):
            read = self._reads.pop(msg.id, None)
            if msg.scores is None:
                future.set_result(msg.answers)
            elif read is None:
                future.set_exception(RuntimeError("the engine host answered scores to a request that sent jobs"))
            else:
                try:
                    future.set_result(read(msg.scores.scores()))
                except Exception as e:  # (the host's bytes did not read: the request fails, the front goes on)
                    future.set_exception(e)
        elif isinstance(msg, Controlled | Scraped):
            future.set_result(msg)
        else:
            future.set_exception(_refusal(msg))

    def send(self, backbone: str, jobs: Sequence[TextJob], deadline: float, read: ReadScores
             ) -> asyncio.Future[list[Answer]]:
        """Send the jobs of one request to the host (plain texts as such, see :class:`~wire.Plain`): the future of
        each job's answer (in order; ``read`` reads plain texts' scores where the host answers them unread).
        Cancelling it, or answering it with an exception here, drops the request on the host.

        Raises:
            HostGone: the host has exited.
        """
        k, future = self._ask(lambda k: Run.of(k, backbone, jobs, deadline))
        self._reads[k] = read
        future.add_done_callback(lambda _: self._drop(k))
        return future

    def _ask(self, message: Callable[[int], Run | Control | Scrape]) -> tuple[int, asyncio.Future[Any]]:
        """Send ``message(k)`` under a new request number ``k``: ``k``, and the future its answer sets."""
        if self.closed:
            raise HostGone("the engine host has exited")
        k = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[k] = future
        self._out.put(message(k))
        return k, future

    def _drop(self, k: int) -> None:
        """Request ``k`` was settled here, not by the host's answer (its caller went away, or the front answered it
        while draining): the host drops it."""
        self._reads.pop(k, None)
        if self._waiting.pop(k, None) is not None and not self.closed:
            self._out.put(Cancel(k))

    async def control(self, op: Literal["index", "load", "unload", "stats"], name: str = "", ready_only: bool = False,
                      names: list[str] | None = None) -> Controlled:
        """A repository request carried out by the host (for every front at once), or the models' statistics."""
        _, future = self._ask(lambda k: Control(k, op, name, ready_only, names or []))
        answer: Controlled = await future
        return answer

    async def scrape(self) -> bytes:
        """The host's readings for ``/metrics`` (see :meth:`~service.serving.observe.metrics.Metrics.reading`)."""
        if self.closed:
            return b""
        _, future = self._ask(Scrape)
        answer: Scraped = await future
        return answer.text

    async def close(self) -> None:
        self._writer.close()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await self._listener


def _refusal(msg: Refused) -> Exception:
    """What the host's refusal is for the inference layer (the exceptions a batcher raises)."""
    if msg.kind == "overloaded":
        return Overloaded(msg.message)
    if msg.kind == "draining":
        return Draining(msg.message)
    if msg.kind == "deadline":
        return DeadlineExceeded(msg.message)
    return RuntimeError(msg.message)
