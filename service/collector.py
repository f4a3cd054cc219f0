"""Keep what a process loads once (modules, models, the app) out of Python's garbage collections, in every process
that serves: the engine's, the engine host's and each front's.

CPython's collector walks every tracked object of the generation it collects, and a full collection comes every few
batches once enough objects have survived two younger ones; a batch or a request leaves thousands of short-lived
ones (its texts' jobs, results, messages). A process that has loaded torch, transformers and a model holds about
400,000 tracked objects, so each full collection walks them all, to free none of them. Measured on the 2-core
CI-class CPU with the engine's compute left out (its host work alone on 410 tweets a batch of the bundled model):
3.3-7.1 ms a batch with the collector as it is, 2.9-3.3 ms with it off, 3.4-3.5 ms with what was loaded frozen
(``gc.freeze``: moved to a generation no collection walks; objects are still freed when nothing refers to them).

:func:`settle` (once a process has loaded its models) first gives every frozen object back to the collector, so that
what was loaded and dropped since is freed, and takes a full collection (about 0.2 s with the bundled model); a head
loaded at runtime (a head cache may load one a request) is kept with :func:`keep`, which collects the young
generations alone (microseconds). A head dropped at runtime is freed by reference counting: heads hold no reference
cycles (tested), so none waits for a collection that would not come.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("service.collector")


def settle() -> int:
    """Collect every object (those frozen before too), then freeze the survivors: what the process holds now; how
    many are frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("%d objects kept out of garbage collections", frozen)
    return frozen


def keep() -> int:
    """Freeze what was loaded since the last freeze, after collecting the young generations (what loading it left);
    how many are frozen."""
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()
