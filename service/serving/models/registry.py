"""The model table: every backbone group served, every model's name and the head it serves from, the default model,
and the heads that requests in flight hold. The request pipeline reads it; model control (in this process) or the
engine host's announcements (in a front) change it.

A model's name leads to the key of its current head (:func:`~service.serving.core.keys.head_key`). A request holds
the heads it was planned with until it is answered (:meth:`Registry.hold`), so a head that a reload or an unload
retires answers everything accepted before, while new requests go to the new head (or get 404)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence

from service.serving.core.keys import model_of
from service.serving.engine.group import BackboneGroup


class Registry:
    """Every loaded model, by name, on its backbone group."""

    def __init__(self, default_model: str | None = None) -> None:
        self.groups: dict[str, BackboneGroup] = {}  # by the backbone group's name (see ``unique_name``)
        self.models: dict[str, BackboneGroup] = {}  # model name -> its backbone group, in loading order
        self.heads: dict[str, str] = {}  # model name -> the key of its current head
        self.default_model = default_model
        """The model behind /v1/classify and /v1/explain; None while no model has served yet in a server started
        without any (the first to serve becomes it)."""
        self._using: Counter[str] = Counter()  # head key -> requests in flight planned with it
        self._released: dict[str, asyncio.Event] = {}  # retired head key -> set when its last request is answered

    def unique_name(self, name: str, source: str) -> str:
        """The name a new backbone group ``name`` (loaded from ``source``) goes by here (in logs, metrics and the
        fronts): its own (``name@revision``), or where another group already goes by that (the same name and
        revision from another source) that name with its source, so that neither replaces the other."""
        return name if name not in self.groups else f"{name} ({source})"

    def add(self, group: BackboneGroup) -> None:
        """A backbone group and every head on it (under its planner's name: see :meth:`unique_name`)."""
        name = group.planner.name
        if name in self.groups:
            raise ValueError(f"a backbone group named {name} is loaded already")
        self.groups[name] = group
        for key in group.planner.models:
            self.serve(model_of(key), key, group)

    def serve(self, name: str, key: str, group: BackboneGroup) -> None:
        """Requests for model ``name`` go to head ``key`` on ``group`` from now on."""
        self.models[name], self.heads[name] = group, key

    def withdraw(self, name: str) -> None:
        """New requests for ``name`` get 404 from now on (those accepted keep their heads)."""
        self.models.pop(name, None)
        self.heads.pop(name, None)

    @contextlib.contextmanager
    def holding(self, keys: Sequence[str]) -> Iterator[None]:
        """Hold heads ``keys`` while the block runs (see :meth:`hold`)."""
        self.hold(keys)
        try:
            yield
        finally:
            self.release(keys)

    def hold(self, keys: Sequence[str]) -> None:
        """Hold heads ``keys`` until :meth:`release`: a retired head is dropped only once nothing holds it (see
        :meth:`released`)."""
        self._using.update(keys)

    def release(self, keys: Sequence[str]) -> None:
        """What :meth:`hold` held, released."""
        for key in keys:
            self._using[key] -= 1
            if self._using[key] <= 0:
                del self._using[key]
                if key in self._released:
                    self._released[key].set()

    async def released(self, key: str, timeout_s: float) -> bool:
        """Wait until no request in flight holds head ``key`` (retired: no new one takes it); False on timeout."""
        if not self._using.get(key):
            return True
        event = self._released.setdefault(key, asyncio.Event())
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._released.pop(key, None)

    def holds(self, name: str) -> bool:
        """Whether a request in flight holds the current head of model ``name``."""
        return bool(self._using.get(self.heads.get(name, "")))

    @property
    def idle(self) -> bool:
        """Nothing queued or computing on any group."""
        return all(g.idle for g in self.groups.values())

    def flush(self) -> None:
        """Every group's batches go without waiting to fill (the server drains)."""
        for group in self.groups.values():
            group.flush()

    def abort(self, reason: str) -> int:
        """Answer every text still queued or computing with 'shutting down' (503); how many there were."""
        return sum(g.abort(reason) for g in self.groups.values())
