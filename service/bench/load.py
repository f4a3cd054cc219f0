"""The load generator of ``routing-service bench serve`` and the comparisons built on it: closed-loop clients (each
sends its next request when its last is answered) and open-loop Poisson arrivals, over aiohttp, in this process or in
several, with what each level measured (:class:`Level`: throughput, latency quantiles, the server's batches and the
CPU each part used)."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import queue
import random
import time
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.bench.cpus import current, pinned

T = TypeVar("T")


@dataclass
class Level:
    concurrency: int
    seconds: float
    latencies: list[float]
    errors: int
    texts: int
    batch_sum: float
    batch_count: float
    compute_s: float  # time the model spent on batches meanwhile
    cpu_s: dict[str, float] | None = None  # CPU seconds meanwhile: the server's parts, the load generator
    per_request: int = 1  # texts per request
    processes: int = 1  # processes of the load generator
    load_cpus: tuple[int, ...] = ()  # the CPUs the load generator's processes ran on

    def row(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def q(p: float) -> float:
            return 1000 * lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

        return {"concurrency": self.concurrency, "throughput": self.texts / self.seconds,
                "requests_per_s": len(self.latencies) / self.seconds, "texts_per_request": self.per_request,
                "load_processes": self.processes, "p50_ms": q(0.5),
                "p95_ms": q(0.95), "p99_ms": q(0.99), "mean_batch": self.batch_sum / max(self.batch_count, 1),
                "model_busy": self.compute_s / self.seconds,
                "batch_ms": 1000 * self.compute_s / max(self.batch_count, 1),
                "errors": self.errors, "requests": len(self.latencies) + self.errors,
                "load_cpus": list(self.load_cpus),
                **{f"{part}_cpu_ms": 1000 * s / max(self.texts, 1) for part, s in (self.cpu_s or {}).items()}}


def batch_stats(url: str, family: str = "routing_batch_size") -> tuple[float, float]:
    """Sum and count of a histogram of the server's, over every model."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    s = c = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for sample in fam.samples:
                if sample.name.endswith("_sum"):
                    s += sample.value
                elif sample.name.endswith("_count"):
                    c += sample.value
    return s, c


Stats = Callable[[], tuple[float, float, float]]
"""A server's totals so far: texts computed in batches, batches, seconds the model spent on them."""


def metrics_stats(url: str) -> Stats:
    """The totals of this service at ``url``, from its metrics."""
    def read() -> tuple[float, float, float]:
        texts, batches = batch_stats(url)
        return texts, batches, batch_stats(url, "routing_batch_compute_seconds")[0]
    return read


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop where it is installed (it comes with ``uvicorn[standard]``): the load
    generator shares the machine with the server, so it should take as little CPU as it can."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def _post(client: aiohttp.ClientSession, path: str, texts: list[str], body: dict[str, Any] | None) -> bool:
    """One request of ``texts``; whether it was answered 200."""
    try:
        async with client.post(path, json={"inputs": texts, **(body or {})}) as r:
            await r.read()
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


Target = str | Sequence[str] | Callable[[int], str]
"""Where a load generator sends request ``k`` of client ``w``: one path; ``path[w % len(path)]``; or ``path(k)``."""


@dataclass
class Load:
    """What one load process got: the latencies (s) of the requests answered 200, the failed ones, the seconds from
    its start until its last answer, the CPU seconds it used, and the CPUs it ran on."""

    latencies: list[float]
    errors: int
    seconds: float
    cpu_s: float
    cpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class Clients:
    """Closed-loop clients ``first .. first + count - 1`` of ``concurrency`` in all, each sending ``per_request``
    texts at a time for ``seconds``: client ``w`` sends texts ``w * per_request, ...`` then steps by ``concurrency *
    per_request`` (the same texts, however the clients are spread over processes)."""

    url: str
    path: Target
    texts: list[str]
    concurrency: int
    seconds: float
    body: dict[str, Any] | None = None
    per_request: int = 1
    first: int = 0
    count: int | None = None


@dataclass(frozen=True)
class Arrivals:
    """Open-loop Poisson arrivals at ``rate`` requests per second for ``seconds``, seeded: request ``k`` is text
    ``k`` (from ``offset``), sent to ``path(k)`` when ``path`` is a function."""

    url: str
    path: str | Callable[[int], str]
    texts: list[str]
    rate: float
    seconds: float
    seed: int = 0
    offset: int = 0


