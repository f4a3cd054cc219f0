"""Keep what a process loads once (modules, models, the app) out of Python's garbage collections, in every process
that serves: each front's or the server's, the engine host's, and the engine's (the backbone's process).

CPython's collector walks every tracked object of the generation it collects, and a full collection comes every few
batches, or every second or two under load, once enough objects have survived two younger ones (those of requests
and batches in flight); a request or a batch leaves thousands of short-lived ones (parsed bodies, texts' jobs,
results). A front holds about 75,000 tracked objects once loaded, the engine's process about 400,000 (torch,
transformers and a model): each full collection walked them all to free none, and held the front's event loop about
30 ms. Measured on the 2-core CI-class CPU with the engine's compute left out (its host work alone on 410 tweets a
batch of the bundled model): 3.3-7.1 ms a batch with the collector as it is, 2.9-3.3 ms with it off, 3.4-3.5 ms with
what was loaded frozen (``gc.freeze``: moved to a generation no collection walks; objects are still freed when
nothing refers to them). Young collections come every :data:`YOUNG_COLLECTION_THRESHOLD` allocations instead of
Python's 700, which a request's short-lived objects passed every few requests.

:func:`settle` (once a process has loaded its models) first gives every frozen object back to the collector, so that
what was loaded and dropped since is freed, and takes a full collection (about 0.2 s in the engine's process with the
bundled model); a head loaded at runtime (a head cache may load one a request) is kept with :func:`keep`, which
collects the young generations alone (microseconds). A head dropped at runtime is freed by reference counting: heads
hold no reference cycles (tested), so none waits for a collection that would not come.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("service.collector")

YOUNG_COLLECTION_THRESHOLD = 10_000
"""Tracked objects allocated (net) before a young collection; Python's is 700."""


def settle() -> int:
    """Collect every object (those frozen before too), freeze the survivors (what the process holds now) and collect
    young objects less often from now on; how many are frozen (counting walks them all: once, here)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])
    frozen = gc.get_freeze_count()
    log.debug("garbage collector: %d objects frozen", frozen)
    return frozen


def keep() -> None:
    """Freeze what was loaded since the last freeze, after collecting the young generations (what loading it left)."""
    gc.collect(1)
    gc.freeze()
