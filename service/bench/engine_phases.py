"""`routing-service bench engine`: where a batch's time goes in the engine alone (no server, no queue).

For each batch size, batches of the sampled texts in their sampled order (as clients' requests arrive, not
sorted by length) run through :meth:`Engine.run`:

- ``ms_per_batch``: wall time per batch over whole passes of the texts, nothing else running (on a GPU, up to
  the device's last kernel: the batch's one copy back waits for it);
- per phase (the engine's profiler ranges, :data:`PHASES`): the process's time in it per batch, from a torch
  profile of the first few batches (``profiled``: a profile of thousands of batches takes long to read).
  ``plan`` (tokenizing and chunking) is the server's front's part; the other four are what the model's process
  computes. On a GPU a phase's process time is the time to launch its kernels plus any wait for the device (the
  heads' copy of the scores back waits for every kernel before it);
- on a GPU, per batch: kernels launched and the device's busy time (the sum of its kernels' durations), and each
  phase's device milliseconds. A device busy for a small share of the wall time is waiting on the process that
  launches its kernels;
- ``host_us_per_text``: the engine's own work per text over the timed passes (see ``EngineClock``: everything in
  ``run_chunks`` but the encoder's and heads' forward calls and the wait for the device; tokenizing is the fronts'
  and is left out), timed without the profiler; ``torch_ops_per_batch``: the torch operators the engine calls
  (not those they call in turn), from the profile.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from service.bench.engine_worker import outermost
from service.bench.report import in_turns, round_ratios, whole_passes

if TYPE_CHECKING:
    from service.serving.engine.engine import Engine

PHASES = ("engine.plan", "engine.encode", "engine.join", "engine.heads", "engine.results")


def batches_of(texts: list[str], size: int) -> list[list[str]]:
    """Consecutive whole batches of ``size`` texts (a short tail is left out: each batch has ``size`` texts)."""
    return [texts[k : k + size] for k in range(0, len(texts) - size + 1, size)]


def _sync(engine: Engine) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)


def timed(engine: Engine, batches: list[list[str]], seconds: float) -> tuple[float, float]:
    """Wall milliseconds per batch and the engine's host microseconds per text, over whole passes of ``batches``
    lasting at least ``seconds`` (the texts tokenized once, before: that is the fronts' work)."""
    from service.serving.core.work import Task

    sync = _sync(engine)
    model = engine.default
    length = engine.max_length(model)
    tasks = [[Task(t, e[length], model) for t, e in zip(batch, engine.encode(batch, [model] * len(batch)),
                                                        strict=True)] for batch in batches]
    engine.run(tasks[0])  # warm-up at this size
    sync()
    host0 = engine.clock.host_s
    passes = 0

    def one_pass() -> None:
        nonlocal passes
        for batch in tasks:
            engine.run(batch)
        sync()
        passes += 1

    size = len(batches[0])
    rate = whole_passes(one_pass, size * len(batches), seconds)
    return 1000 * size / rate, 1e6 * (engine.clock.host_s - host0) / (passes * size * len(batches))


def phases(engine: Engine, batches: list[list[str]]) -> dict[str, Any]:
    """Per batch, from a torch profile of ``batches``: each phase's process milliseconds, and on a GPU
    the kernels launched, the device's busy milliseconds and each phase's device milliseconds."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from service.serving.core.work import Task

    cuda = engine.device.type == "cuda"
    sync = _sync(engine)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for batch in batches:
            engine.run([Task(t) for t in batch])
        sync()
        wall = time.perf_counter() - t0
    n = len(batches)
    events = prof.events()
    ranges = [e for e in events if e.name in PHASES and e.device_type == DeviceType.CPU]
    calls = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::") and outermost(e)]
    out: dict[str, Any] = {"profiled_ms_per_batch": 1000 * wall / n, "torch_ops_per_batch": len(calls) / n,
                           "process_ms": {p.removeprefix("engine."): sum(e.cpu_time_total for e in ranges
                                                                           if e.name == p) / 1000 / n
                                          for p in PHASES}}
    if cuda:  # the ranges appear on the device too, spanning their kernels: they are none
        device = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("engine.")]
        out["kernels_per_batch"] = sum(1 for e in device if not e.name.startswith(("Memcpy", "Memset"))) / n
        out["device_busy_ms"] = sum(e.time_range.elapsed_us() for e in device) / 1000 / n
        out["device_ms"] = {p.removeprefix("engine."): sum(e.device_time_total for e in ranges if e.name == p)
                            / 1000 / n for p in PHASES}
    return out


def run(engine: Engine, texts: list[str], sizes: list[int], seconds: float, profiled: int = 16
        ) -> list[dict[str, Any]]:
    """One row per batch size (sizes with no whole batch in ``texts`` are left out); the phases from the first
    ``profiled`` batches."""
    rows = []
    for size in sizes:
        batches = batches_of(texts, size)
        if not batches:
            continue
        wall, host = timed(engine, batches, seconds)
        rows.append({"batch_size": size, "ms_per_batch": wall, "texts_per_s": 1000 * size / wall,
                     "host_us_per_text": host, **phases(engine, batches[:profiled])})
    return rows


def check_setting(engine: Engine, setting: dict[str, Any]) -> None:
    """Raises ValueError naming what of ``setting`` the engine has no attribute for."""
    unknown = sorted(k for k in setting if not hasattr(engine, k))
    if unknown:
        raise ValueError(f"the engine has no setting {unknown}")


def versus_setting(engine: Engine, texts: list[str], sizes: list[int], seconds: float, setting: dict[str, Any],
                   rounds: int) -> dict[str, Any]:
    """This engine as it is against the same engine with ``setting`` (attribute -> value) changed, in turns (the order
    alternating by round; the same batches, each at least ``seconds`` a turn): per batch size, milliseconds per batch
    and host microseconds per text of each in every round, and ``changed_over_current``, the median of the rounds'
    ratios of texts/s (above 1: the changed setting is faster)."""
    check_setting(engine, setting)
    current = {k: getattr(engine, k) for k in setting}
    out: dict[str, Any] = {"setting": setting, "current": current, "rounds": rounds, "by_batch_size": {}}
    try:
        for size in sizes:
            batches = batches_of(texts, size)
            if not batches:
                continue
            turns: dict[str, list[dict[str, float]]] = {"current": [], "changed": []}
            for r in range(rounds):
                for name in in_turns(("current", "changed"), r):
                    for k, v in (setting if name == "changed" else current).items():
                        setattr(engine, k, v)
                    wall, host = timed(engine, batches, seconds)
                    turns[name].append({"ms_per_batch": wall, "host_us_per_text": host})
            ratios = round_ratios(turns["current"], turns["changed"], "ms_per_batch")
            out["by_batch_size"][str(size)] = {**turns, "changed_over_current": statistics.median(ratios),
                                               "ratios": ratios}
    finally:
        for k, v in current.items():
            setattr(engine, k, v)
    return out


def flat(row: dict[str, Any]) -> dict[str, Any]:
    """A row for the printed table: the phases' dicts spread into columns."""
    out = {k: v for k, v in row.items() if not isinstance(v, dict)}
    for kind in ("process_ms", "device_ms"):
        for phase, ms in row.get(kind, {}).items():
            out[f"{phase}_{kind.removesuffix('_ms')}_ms"] = ms
    return out
