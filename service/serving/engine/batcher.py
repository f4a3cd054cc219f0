"""A dynamic batcher: asyncio only, no torch and no HTTP.

Callers ``submit`` a request's items (each with a cost, e.g. its token count, and a group, e.g. the
text it is a part of) and await their results, or ``enqueue`` them and get the future of their results (no task
waits: the items' answers settle it, a timer its deadline). An item may hold several parts (its size, e.g. several
texts of one request side by side, each costing at most its peak). One worker task forms batches under
``max_batch_size`` parts and ``max_batch_tokens`` of cost in all (a request's items together, none with a part much
costlier than the batch's first), and runs each batch through a synchronous ``run_batch`` callable in a worker
thread, so the event loop keeps answering (health checks, metrics) while the model computes; or awaits it on the loop
where it is a coroutine function (a model computing in another process, whose pipe the loop reads: no thread a
batch).

A free runner lets its next batch fill while items keep arriving, at most ``max_wait_s`` apart,
counted from the first to arrive after it became free: the answers of the batch it just computed are
on their way to their clients, whose next requests follow (a batch that went as soon as the runner was
free would hold only what arrived while the last one computed: in a closed loop of c clients, about
c/2). The fill is capped at a tenth of the last batch's compute time (or ``max_wait_s``), and a batch
goes at once when it is full, or as large as the largest of the last few batches with an item that
arrived after the runner became free: one request at a time is never held back, nor are clients that
all came back. Where items do not follow answers (over the last few batches, requests came no faster
in the cap after a batch's end than while it computed: independent arrivals), the wait counts from the
oldest item's arrival instead, and what queued while the model computed goes as soon as it is free.

Several runners (e.g. replicas of a model, each in a process of its own) may be given instead of one
``run_batch``: each computes one batch at a time, and a batch goes to whichever is free. A group whose
items span several batches stays on the runner that took its first ones (a runner may keep state per
group, such as a long text's encoded chunks).

Groups share the worker fairly: each batch is built around the oldest item of the group that has
waited longest since its last batch finished, so a group of many items (a long text's chunks) is
spread over several batches and a group that arrives meanwhile goes in the next one. ``run_batch``
may answer an item with None when it is part of a group answered through another of its items;
the observer gets each batch's payloads, results (None for a failed batch) and cost in all, and reads what it
counts from them.

Every accepted item gets exactly one answer: its result, the batch's exception, or
:class:`DeadlineExceeded`. Items whose caller went away (its request's future cancelled) or whose deadline
passed while queued are dropped before compute, and reported through ``on_drop``. An item's answer settles its
request directly, in the turn of the event loop that ends its batch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from service.serving.observe.observer import BatchObserver, NullObserver

P = TypeVar("P")
R = TypeVar("R")
T = TypeVar("T")
log = logging.getLogger(__name__)
SIMILAR = 4  # an item joins a batch only if its peak is at most this many times the anchor's
FILL_SHARE = 0.1  # a free runner waits at most this share of its last batch's compute time for a batch to fill
RECENT = 4  # batches whose sizes tell how many items a batch may expect
BURST = 4  # requests follow answers when they come this many times faster after a batch's end than during it


class Overloaded(Exception):
    """The queue cannot take the request now; retry later."""


class Draining(Exception):
    """The batcher is shutting down and accepts nothing new."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its result was ready."""


@dataclass(eq=False, slots=True)
class _Item(Generic[P]):
    """Item ``k`` of ``request``: its answer settles the request directly (no future an item, no turn of the event
    loop between a batch's end and its requests' answers). ``size``: the parts it holds (each counts towards
    ``max_batch_size`` and the queue's limit); ``peak``: the cost of its costliest part (what ``SIMILAR`` compares)."""

    payload: P
    cost: int
    deadline: float
    request: _Request[Any, Any]
    k: int
    group: Hashable
    enqueued: float
    size: int = 1
    peak: int = 0


@dataclass
class _Pace:
    """Requests that arrived while one batch computed, and in the fill's cap after it ended."""

    during: int
    during_s: float
    after_s: float
    after: int = 0


@dataclass(frozen=True)
class BatchLimits:
    """Parts per batch (an item's size), their cost in all per batch, wait for a batch to fill, and groups queued
    (no defaults here: the service's come from its settings)."""

    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float
    max_queue: int


