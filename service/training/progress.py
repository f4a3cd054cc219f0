"""Progress bars for long work: live on a terminal; in a log (standard error not a terminal: a container, a
CI job, ``nohup``) a bar shows only once its work has taken ``LOG_INTERVAL_S``, then at most once every
``LOG_INTERVAL_S`` and at its end, so a log keeps the progress of long work without hundreds of redraws a
minute (an epoch of a few seconds between two validation lines prints none)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
LOG_INTERVAL_S = 30.0


def progress(iterable: Iterable[T] | None = None, **kwargs: Any) -> tqdm[T]:
    """A tqdm bar over ``iterable`` (or updated by hand), writing to standard error."""
    if sys.stderr.isatty():
        return tqdm(iterable, file=sys.stderr, **kwargs)
    return tqdm(iterable, file=sys.stderr, delay=LOG_INTERVAL_S, mininterval=LOG_INTERVAL_S,
                maxinterval=LOG_INTERVAL_S, **kwargs)