async def _closed(c: Clients) -> Load:
    """Run the clients of ``c`` in this process."""
    latencies: list[float] = []
    errors = 0
    count = c.concurrency if c.count is None else c.count
    own0 = time.process_time()
    end = time.monotonic() + c.seconds
    connector = aiohttp.TCPConnector(limit=count)
    async with aiohttp.ClientSession(c.url, connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:
        async def worker(w: int) -> None:
            nonlocal errors
            k = w * c.per_request
            path = c.path
            where = path if isinstance(path, str) or callable(path) else path[w % len(path)]
            while time.monotonic() < end:
                t0 = time.perf_counter()
                sent = [c.texts[(k + i) % len(c.texts)] for i in range(c.per_request)]
                if await _post(client, where(k) if callable(where) else where, sent, c.body):
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
                k += c.concurrency * c.per_request

        t_start = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(c.first, c.first + count)))
        elapsed = time.monotonic() - t_start
    return Load(latencies, errors, elapsed, time.process_time() - own0)


async def _open(a: Arrivals) -> Load:
    """Send the arrivals of ``a`` from this process; waits for the last answers."""
    rng = random.Random(a.seed)
    latencies: list[float] = []
    errors = 0
    own0 = time.process_time()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(a.url, connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:
        async def one(at: float, text: str, where: str) -> None:
            nonlocal errors
            if await _post(client, where, [text], None):
                latencies.append(time.perf_counter() - at)
            else:
                errors += 1

        start = time.perf_counter()
        sent: list[asyncio.Task[None]] = []
        at, k = start, a.offset
        while at - start < a.seconds:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            sent.append(asyncio.ensure_future(one(at, a.texts[k % len(a.texts)], a.path(k) if callable(a.path)
                                                  else a.path)))
            at += rng.expovariate(a.rate)
            k += 1
        await asyncio.gather(*sent)
        elapsed = time.perf_counter() - start
    return Load(latencies, errors, elapsed, time.process_time() - own0)


async def _send(part: Clients | Arrivals) -> Load:
    """The load ``part`` sent from this process."""
    load = await (_closed(part) if isinstance(part, Clients) else _open(part))
    return dataclasses.replace(load, cpus=current())


def _load_process(p: int, part: Clients | Arrivals, go: Any, results: Any, cpus: Collection[int] | None) -> None:
    """Load process ``p``: moves to ``cpus`` (if any), says it is ready (imports done), waits for ``go``, sends its
    part of the load, then puts what it got on ``results``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    results.put((p, None))
    go.wait()
    results.put((p, run_async(_send(part))))


def in_processes(parts: Sequence[Clients | Arrivals], begin: Callable[[], object] = lambda: None,
                 cpus: Collection[int] | None = None) -> list[Load]:
    """Each of ``parts`` in a process of its own (on ``cpus``, where given), all starting together once every process
    is ready (``begin`` is called just before: e.g. to read the server's totals then); what each got. A server that
    answers more than one process of aiohttp can send (about 3,500 requests/s to this service on a GPU machine's
    cores; 10,000-11,600 to a bare aiohttp server sharing these 2 cores) needs several.

    Raises:
        RuntimeError: a load process exited without its answer.
    """
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's threads or event loop
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_load_process, args=(p, part, go, results, cpus), daemon=True,
                         name=f"load process {p}")
             for p, part in enumerate(parts)]

    def collect() -> dict[int, Load | None]:
        """One message from every process."""
        got: dict[int, Load | None] = {}
        while len(got) < len(procs):
            try:
                p, load = results.get(timeout=1.0)
                got[p] = load
            except queue.Empty:
                dead = [p for p, proc in enumerate(procs) if proc.exitcode is not None and p not in got]
                if dead and results.empty():
                    raise RuntimeError(f"{procs[dead[0]].name} of the load generator exited with "
                                       f"{procs[dead[0]].exitcode}") from None
        return got

    for proc in procs:
        proc.start()
    try:
        collect()  # every process ready
        begin()
        go.set()
        loads = collect()
        return [load for _, load in sorted(loads.items()) if load is not None]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _spread(n: int, processes: int) -> list[tuple[int, int]]:
    """``(first, count)`` of ``n`` clients over at most ``processes`` processes, as even as can be."""
    processes = max(1, min(processes, n))
    counts = [n // processes + (p < n % processes) for p in range(processes)]
    return [(sum(counts[:p]), c) for p, c in enumerate(counts)]


async def _generate(parts: Sequence[Clients | Arrivals], concurrency: int, per_request: int,
                    cpu: Callable[[], dict[str, float] | None] | None, stats: Stats,
                    cpus: Collection[int] | None = None) -> Level:
    """Run the load ``parts`` (in this process if one, else each in a process of its own; on ``cpus``, where given)
    and count what the clients got, the server's batches meanwhile and, with ``cpu``, the CPU of the server's parts
    and of the load generator (this process and its load processes)."""
    cpu0, own0 = (cpu() if cpu else None), time.process_time()
    if len(parts) == 1:  # this process's CPU is the load generator's
        s0 = stats()
        (part,) = parts
        with pinned(cpus):
            loads, others = [await _send(part)], 0.0
    else:
        at_start: list[tuple[float, float, float]] = []
        loads = await asyncio.to_thread(in_processes, parts, lambda: at_start.append(stats()), cpus)
        s0, others = at_start[0], sum(load.cpu_s for load in loads)
    s1 = stats()
    cpu1, own1 = (cpu() if cpu else None), time.process_time()
    used = None if cpu0 is None or cpu1 is None else {
        **{part: cpu1[part] - cpu0[part] for part in cpu0}, "load_generator": own1 - own0 + others}
    latencies = [x for load in loads for x in load.latencies]
    return Level(concurrency, max(load.seconds for load in loads), latencies, sum(load.errors for load in loads),
                 len(latencies) * per_request, s1[0] - s0[0], s1[1] - s0[1], s1[2] - s0[2], used,
                 per_request=per_request, processes=len(parts),
                 load_cpus=tuple(sorted({c for load in loads for c in load.cpus})))


async def closed_loop(url: str, path: Target, texts: list[str], concurrency: int, seconds: float,
                      body: dict[str, Any] | None = None,
                      cpu: Callable[[], dict[str, float] | None] | None = None, stats: Stats | None = None,
                      processes: int = 1, per_request: int = 1, cpus: Collection[int] | None = None) -> Level:
    """``concurrency`` clients, each sending ``per_request`` texts at a time for ``seconds`` (aiohttp: about a
    tenth of httpx's CPU per request, measured here: 0.2 vs 2.0 ms), spread over ``processes`` load processes
    (one: in this process); with several ``path`` s, client ``w`` sends to ``path[w % len(path)]``; with a function,
    request ``k`` goes to ``path(k)`` (a function that pickles, with several processes). ``cpu``: CPU seconds used
    so far by the server's parts (see ``LocalServer.cpu``), to count where the machine's CPU went, the load
    generator's included. ``stats``: the server's batch totals (default: this service's metrics). ``cpus``: the CPUs
    the load generator runs on (default: this process's)."""
    parts = [Clients(url, path, texts, concurrency, seconds, body, per_request, first, count)
             for first, count in _spread(concurrency, processes)]
    return await _generate(parts, concurrency, per_request, cpu, stats or metrics_stats(url), cpus)


async def open_loop(url: str, path: str | Callable[[int], str], texts: list[str], rate: float, seconds: float,
                    seed: int = 0,
                    cpu: Callable[[], dict[str, float] | None] | None = None, stats: Stats | None = None,
                    processes: int = 1, cpus: Collection[int] | None = None) -> Level:
    """Poisson arrivals at ``rate`` requests per second for ``seconds`` (seeded), each one text, whatever is in
    flight; every latency counts from the request's scheduled time (a generator that falls behind adds its
    delay instead of hiding it); request ``k`` goes to ``path(k)`` when ``path`` is a function. With several
    ``processes``, each sends arrivals at ``rate / processes`` (seeded apart; together Poisson at ``rate``). Waits
    for the last answers; the level's concurrency is 0. ``cpus``: as for :func:`closed_loop`."""
    processes = max(1, processes)
    parts = [Arrivals(url, path, texts, rate / processes, seconds, seed + 7919 * p, 104729 * p)
             for p in range(processes)]
    return await _generate(parts, 0, 1, cpu, stats or metrics_stats(url), cpus)