BatchRunner = Callable[[list[P]], list[R]] | Callable[[list[P]], Awaitable[list[R]]]
"""Computes a batch: ``run_batch(payloads) -> results`` (same length, same order), called in a worker thread, or a
coroutine function, awaited on the loop."""


class Batcher(Generic[P, R]):
    """Dynamic batching in front of ``run_batch(payloads) -> results`` (same length, same order)."""

    def __init__(self, run_batch: BatchRunner[P, R] | Sequence[BatchRunner[P, R]], limits: BatchLimits,
                 observer: BatchObserver[P, R] | None = None, name: str = "batcher") -> None:
        self.runners: list[BatchRunner[P, R]] = [run_batch] if callable(run_batch) else list(run_batch)
        if not self.runners:
            raise ValueError("a batcher needs at least one runner")
        self.limits, self.name = limits, name
        self.observer: BatchObserver[P, R] = observer or NullObserver()
        self._pending: list[_Item[P]] = []
        self._queued: Counter[Hashable] = Counter()  # group -> items in _pending (kept with every change)
        self._waiting = 0  # the parts of the items in _pending (kept with every change)
        self._extra = 0  # the parts of those items past their first: an item of several parts counts as that many
        # groups towards the queue's limit
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=len(self.runners), thread_name_prefix=f"batch-{name}")
        self._worker: asyncio.Task[None] | None = None
        self._batches: set[asyncio.Task[None]] = set()  # batches computing, one per busy runner
        self._accepting = True
        self._flush = False  # run batches without waiting for them to fill (shutting down)
        self._computing: dict[int, list[_Item[P]]] = {}  # busy runner -> its items, not yet answered
        self._answering: dict[int, list[_Item[P]]] = {}  # batches computed, their items being answered (by id)
        self._pinned: dict[Hashable, int] = {}  # group with items queued -> the runner that took its first ones
        self._served: dict[Hashable, float] = {}  # group -> when its last batch finished (groups still queued)
        self._freed = 0.0  # when a runner last became free (monotonic)
        self._arrived = 0.0  # when the last item was queued
        self._last_seconds = 0.0  # compute time of the last batch
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT)
        self._expected = 0  # items waiting when a runner last became free, and those it had just answered
        self._unfollowed = 0  # requests submitted so far that did not come within a fill's cap of a batch's end
        self._paces: collections.deque[_Pace] = collections.deque(maxlen=2 * RECENT)  # see _answer_driven
        self._depth_due = False  # the queue's depth is reported at the end of this turn of the loop

    @property
    def queue_depth(self) -> int:
        """Parts waiting (a text each, or a text's chunk)."""
        return self._waiting

    @property
    def idle(self) -> bool:
        return not self._pending and not self._computing and not self._answering

    @property
    def queued_groups(self) -> int:
        """Groups with items waiting, an item of several parts counting as that many (what ``max_queue`` limits: a
        text, however many chunks it has)."""
        return len(self._queued) + self._extra

    def check_room(self, n: int) -> None:
        """Raise what :meth:`submit` would for ``n`` new groups (call it before any work on them).

        Raises:
            Draining: the batcher is stopping.
            Overloaded: the queue has no room for ``n`` more groups.
        """
        if not self._accepting:
            raise Draining(f"{self.name} is draining")
        queued = self.queued_groups
        if queued + n > self.limits.max_queue:
            raise Overloaded(f"{self.name}: {queued} texts queued, limit {self.limits.max_queue}")

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    def enqueue(self, payloads: Sequence[P], costs: Sequence[int], deadline: float, finish: Callable[[list[R]], T],
                groups: Sequence[Hashable] | None = None, sizes: Sequence[int] | None = None,
                peaks: Sequence[int] | None = None) -> asyncio.Future[T]:
        """Queue one request's items: the future of ``finish`` of all their results, in order (``deadline`` is
        monotonic time; ``groups[k]``: the group of item k, default each item its own group; ``sizes[k]``: its parts,
        default 1, and ``peaks[k]``: its costliest part's cost, default its cost: an item of several parts is its own
        group). No task waits for them: the items' answers settle it (an engine host takes every front's requests on
        one event loop).

        The future's exception is the first an item got (the rest of the request is dropped), or
        :class:`DeadlineExceeded` once the deadline passes (what is left is dropped, counted as late); cancelling it
        drops what is still queued of the request (counted as gone: the caller went away).

        Raises:
            Overloaded: the queue has no room for all items (nothing is queued then).
            Draining: the batcher is stopping.
        """
        keys: Sequence[Hashable] = groups if groups is not None else [object() for _ in payloads]
        extra = 0 if sizes is None else sum(sizes) - len(sizes)
        self.check_room(len(set(keys)) + extra)
        sized = list(zip(payloads, [max(1, int(c)) for c in costs], keys, strict=True))  # (a bad cost raises here)
        now = time.monotonic()
        request: _Request[R, T] = _Request(asyncio.get_running_loop(), len(payloads), deadline, finish, now)
        if sizes is None:
            items = [_Item(p, c, deadline, request, k, g, now, 1, c) for k, (p, c, g) in enumerate(sized)]
        else:
            items = [_Item(p, c, deadline, request, k, g, now, n, max(1, int(top)))
                     for k, ((p, c, g), n, top) in enumerate(zip(sized, sizes, peaks or costs, strict=True))]
        self._pending.extend(items)
        self._waiting += len(items) + extra
        self._extra += extra
        if self._paces and self._freed < now <= self._freed + self._paces[-1].after_s:
            self._paces[-1].after += 1  # it follows the last batch's answers (not one more arrival during the next)
        else:
            self._unfollowed += 1
        self._arrived = now
        self._queued.update(it.group for it in items)
        self._report_depth()
        self._wakeup.set()
        return request.whole

    async def submit(self, payloads: Sequence[P], costs: Sequence[int], deadline: float,
                     groups: Sequence[Hashable] | None = None, sizes: Sequence[int] | None = None,
                     peaks: Sequence[int] | None = None) -> list[R]:
        """Queue one request's items and wait for all their results (see :meth:`enqueue`; a cancelled caller drops
        what is still queued of the request).

        Raises:
            Overloaded: the queue has no room for all items (nothing is queued then).
            Draining: the batcher is stopping.
            DeadlineExceeded: the deadline passed first.
        """
        return await self.enqueue(payloads, costs, deadline, _same, groups, sizes, peaks)

    async def stop(self, drain_timeout: float) -> None:
        """Stop accepting, answer what is queued (up to ``drain_timeout``), then stop the worker."""
        self._accepting = False
        self.flush()
        end = time.monotonic() + drain_timeout
        while not self.idle and time.monotonic() < end:
            await asyncio.sleep(0.01)
        self.abort("stopped before this text was computed")  # what is left, queued or computing
        for task in [*([self._worker] if self._worker is not None else []), *self._batches]:
            task.cancel()  # a batch's thread computes on, unanswered: its items were answered above
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._executor.shutdown(wait=False, cancel_futures=True)

    def abort(self, reason: str) -> int:
        """Stop accepting and answer every queued or computing item with :class:`Draining` now (a batch
        already computing finishes in its thread, unanswered). Returns how many items were answered."""
        self._accepting = False
        items = [it for it in [*self._pending, *(it for batch in self._computing.values() for it in batch)]
                 if not it.request.whole.done()]
        for it in items:
            it.request.fail(Draining(f"{self.name}: {reason}"))
        self._set_pending([])
        self._report_depth()
        return len(items)

    def flush(self) -> None:
        """Stop waiting for batches to fill: the server is draining and few new texts will come."""
        self._flush = True
        self._wakeup.set()

    def _drop_stale(self) -> None:
        """Drop items nobody waits for any more, and answer those past their deadline."""
        now = time.monotonic()
        keep: list[_Item[P]] = []
        gone: list[P] = []
        late: list[P] = []
        for it in self._pending:
            request = it.request
            if request.whole.done():  # the caller went away (or another item failed), or its deadline passed
                (late if request.expired else gone).append(it.payload)
            elif it.deadline <= now:
                request.fail(DeadlineExceeded("deadline passed while queued"), expired=True)
                late.append(it.payload)
            else:
                keep.append(it)
        if gone:
            self.observer.on_drop("disconnected", gone)
        if late:
            self.observer.on_drop("deadline", late)
        if gone or late:
            self._set_pending(keep)
            self._report_depth()

    def _take_batch(self, free: list[int]) -> tuple[int, list[_Item[P]]]:
        """A batch for one of the ``free`` runners: the anchor (the oldest item of the group that has
        waited longest since its last batch finished, among the items those runners may take), the rest of its
        request, then the queued items in the order they came (a request's items together), each at most
        ``SIMILAR`` times the anchor's cost, within both limits: a short text's batch never waits for a long
        text's chunks, and a request waits for one batch, not for every one. Empty when every queued item's group
        stays on a busy runner."""
        lim = self.limits
        pending = self._pending
        if pending and not self._pinned and self._waiting <= lim.max_batch_size:
            peaks = [it.peak for it in pending]
            if sum(it.cost for it in pending) <= lim.max_batch_tokens and max(peaks) <= SIMILAR * min(peaks):
                # all of it goes, whichever item anchors the batch (none is SIMILAR times costlier than another):
                # a queue that fits one batch, as it mostly does, is taken without ordering it (an engine host's
                # batch of 456 texts took 0.44 ms here with its stale check; the order of a batch changes no answer)
                self._set_pending([])
                return free[0], pending
        eligible = [it for it in pending if self._pinned.get(it.group, free[0]) in free]
        if not eligible:
            return free[0], []
        first = min(eligible, key=lambda it: (self._served.get(it.group, it.enqueued), it.enqueued))
        runner = self._pinned.get(first.group, free[0])
        # the anchor's request first, then the others in the order they came, each one's items together: a batch
        # holds whole requests but the last it reaches, which are answered as it ends (their clients' next requests
        # come while the next batch computes), where items sorted by cost spread every request over every batch
        rest = sorted((it for it in eligible if it is not first and self._pinned.get(it.group, runner) == runner),
                      key=lambda it: it.request is not first.request)
        batch, total, size = [first], first.cost, first.size
        for it in rest:
            if size >= lim.max_batch_size:
                break
            if it.peak > SIMILAR * first.peak:  # much costlier than the anchor: would slow its batch down
                continue
            if total + it.cost > lim.max_batch_tokens or size + it.size > lim.max_batch_size:
                continue
            batch.append(it)
            total += it.cost
            size += it.size
        chosen = set(map(id, batch))
        self._set_pending([it for it in self._pending if id(it) not in chosen])
        if len(self.runners) > 1:  # what is left of a group follows its first items
            self._pinned.update((it.group, runner) for it in batch if it.group in self._queued)
        return runner, batch

    def _set_pending(self, items: list[_Item[P]]) -> None:
        self._pending = items
        self._queued = Counter(it.group for it in items)
        self._waiting = sum(it.size for it in items)
        self._extra = self._waiting - len(items)
        self._pinned = {g: r for g, r in self._pinned.items() if g in self._queued}

    def _report_depth(self) -> None:
        """Tell the observer the queue's depth at the end of this turn of the event loop (once, however many
        requests came in it: the engine host takes every front's requests of a turn in one go)."""
        if not self._depth_due:
            self._depth_due = True
            asyncio.get_running_loop().call_soon(self._depth_now)

    def _depth_now(self) -> None:
        self._depth_due = False
        self.observer.on_queue_depth(self._waiting)

    def _fill_cap(self) -> float:
        """The longest a free runner waits for a batch to fill: a tenth of its last batch's compute time, or
        ``max_wait_s`` if longer."""
        return max(self.limits.max_wait_s, FILL_SHARE * self._last_seconds)

    def _answer_driven(self) -> bool:
        """Whether new requests follow answers: over the last few batches, requests arrived at least ``BURST``
        times faster within :meth:`_fill_cap` of a batch's end than while it computed (one more counted during,
        so that a few stray arrivals decide nothing). Clients that send their next request when answered do (a
        closed loop: they wait while the batch computes); independent arrivals come at the same rate either way,
        and a batch that waited for them would only idle the model and add to their latency."""
        after = sum(p.after for p in self._paces)
        after_s = sum(p.after_s for p in self._paces)
        during = sum(p.during for p in self._paces)
        during_s = sum(p.during_s for p in self._paces)
        return after * during_s >= BURST * (during + 1) * after_s

    def _ready(self) -> bool:
        """Whether the batch may go before its wait is over: one item has arrived since a runner became free (when
        the previous batch's answers went out, their clients' next requests are on their way), and it holds as many
        items as the largest of the last few batches (what traffic has been bringing per batch) and as many as were
        waiting when the runner became free together with those it had just answered (clients left out of one batch
        then wait for the others to come back, and every client goes in one batch again, not in two that keep each
        other's sizes; within ``max_batch_size``)."""
        if not self._recent or self._arrived <= self._freed:
            return False
        return self._waiting >= min(self.limits.max_batch_size, max(max(self._recent), self._expected))

    def _fill_until(self) -> float:
        """When the batch goes if it neither fills nor is :meth:`_ready`. Where items follow answers
        (:meth:`_answer_driven`): at most :meth:`_fill_cap` after the later of a runner becoming free and the oldest
        item's arrival, and before that, once as many items are there as it had just answered and found waiting
        (see :meth:`_ready`), as soon as none has arrived for ``max_wait_s`` since the last. Items queued while the
        last batch computed wait for its returning clients (whose answers are still being written), up to the cap:
        counted from the runner becoming free, the wait would send them on their own before any came back.
        Otherwise ``max_wait_s`` after the oldest item's arrival."""
        w = self.limits.max_wait_s
        if not self._answer_driven():
            return self._pending[0].enqueued + w
        start = max(self._pending[0].enqueued, self._freed)
        if self._arrived <= self._freed or self._waiting < min(self.limits.max_batch_size, self._expected):
            # nothing new since the runner became free, or fewer than it answered and found waiting: the clients
            # still to come are on their way (the front may be busy writing the others' answers for longer than
            # max_wait between two of them)
            return start + self._fill_cap()
        return min(self._arrived + w, start + self._fill_cap())

    def _free_runners(self) -> list[int]:
        return [r for r in range(len(self.runners)) if r not in self._computing]

    def _full(self) -> bool:
        lim = self.limits
        if self._waiting >= lim.max_batch_size:
            return True
        return sum(it.cost for it in self._pending) >= lim.max_batch_tokens

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                if not self._pending or not self._free_runners():  # wait for work and a free runner
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                # let the batch fill until it is full, ready or its wait is over (see _ready, _fill_until; when
                # flushing for shutdown, little more will come: run at once)
                while self._pending and not self._flush and not self._full() and not self._ready():
                    remaining = self._fill_until() - time.monotonic()
                    if remaining <= 0:
                        break
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(remaining):
                            await self._wakeup.wait()
                self._drop_stale()
                if not self._pending:
                    continue
                runner, batch = self._take_batch(self._free_runners())
                if not batch:  # what is queued follows groups computing on busy runners
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                self._report_depth()
                log.debug("fill %s: %d items, %.1f ms after the runner was free", self.name, len(batch),
                          1000 * (time.monotonic() - self._freed))
                self._computing[runner] = batch
                task = loop.create_task(self._run(loop, runner, batch), name=f"batch-{self.name}-{runner}")
                self._batches.add(task)
                task.add_done_callback(self._batches.discard)
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must survive anything; items were answered in _run
                log.exception("batcher %s: unexpected error in the batching loop", self.name)

    async def _run(self, loop: asyncio.AbstractEventLoop, runner: int, batch: list[_Item[P]]) -> None:
        """Compute ``batch`` on ``runner`` (marked busy by the caller) and answer its items. Where the queue fills
        the next batch (which then goes at once), the runner is freed first and the batching loop sends it before the
        items are answered, so that what answering costs the event loop overlaps the model's next batch instead of
        delaying it; otherwise they are answered first (the next batch waits for their clients to come back)."""
        started, unfollowed = time.monotonic(), self._unfollowed
        results: list[R] = []
        failure: Exception | None = None
        try:
            run, payloads = self.runners[runner], [it.payload for it in batch]
            results = await (cast(Callable[[list[P]], Awaitable[list[R]]], run)(payloads)
                             if inspect.iscoroutinefunction(run)  # (asked each batch: a runner may be replaced)
                             else loop.run_in_executor(self._executor, cast(Callable[[list[P]], list[R]], run),
                                                       payloads))
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} inputs")
        except Exception as e:  # a failing batch fails only its own items' requests (at once: what is queued of
            failure = e  # them is dropped before the next batch is taken)
            for it in batch:
                it.request.fail(e)
        except BaseException:  # cancelled (stopping: its items were answered, see abort): the runner is free
            self._release(runner, batch, started, unfollowed)
            raise
        if failure is not None or not self._full():  # answered first: the next batch waits for their clients
            try:
                if failure is None:
                    _answer(batch, results)
            finally:
                self._release(runner, batch, started, unfollowed)
        else:  # the queue fills the next batch, which goes at once: sent before these are answered
            self._release(runner, batch, started, unfollowed)
            self._answering[id(batch)] = batch  # (still counted: idle)
            try:
                await asyncio.sleep(0)  # the batching loop takes the next batch (the runner is free)...
                await asyncio.sleep(0)  # ... and its task sends it
            finally:  # answered even if cancelled meanwhile: nothing accepted is lost
                del self._answering[id(batch)]
                _answer(batch, results)
        finished = time.monotonic()
        cost = sum(it.cost for it in batch)
        log.debug("batch %s: %d items, %d groups, cost %d, %.4f s", self.name, len(batch),
                  len({it.group for it in batch}), cost, finished - started)
        self.observer.on_batch([it.payload for it in batch], results if failure is None else None, cost,
                               [started - it.enqueued for it in batch], finished - started, runner)

    def _release(self, runner: int, batch: list[_Item[P]], started: float, unfollowed: int) -> None:
        """``runner`` free again after ``batch`` (begun at ``started``, when ``unfollowed`` requests had come
        unfollowed), and the batching loop woken."""
        del self._computing[runner]
        self._freed = time.monotonic()
        self._last_seconds = self._freed - started
        size = sum(it.size for it in batch)
        self._recent.append(size)
        self._expected = self._waiting + size
        self._paces.append(_Pace(self._unfollowed - unfollowed, self._last_seconds, self._fill_cap()))
        queued = self._queued  # its groups still queued served now (they wait their turn behind the others)
        self._served = {g: t for g, t in self._served.items() if g in queued}
        self._served.update((it.group, self._freed) for it in batch if it.group in queued)
        self._wakeup.set()  # the runner is free


