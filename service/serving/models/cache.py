"""A memory budget for heads (``head_cache_bytes``): every model folder of the repository can be asked for, and
a head is loaded onto its backbone on the first request that names it. When the heads in memory weigh more than
the budget, the least recently used ones leave (their names stay servable: the next request brings them back),
except the pinned ones (``models``, loaded at start) and any head a request in flight holds or is bringing in.

Loads and evictions go through :class:`~service.serving.models.control.ModelControl`, one change at a time; requests
for a model being loaded wait for that one load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from service.modeling.manifest import WEIGHTS
from service.serving.core.errors import APIError
from service.serving.models.control import ModelControl
from service.serving.models.registry import Registry
from service.serving.observe.metrics import Metrics

log = logging.getLogger("service.cache")
ROUNDS = 3
"""How many times a request brings its heads in before giving up (only a budget smaller than the heads that
requests in flight hold at once can keep evicting them)."""


class HeadCache:
    """Heads in memory within ``budget`` bytes of head weights, least recently used out first."""

    def __init__(self, repository: Path, registry: Registry, control: ModelControl, metrics: Metrics, budget: int,
                 pinned: Sequence[str]) -> None:
        self.repository, self.registry, self.control, self.metrics = repository, registry, control, metrics
        self.budget, self.pinned = budget, set(pinned)
        self._recent: OrderedDict[str, int] = OrderedDict()  # resident model -> its weight bytes, oldest use first
        self._wanted: dict[str, asyncio.Future[None]] = {}  # model -> done when loaded (or failed), for the waiters
        self._loader: asyncio.Task[None] | None = None
        self._bringing: dict[str, int] = {}  # model -> requests bringing it in now (never evicted meanwhile)
        self._evicting: asyncio.Task[None] | None = None

    @property
    def resident_bytes(self) -> int:
        return sum(self._recent.values())

    def start(self) -> None:
        """Count the heads loaded at start (the pinned ones), and say what room the budget leaves beside them."""
        for name in self.registry.models:
            self._recent[name] = self._weight_bytes(name)
        self._export()
        pinned = self.resident_bytes
        head = max(self._recent.values(), default=0)  # a head's size, as the pinned ones weigh
        if not head:
            log.info("head cache: a budget of %d bytes, no head pinned", self.budget)
        elif self.budget - pinned < head:
            log.warning("head cache: a budget of %d bytes leaves no room beside the pinned heads (%d bytes): every "
                        "other head is loaded for each request that names it and evicted after it "
                        "(ROUTING_HEAD_CACHE_BYTES sets the budget)", self.budget, pinned)
        else:
            room = (self.budget - pinned) // head
            log.info("head cache: a budget of %d bytes, %d of them for the pinned heads: room for about %d head%s "
                     "of %d bytes beside them", self.budget, pinned, room, "" if room == 1 else "s", head)

    def known(self, name: str) -> None:
        """Check that ``name`` is a model the server can serve: loaded, or a folder of the repository (400/404 as
        in :meth:`~service.serving.models.control.ModelControl.folder` otherwise)."""
        if name not in self.registry.models:
            self.control.folder(name)

    async def bring(self, names: Sequence[str], count: bool = True) -> None:
        """Have every model of ``names`` in memory, loading the missing ones (each once, however many requests
        ask for it); returns with all of them resident (nothing can evict them until the caller awaits again).
        ``count``: record hits and misses (once per request).

        Raises:
            APIError: 400/404 for a name with no model folder; 400 when a model fails to load; 503 when the
                budget keeps evicting what this request needs.
        """
        for name in names:
            self._bringing[name] = self._bringing.get(name, 0) + 1
        try:
            for round_ in range(ROUNDS):
                missing = [n for n in names if n not in self.registry.models]
                if round_ == 0 and count:
                    self._count(names, missing)
                if not missing:
                    break
                for name in missing:
                    self.known(name)
                waits = [self._want(name) for name in missing]
                for wait in waits:
                    await asyncio.shield(wait)
            else:
                raise APIError(503, f"head cache: {self.budget} bytes cannot hold the heads of the requests in flight; "
                                    "retry later or raise ROUTING_HEAD_CACHE_BYTES", reason="overloaded")
            for name in names:
                self._recent[name] = self._recent.pop(name, None) or self._weight_bytes(name)  # now the newest
        finally:
            for name in names:
                self._bringing[name] -= 1
                if not self._bringing[name]:
                    del self._bringing[name]

    def _count(self, names: Sequence[str], missing: Sequence[str]) -> None:
        m = self.metrics
        m.head_cache_hits.inc(len(names) - len(missing))
        m.head_cache_misses.inc(len(missing))

    def _want(self, name: str) -> asyncio.Future[None]:
        """Done once model ``name`` is loaded (raises its failure); the loader takes every model wanted meanwhile in
        one change (one wait for the batch in progress, not one per model)."""
        future = self._wanted.get(name)
        if future is None:
            future = self._wanted[name] = asyncio.get_running_loop().create_future()
            if self._loader is None or self._loader.done():
                self._loader = asyncio.ensure_future(self._load())
        return future

    async def _load(self) -> None:
        while wanted := [n for n, f in self._wanted.items() if not f.done()]:
            t0 = time.perf_counter()
            control = self.control
            try:
                failed = await control.load_many({name: control.repository / name for name in wanted})
            except Exception as e:  # a process that died, say: every waiter gets it
                failed = {name: e for name in wanted}
            for name in wanted:
                self.metrics.head_cache_load.observe(time.perf_counter() - t0)
                future = self._wanted.pop(name)
                error = failed.get(name)
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
                    future.exception()  # retrieved here: a waiter that left must not log it as never retrieved

    def loaded(self, name: str) -> None:
        """Model ``name``'s head is in memory now (brought in, or loaded through the repository API): the newest;
        evict beyond the budget (off the request's path)."""
        self._recent.pop(name, None)
        self._recent[name] = self._weight_bytes(name)
        self._export()
        self.released()

    def released(self) -> None:
        """Evict beyond the budget, off the request's path (after a load, and when requests let heads go)."""
        if self.resident_bytes > self.budget and (self._evicting is None or self._evicting.done()):
            self._evicting = asyncio.ensure_future(self._evict())

    async def stop(self) -> None:
        if self._evicting is not None:
            await asyncio.gather(self._evicting, return_exceptions=True)

    async def _evict(self) -> None:
        """Evict least recently used heads while the resident ones weigh more than the budget."""
        registry = self.registry
        while self.resident_bytes > self.budget:
            victims, over = [], self.resident_bytes - self.budget
            for name, size in self._recent.items():  # oldest first
                if over <= 0:
                    break
                if name not in self.pinned and name not in self._bringing and not registry.holds(name):
                    victims.append(name)
                    over -= size
            if not victims:  # everything resident is pinned or in use: over budget until a request lets go
                break
            for name in victims:
                del self._recent[name]
            try:
                await self.control.evict(victims)
            except Exception:
                log.exception("evicting heads %s failed", victims)
                return
            self.metrics.head_cache_evictions.inc(len(victims))
            self._export()

    def forget(self, name: str) -> None:
        """Model ``name`` left memory another way (unloaded through the repository API)."""
        self._recent.pop(name, None)
        self._export()

    def _export(self) -> None:
        m = self.metrics
        m.head_cache_heads.set(len(self._recent))
        m.head_cache_bytes.set(self.resident_bytes)

    def _weight_bytes(self, name: str) -> int:
        weights = self.repository / name / WEIGHTS
        return weights.stat().st_size if weights.is_file() else 0
