"""The server's lifecycle in one object: loading -> ok -> draining -> stopped (or loading -> failed), and the
HTTP requests in flight. No torch, no HTTP."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class Status(enum.StrEnum):
    LOADING = "loading"
    OK = "ok"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class Lifecycle:
    """The one owner of the server's state: loading -> ok -> draining -> stopped, or loading -> failed; and
    the HTTP requests in flight."""

    status: Status = Status.LOADING
    error: str | None = None
    in_flight: int = 0

    @property
    def ready(self) -> bool:
        return self.status is Status.OK

    @property
    def loading(self) -> bool:
        return self.status is Status.LOADING

    @property
    def draining(self) -> bool:
        return self.status is Status.DRAINING

    @property
    def failed(self) -> bool:
        return self.status is Status.FAILED

    @property
    def serving(self) -> bool:
        """Whether requests already accepted reach the models (ready, or draining what arrived before)."""
        return self.status in (Status.OK, Status.DRAINING)

    def describe(self) -> str:
        return self.status.value + (f": {self.error}" if self.error else "")

    def loaded(self) -> None:
        if self.status is Status.LOADING:
            self.status = Status.OK

    def fail(self, error: str) -> None:
        self.status, self.error = Status.FAILED, error

    def drain(self) -> None:
        """New requests are turned away from here on; requests already being handled still finish."""
        if self.status in (Status.OK, Status.LOADING):
            self.status = Status.DRAINING

    def stop(self) -> None:
        if self.status is not Status.FAILED:
            self.status = Status.STOPPED

    @contextmanager
    def request(self) -> Iterator[None]:
        """Count one HTTP request in flight while the block runs."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