def _answer(batch: list[_Item[P]], results: list[R]) -> None:
    """Each item of ``batch`` given its result."""
    for it, r in zip(batch, results, strict=True):
        it.request.answer(it.k, r)


class _Request(Generic[R, T]):
    """One request's items answered together: :attr:`whole` gets ``finish`` of every item's result (in order), the
    first exception an item got, or :class:`DeadlineExceeded` at ``deadline``. Once it is settled (or cancelled by its
    caller), the answers of its other items are ignored and the batcher drops what is still queued of it: as late
    (``expired``: its deadline passed) or as gone."""

    __slots__ = ("expired", "finish", "left", "results", "timeout", "timer", "whole")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int, deadline: float, finish: Callable[[list[R]], T],
                 now: float) -> None:
        self.results: list[Any] = [None] * n
        self.left, self.finish, self.expired = n, finish, False
        self.whole: asyncio.Future[T] = loop.create_future()
        self.timeout = max(0.0, deadline - now)
        self.timer = loop.call_later(self.timeout, self._expire)
        self.whole.add_done_callback(self._release)
        if not n:
            self._settle()

    def answer(self, k: int, result: R) -> None:
        """Item ``k``'s result (ignored once the request is settled)."""
        if self.whole.done():
            return
        self.results[k] = result
        self.left -= 1
        if not self.left:
            self._settle()

    def fail(self, exc: BaseException, expired: bool = False) -> None:
        """An item's exception settles the request (``expired``: it is its deadline)."""
        if not self.whole.done():
            self.expired = expired
            self.whole.set_exception(exc)

    def _settle(self) -> None:
        try:
            self.whole.set_result(self.finish(self.results))
        except Exception as e:
            self.whole.set_exception(e)

    def _expire(self) -> None:
        self.fail(DeadlineExceeded(f"deadline passed after {self.timeout:.3f} s"), expired=True)

    def _release(self, _: object) -> None:
        """The request is settled or its caller went away: no timer (the batcher drops what is queued of it)."""
        self.timer.cancel()


def _same(results: list[R]) -> list[R]:
    return results
