"""Several processes of one backbone and its heads (``ROUTING_MODEL_REPLICAS``, ``ROUTING_DEVICES``), each a
:class:`~service.serving.engine.process.BackboneProcess` computing batches of its own: the batcher gives each its
own batches and keeps a text's chunks on one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from service.config import cuda_here
from service.serving.core.results import WorkAnswer
from service.serving.core.work import Work
from service.serving.engine.compute import AsyncRunner, Compute, Runner
from service.serving.engine.pipe import BucketPlan
from service.serving.engine.process import BackboneProcess, Launches
from service.threads import available_cpus

log = logging.getLogger("service.replicas")


class Replicas(Compute):
    """Several processes of one backbone and its heads, each computing batches of its own: one on each device of
    ``devices`` (``ROUTING_DEVICES``, e.g. two GPUs), or several on one (``ROUTING_MODEL_REPLICAS``; on a CPU the CPUs
    this process may use, shared among them: one intra-op thread each on two cores). On a 2-core CPU, two processes
    of one thread computed 1.08-1.16x what one process of two threads did offline, and served 1.06-1.31x as much in
    five comparisons (measured in turns; see the README). Each holds a copy of the model's weights.

    Args:
        folders, dtype, warmup, launches, buckets, in_flight, batch_invariance: as for :class:`BackboneProcess`.
        devices: each process's device (at least 2).
        torch_threads: intra-op threads of each (None: the CPUs this process may use, shared among those on the CPU).

    Raises:
        ModelLoadError, ModelProcessError: as :class:`BackboneProcess` (the processes already started are closed).
    """

    def __init__(self, folders: Path | list[Path], devices: Sequence[str] = ("auto", "auto"), dtype: str = "auto",
                 warmup: bool = True, torch_threads: int | None = None, keys: list[str] | None = None,
                 launches: Launches | None = None, buckets: BucketPlan | None = None, in_flight: int = 1,
                 batch_invariance: str = "off") -> None:
        n = len(devices)
        if n < 2:
            raise ValueError(f"replicas need at least 2 processes, not {n}")
        on_cpu = sum(d == "cpu" or (d == "auto" and not cuda_here()) for d in devices)
        threads = torch_threads or max(1, available_cpus() // max(on_cpu, 1))
        first = BackboneProcess(folders, devices[0], dtype, warmup, threads, keys=keys, launches=launches,
                                buckets=buckets, in_flight=in_flight, batch_invariance=batch_invariance)
        super().__init__(list(first.manifests.values()), first.chunker, first.models)
        self.processes = [first]
        with ThreadPoolExecutor(n - 1) as pool:  # the others load side by side
            started = [pool.submit(BackboneProcess, folders, device, dtype, warmup, threads, first.chunker, keys,
                                   launches, buckets, in_flight, batch_invariance) for device in devices[1:]]
        self.processes += [f.result() for f in started if f.exception() is None]
        failed = next((e for f in started if (e := f.exception()) is not None), None)
        if failed is not None:
            self.close()
            raise failed
        self.device, self.dtype = first.device, first.dtype
        log.info("backbone %s computes in %d processes (%s) of %d torch threads each", self.name, n,
                 ", ".join(str(p.device) for p in self.processes), threads)

    async def attach(self) -> None:
        for p in self.processes:
            await p.attach()

    @property
    def runners(self) -> list[Runner] | list[AsyncRunner]:
        return [r for p in self.processes for r in p.runners]  # type: ignore[return-value]  # (all of one kind)

    @property
    def runner_devices(self) -> list[str]:
        return [d for p in self.processes for d in p.runner_devices]

    def add_heads(self, folders: Sequence[Path], keys: Sequence[str], warmup: bool = True) -> None:
        """The heads onto every process, side by side; where one fails, the others drop them again."""
        with ThreadPoolExecutor(len(self.processes)) as pool:
            done = [pool.submit(p.add_heads, folders, keys, warmup) for p in self.processes]
        failed = next((e for f in done if (e := f.exception()) is not None), None)
        if failed is not None:
            for p, f in zip(self.processes, done, strict=True):
                if f.exception() is None:
                    p.remove_heads(keys)
            raise failed
        self.add({k: self.processes[0].manifests[k] for k in keys})

    def remove_heads(self, keys: Sequence[str]) -> None:
        for p in self.processes:
            p.remove_heads(keys)
        self.remove(keys)

    @property
    def takes_runs(self) -> bool:  # type: ignore[override]
        return all(p.takes_runs for p in self.processes)

    def run_chunks(self, works: list[Work]) -> list[WorkAnswer]:  # type: ignore[override]  # (runs too)
        """Compute a batch in the first process (the batcher spreads batches over :attr:`runners`)."""
        return self.processes[0].run_chunks(works)

    def describe(self, model: str) -> dict[str, Any]:
        return self.processes[0].describe(model)

    def resident_bytes(self) -> int | None:
        readings = [p.resident_bytes() for p in self.processes]
        return None if None in readings else sum(r for r in readings if r is not None)

    def restarts(self) -> int:
        return sum(p.restarts() for p in self.processes)

    def device_memory(self) -> list[dict[str, float | str]]:
        return [d for p in self.processes for d in p.device_memory()]

    def close(self, timeout_s: float = 10.0) -> None:
        """Close every process, side by side (each finishes its batch and exits on its own time)."""
        with ThreadPoolExecutor(len(self.processes)) as pool:
            list(pool.map(lambda p: p.close(timeout_s), self.processes))
