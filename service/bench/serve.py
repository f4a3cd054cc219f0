"""`routing-service bench serve`: closed-loop HTTP load at several concurrency levels, the same load
with dynamic batching off, the top level under other thread settings, short requests while one long
text is served, the engine's offline limit on the same texts, and peer frameworks serving the same model
(``service.bench.versus``), all in one run; for a server it starts, the CPU each part used per text. A
server with several processes of the model (replicas) is measured beside the others and against as many
processes offline.

The offline limit is measured on a process's main thread, as the model's process computes (the engine
alone ran 5-28 % faster there than in a worker thread here); the worker-thread figure is printed beside it."""

from __future__ import annotations

import asyncio
import functools
import random
import re
import statistics
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from service.bench import report
from service.bench.load import batch_stats, closed_loop, run_async
from service.bench.report import echo, in_worker_thread, whole_passes
from service.bench.server import LocalServer
from service.training.data import sample_test_texts

if TYPE_CHECKING:
    from service.bench import versus

NO_BATCHING = {"max_batch_size": 1, "max_wait_ms": 0}  # a server's settings with batching off


class Offline:
    """The engine alone (no HTTP, no queue), loaded in this process: texts per second at a batch size, on
    this process's main thread as the model's process computes (or in a worker thread, for reference), over
    whole passes of the texts (at least ``seconds``)."""

    def __init__(self, repository: Path, model: str, texts: list[str], device: str) -> None:
        from service.serving.engine.engine import Engine

        self.engine = in_worker_thread(lambda: Engine.load(repository / model, device=device))
        self.texts = texts
        self.ordered = sorted(texts, key=len)  # similar lengths together, as the batcher does: the best case

    def _throughput(self, texts: list[str], bs: int, seconds: float) -> float:
        from service.serving.core.work import Task

        batches = [texts[k : k + bs] for k in range(0, len(texts), bs)]
        self.engine.run([Task(t) for t in batches[0]])  # warm-up at this shape

        def one_pass() -> None:
            for batch in batches:
                self.engine.run([Task(t) for t in batch])

        return whole_passes(one_pass, len(texts), seconds)

    def throughput(self, bs: int, seconds: float, worker_thread: bool = False) -> float:
        """Texts/s in batches of ``bs`` texts of similar length (the best case)."""
        if worker_thread:
            return in_worker_thread(lambda: self._throughput(self.ordered, bs, seconds))
        return self._throughput(self.ordered, bs, seconds)

    def in_order(self, bs: int, seconds: float) -> float:
        """Texts/s in batches of ``bs`` consecutive texts as given: the batches a closed loop of ``bs`` clients
        forms when every batch holds them all (client ``w`` sends texts ``w``, ``w + bs``, ...)."""
        return self._throughput(self.texts, bs, seconds)


class ReplicasOffline:
    """The engine alone in ``n`` processes of the model, as a server with ``model_replicas=n`` runs it: each
    process computes every n-th batch, fed by a thread of its own, all at once."""

    def __init__(self, repository: Path, model: str, texts: list[str], device: str, n: int) -> None:
        from service.serving.engine.replicas import Replicas

        self.model = Replicas(repository / model, [device] * n)
        self.ordered = sorted(texts, key=len)

    def throughput(self, bs: int, seconds: float) -> float:
        from concurrent.futures import ThreadPoolExecutor

        from service.serving.core.work import Task

        batches = [self.ordered[k : k + bs] for k in range(0, len(self.ordered), bs)]
        runners = self.model.runners

        def run(r: int, part: list[list[str]]) -> None:
            for batch in part:
                runners[r]([w for plan in self.model.plan([Task(t) for t in batch]) for w in plan])

        with ThreadPoolExecutor(len(runners)) as pool:
            def one_pass() -> None:
                for f in [pool.submit(run, r, batches[r :: len(runners)]) for r in range(len(runners))]:
                    f.result()

            for r in range(len(runners)):  # warm-up at this shape
                run(r, batches[:1])
            return whole_passes(one_pass, len(self.ordered), seconds)

    def close(self) -> None:
        self.model.close()


def offline_limit(offline: Offline, batch_sizes: list[int], seconds: float, max_batch_size: int) -> dict[str, Any]:
    """Offline throughput by batch size on this process's main thread, as the model's process computes; the
    limit is the best of the batch sizes the server may form (at most its ``max_batch_size``; larger ones are
    measured and reported beside it). The same batch size in a worker thread is measured beside it.

    Raises:
        ValueError: no batch size is at most ``max_batch_size``.
    """
    if not any(bs <= max_batch_size for bs in batch_sizes):
        raise ValueError(f"no offline batch size is at most the server's max_batch_size {max_batch_size}")
    by_size = {}
    for bs in batch_sizes:
        by_size[bs] = offline.throughput(bs, seconds)
        echo(f"  offline batch size {bs} (main thread): {by_size[bs]:.1f} texts/s", err=True)
    best = max((b for b in by_size if b <= max_batch_size), key=lambda b: by_size[b])
    worker_thread = offline.throughput(best, seconds, worker_thread=True)
    echo(f"  offline batch size {best} (worker thread): {worker_thread:.1f} texts/s", err=True)
    return {"by_batch_size": by_size, "best_batch_size": best, "throughput": by_size[best],
            "worker_thread_throughput": worker_thread, "server_max_batch_size": max_batch_size}


def in_turns(measures: dict[str, Callable[[], float]], rounds: int, unit: str = "texts/s") -> dict[str, list[float]]:
    """Each of ``measures`` (a throughput in texts/s, or another ``unit``) once per round, the order rotating from
    round to round, so that a noisy machine's drift hits them alike; every round's value of each."""
    names = list(measures)
    per: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            per[n].append(measures[n]())
        echo(f"  round {r + 1}: " + ", ".join(f"{n} {per[n][-1]:.1f}" for n in names) + f" {unit}", err=True)
    return per


def served(url: str, texts: list[str], concurrency: int, seconds: float) -> Callable[[], float]:
    """Served throughput of the server at ``url`` at ``concurrency``, as a measure for :func:`in_turns`."""
    return lambda: run_async(closed_loop(url, "/v1/classify", texts, concurrency, seconds)).row()["throughput"]


def paired_rounds(url: str, texts: list[str], concurrency: int, offline: Offline | ReplicasOffline, batch_size: int,
                  seconds: float, rounds: int) -> dict[str, Any]:
    """Served throughput at ``concurrency`` and the offline limit at ``batch_size``, in turns; the ratio
    of sums."""
    per = in_turns({"served": served(url, texts, concurrency, seconds),
                    "offline": lambda: offline.throughput(batch_size, seconds)}, rounds)
    return {"concurrency": concurrency, "batch_size": batch_size, "served": per["served"],
            "offline": per["offline"], "ratio": sum(per["served"]) / sum(per["offline"])}


def alternating(urls: dict[str, str], texts: list[str], concurrency: int, seconds: float,
                rounds: int) -> dict[str, Any]:
    """Servers that are all up, each measured at ``concurrency`` in turns; texts/s per round and the mean
    of each."""
    per = in_turns({n: served(u, texts, concurrency, seconds) for n, u in urls.items()}, rounds)
    return {"concurrency": concurrency, "throughput": per, "mean": {n: sum(v) / len(v) for n, v in per.items()}}


def alongside(start: Callable[[dict[str, Any]], LocalServer], cfg: dict[str, Any], model_process: bool,
              texts: list[str], concurrency: int, seconds: float, rounds: int, url: str,
              replicas: int = 0) -> dict[str, Any]:
    """The server at ``url`` (settings ``cfg``), one with the other ``model_process`` setting, one without
    batching and (``replicas`` > 1, with model processes) one with that many processes of the model, all
    up at once and measured in turns at ``concurrency`` (a server per setting minutes apart carries the
    machine's drift into the ratios); the means and the ratios."""
    mine, other, unbatched = (f"model_process={model_process}", f"model_process={not model_process}",
                              f"model_process={model_process}, no batching")
    others = {other: {**cfg, "model_process": not model_process},
              unbatched: {**cfg, **NO_BATCHING}}
    replicated = f"model_replicas={replicas}"
    if replicas > 1 and model_process:
        others[replicated] = {**cfg, "model_replicas": replicas}
    servers: dict[str, LocalServer] = {}
    try:
        for name, c in others.items():
            servers[name] = start(c)
        for server in servers.values():
            server.wait_ready()
        echo(f"  {', '.join([mine, *others])}: each at concurrency {concurrency}, in turns", err=True)
        out = alternating({mine: url, **{n: s.url for n, s in servers.items()}}, texts, concurrency, seconds, rounds)
    finally:
        for server in servers.values():
            server.stop()
    means = out["mean"]
    process, thread = (means[mine], means[other]) if model_process else (means[other], means[mine])
    ratios = {"process_over_thread": process / thread, "batching_on_over_off": means[mine] / means[unbatched]}
    if replicated in means:
        ratios["replicas_over_one_process"] = means[replicated] / means[mine]
    return {**out, **ratios}


def replicas_paired(start: Callable[[dict[str, Any]], LocalServer], cfg: dict[str, Any], replicas: int,
                    repository: Path, model: str, texts: list[str], device: str, concurrency: int, batch_size: int,
                    seconds: float, rounds: int) -> dict[str, Any]:
    """A server with ``replicas`` processes of the model against the offline limit of as many processes
    (:class:`ReplicasOffline`), in turns, as :func:`paired_rounds` does for one."""
    echo(f"  model_replicas={replicas}: served at concurrency {concurrency} and offline in {replicas} processes at "
         f"batch size {batch_size}, {rounds} rounds in turns", err=True)
    server = start({**cfg, "model_replicas": replicas})
    offline = ReplicasOffline(repository, model, texts, device, replicas)
    try:
        server.wait_ready()
        run_async(closed_loop(server.url, "/v1/classify", texts, 4, 2.0))  # warm-up
        return {"replicas": replicas, **paired_rounds(server.url, texts, concurrency, offline, batch_size, seconds,
                                                      rounds)}
    finally:
        offline.close()
        server.stop()


def long_text(n_chars: int, seed: int = 0) -> str:
    """A valid text of ``n_chars`` characters where every character is one token (letters between dots)."""
    rng = random.Random(seed)
    return ".".join(rng.choice(string.ascii_lowercase) for _ in range((n_chars + 1) // 2))[:n_chars]


BATCH_LINE = re.compile(r"batch \S+: (\d+) items, \d+ groups, cost \d+, ([0-9.]+) s")


def batch_seconds(log: str) -> list[float]:
    """Compute time of every batch in a server log written at level debug (see ``Batcher._run``)."""
    return [float(m.group(2)) for m in BATCH_LINE.finditer(log)]


async def interference(url: str, short: list[str], long: str, n_idle: int = 20,
                       server_log: Callable[[], str] | None = None) -> dict[str, Any]:
    """Short requests, one at a time: idle, then while one long text is being served.

    The long text is first served alone: its batches (its chunks; the last one also runs the head) take
    ``one_batch`` each at most, read from the server's debug log when ``server_log`` gives it (the mean,
    from the metrics, otherwise). A short request that arrives while a batch computes waits for it, so
    the target is ``3 x idle p50 + one batch`` for every short request sent while the long text is in
    flight."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def post(text: str) -> float:
            t0 = time.perf_counter()
            r = await client.post("/v1/classify", json={"inputs": [text]})
            r.raise_for_status()
            return time.perf_counter() - t0

        idle = [await post(short[k % len(short)]) for k in range(n_idle)]
        s0, c0 = batch_stats(url, "routing_batch_compute_seconds")
        seen = len(batch_seconds(server_log())) if server_log else 0
        alone = await post(long)
        s1, c1 = batch_stats(url, "routing_batch_compute_seconds")
        mean_batch = (s1 - s0) / max(c1 - c0, 1)
        durations = batch_seconds(server_log())[seen:] if server_log else []
        one_batch = max(durations) if durations else mean_batch
        task = asyncio.ensure_future(post(long))
        during: list[float] = []
        k = 0
        while not task.done():
            during.append(await post(short[k % len(short)]))
            k += 1
        served_long = await task
    idle_p50 = statistics.median(idle)
    limit = 3 * idle_p50 + one_batch
    worst = max(during) if during else float("nan")
    return {"idle_p50_ms": 1000 * idle_p50, "one_batch_ms": 1000 * one_batch, "mean_batch_ms": 1000 * mean_batch,
            "one_batch_is": "longest" if durations else "mean", "batches_alone": c1 - c0,
            "long_alone_s": alone, "long_with_shorts_s": served_long, "short_requests": len(during),
            "short_p50_ms": 1000 * statistics.median(during) if during else float("nan"),
            "short_max_ms": 1000 * worst, "limit_ms": 1000 * limit, "met": bool(during) and worst <= limit}


def run(model: str, preset: str, levels: list[int], duration: float, n_texts: int, repository: Path, device: str,
        max_wait_ms: float, max_batch_size: int, offline_batch_sizes: list[int], url: str | None,
        out: Path, thread_configs: list[tuple[int | None, str | None]], long_chars: int,
        model_process: bool = True, rounds: int = 3, replicas: int = 2, other_settings: bool = True,
        peers: versus.Plan | None = None, load_processes: int = 1) -> dict[str, Any]:
    """The whole benchmark: print tables, write JSON, return the summary. ``other_settings``: also the servers
    without batching, with other thread settings, with the other ``model_process`` and with replicas;
    ``peers``: the comparison with peer frameworks (servers this run starts only); ``load_processes``: the load
    generator's processes at every level and in the peer comparison."""
    texts = sample_test_texts(preset, n_texts)
    echo(f"bench serve: model {model}, {len(texts)} test texts (mean {sum(map(len, texts)) / len(texts):.0f}"
         f" chars), levels {levels}, {duration:.0f} s each", err=True)
    offline = Offline(repository, model, texts, device)
    limit = offline_limit(offline, offline_batch_sizes, duration, max_batch_size)
    logs = out.parent / "logs"

    def start(cfg: dict[str, Any]) -> LocalServer:
        """A server of this model with ``cfg`` (debug log: the interference figure reads its batches)."""
        return LocalServer(logs, model_repository=repository, models=model, default_model=model, max_queue=100000,
                           device=device, log_level="debug", **cfg)

    runs: dict[str, list[dict]] = {}
    top = 32 if 32 in levels else max(levels)  # where served / offline and the thread settings are compared
    base = {"max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms, "model_process": model_process}
    configs: list[tuple[str, dict[str, Any], list[int]]] = [("batching", base, levels)]
    if url is None and other_settings:
        configs.append(("no_batching", {**base, **NO_BATCHING}, levels))
        for threads, policy in thread_configs:
            cfg: dict[str, Any] = dict(base)
            if threads:
                cfg["torch_threads"] = threads
            if policy:
                cfg["omp_wait_policy"] = policy
            configs.append((f"threads={threads or 'auto'} wait={policy or 'default'}", cfg, [top]))
    inter: dict[str, Any] | None = None
    paired: dict[str, Any] | None = None
    beside: dict[str, Any] | None = None
    replicated: dict[str, Any] | None = None
    for name, cfg, lv in configs:
        server = start(cfg).wait_ready() if url is None else None
        target = server.url if server else str(url)
        try:
            run_async(closed_loop(target, "/v1/classify", texts, 4, 2.0))  # warm-up
            runs[name] = []
            for c in lv:
                row = run_async(closed_loop(target, "/v1/classify", texts, c, duration,
                                            cpu=server.cpu if server else None, processes=load_processes)).row()
                runs[name].append(row)
                echo(f"  {name} c={c}: {row['throughput']:.1f} texts/s, p50 {row['p50_ms']:.0f} ms, "
                     f"p99 {row['p99_ms']:.0f} ms, mean batch {row['mean_batch']:.1f}, errors {row['errors']}",
                     err=True)
            if name == "batching":
                echo(f"  served at concurrency {top} and offline at batch size {limit['best_batch_size']}, "
                     f"{rounds} rounds in turns", err=True)
                paired = paired_rounds(target, texts, top, offline, limit["best_batch_size"], duration, rounds)
                if server is not None and other_settings:  # each up beside this server, measured in turns
                    beside = alongside(start, cfg, model_process, texts, top, duration, rounds, target, replicas)
                    if replicas > 1 and model_process:
                        replicated = replicas_paired(start, cfg, replicas, repository, model, texts, device, top,
                                                     limit["best_batch_size"], duration, rounds)
                if long_chars:
                    echo(f"  short requests while one {long_chars}-character text is served", err=True)
                    inter = asyncio.run(interference(target, texts, long_text(long_chars),
                                                     server_log=server.full_log if server else None))
        finally:
            if server is not None:
                server.stop()
    peered = None
    if peers is not None and url is None:
        from service.bench import versus

        echo("  peer frameworks serving the same model", err=True)
        per = peers.texts_per_request  # the engine alone computes the batches of ``level * per`` texts in flight
        peered = versus.measure(peers, repository, model, device, max_batch_size, max_wait_ms, logs, texts, duration,
                                engine={level: functools.partial(offline.in_order, level * per, duration)
                                        for level in peers.levels if level * per <= max_batch_size})
    return report_all(runs, limit, paired, beside, replicated, inter, peered, top, max_wait_ms, out, {
        "model": model, "texts": len(texts), "levels": levels, "duration_s": duration, "device": device,
        "max_wait_ms": max_wait_ms, "max_batch_size": max_batch_size, "url": url, "long_chars": long_chars,
        "thread_configs": thread_configs, "model_process": model_process, "rounds": rounds, "replicas": replicas,
        "other_settings": other_settings, "load_processes": load_processes, "peers": None if peers is None else {
            **vars(peers), "baseline": str(peers.baseline) if peers.baseline else None}})


CPU_PARTS = ("models", "server", "load_generator")


def cpu_split(row: dict[str, Any]) -> dict[str, float]:
    """A level's CPU ms per text by part, and the models' share of their sum (empty if not measured)."""
    ms = {part: row[f"{part}_cpu_ms"] for part in CPU_PARTS if f"{part}_cpu_ms" in row}
    if len(ms) < len(CPU_PARTS):
        return {}
    share = ms["models"] / max(sum(ms.values()), 1e-9)
    return {**{f"{part}_cpu_ms": v for part, v in ms.items()}, "models_share": share}


def report_all(runs: dict[str, list[dict]], offline: dict[str, Any], paired: dict[str, Any] | None,
               beside: dict[str, Any] | None, replicated: dict[str, Any] | None, inter: dict[str, Any] | None,
               peered: dict[str, Any] | None, top: int, max_wait_ms: float, out: Path,
               settings: dict[str, Any]) -> dict[str, Any]:
    cols = ["concurrency", "throughput", "p50_ms", "p95_ms", "p99_ms", "mean_batch", "model_busy", "batch_ms",
            "errors", "requests"]
    for name, rows in runs.items():
        echo(f"\n{name} (texts/s, latency per request of one text):")
        echo(report.table(rows, cols))
    by_size = {k: round(v, 1) for k, v in offline["by_batch_size"].items()}
    beyond = {b: v for b, v in by_size.items() if b > offline["server_max_batch_size"]}
    echo(f"\noffline engine limit (main thread, as the model's process computes, batches of at most the server's "
         f"max_batch_size {offline['server_max_batch_size']}): {offline['throughput']:.1f} texts/s at batch size "
         f"{offline['best_batch_size']} (by batch size: {by_size}"
         + (f"; {beyond} beyond what the server forms" if beyond else "")
         + f"); worker thread: {offline['worker_thread_throughput']:.1f} texts/s")
    at_top = {name: row for name, rows in runs.items() for row in rows if row["concurrency"] == top}
    summary: dict[str, Any] = {
        "offline_texts_per_s": offline["throughput"],
        "offline_worker_thread_texts_per_s": offline["worker_thread_throughput"],
        f"served_over_offline_at_c{top}": {n: r["throughput"] / offline["throughput"] for n, r in at_top.items()},
    }
    if paired is not None:
        echo(f"\nserved at concurrency {top} / offline at batch size {paired['batch_size']} (main thread), measured "
             f"in turns: {paired['ratio']:.3f} (served {[round(v, 1) for v in paired['served']]}, offline "
             f"{[round(v, 1) for v in paired['offline']]} texts/s)")
        summary[f"served_over_offline_at_c{top}_paired"] = paired["ratio"]
    if beside is not None:
        means = ", ".join(f"{n}: {v:.1f}" for n, v in beside["mean"].items())
        echo(f"\nthe servers up side by side at concurrency {top}, measured in turns (mean texts/s): {means}")
        echo(f"  the model in its own process / in a thread of the server: {beside['process_over_thread']:.3f}")
        echo(f"  batching on / off: {beside['batching_on_over_off']:.3f}")
        summary["side_by_side"] = beside["mean"]
        summary[f"batching_on_over_off_at_c{top}_in_turns"] = beside["batching_on_over_off"]
        summary[f"process_over_thread_at_c{top}_in_turns"] = beside["process_over_thread"]
        if "replicas_over_one_process" in beside:
            echo(f"  {settings['replicas']} processes of the model / one: {beside['replicas_over_one_process']:.3f}")
            summary[f"replicas_over_one_process_at_c{top}_in_turns"] = beside["replicas_over_one_process"]
    if replicated is not None:
        echo(f"\nmodel_replicas={replicated['replicas']}: served at concurrency {top} / offline in as many processes "
             f"at batch size {replicated['batch_size']}, in turns: {replicated['ratio']:.3f} (served "
             f"{[round(v, 1) for v in replicated['served']]}, offline {[round(v, 1) for v in replicated['offline']]} "
             "texts/s)")
        summary[f"replicas_served_over_offline_at_c{top}_paired"] = replicated["ratio"]
    best = max(runs["batching"], key=lambda r: r["throughput"])
    summary["served_over_offline_at_saturation"] = best["throughput"] / offline["throughput"]
    summary["saturation_concurrency"] = best["concurrency"]
    if "no_batching" in runs:
        ratios = []
        single = runs["no_batching"][0]["p50_ms"]
        for on, off in zip(runs["batching"], runs["no_batching"], strict=True):
            ratios.append({"concurrency": on["concurrency"],
                           "throughput_on_over_off": on["throughput"] / off["throughput"],
                           "p99_on_ms": on["p99_ms"], "p99_limit_ms": 2 * single + max_wait_ms})
        echo("\nbatching on / off (same texts, same run); p99 limit = 2 x single-request p50 + max_wait_ms:")
        echo(report.table(ratios, ["concurrency", "throughput_on_over_off", "p99_on_ms", "p99_limit_ms"]))
        summary["batching_on_over_off"] = {r["concurrency"]: r["throughput_on_over_off"] for r in ratios}
    def offline_batch_ms(mean_batch: float) -> float:
        """Offline time of one batch of the measured size nearest ``mean_batch``."""
        size = min(offline["by_batch_size"], key=lambda b: abs(int(b) - mean_batch))
        return 1000 * int(size) / offline["by_batch_size"][size]

    echo(f"\nat concurrency {top}, served / offline (main thread); model busy: share of the time the model "
         "computed batches; batch ms: per batch in the server, and offline at the nearest batch size; CPU ms "
         "per text of the models' processes, the server's process and the load generator, and the models' "
         "share of the three (the offline limit gives the model the whole machine):")
    cpu = {n: cpu_split(r) for n, r in at_top.items()}
    rows = [{"server": n, "texts/s": r["throughput"], "served/offline": r["throughput"] / offline["throughput"],
             "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "model_busy": r["model_busy"], "batch_ms": r["batch_ms"],
             "offline_batch_ms": offline_batch_ms(r["mean_batch"]), **cpu[n]} for n, r in at_top.items()]
    echo(report.table(rows, list(rows[0]) if rows else []))
    summary[f"cpu_ms_per_text_at_c{top}"] = {n: split for n, split in cpu.items() if split}
    if inter is not None:
        echo("\nshort requests while one long text is served (target: each <= 3 x idle p50 + one batch):")
        echo(report.table([inter], list(inter)))
        summary["long_text_interference"] = inter
    if peered is not None:
        summary["this_over_peers"] = {kind: {level: {n: m["this_over_it"] for n, m in d["summary"].items()}
                                             for level, d in peered[kind].items()} for kind in ("closed", "open")}
        summary["peers_p99_ms"] = {level: {n: m["p99_ms"] for n, m in d["summary"].items()}
                                   for level, d in peered["closed"].items()}
        shares = {level: {n: m["of_engine_alone"] for n, m in d["summary"].items() if "of_engine_alone" in m}
                  for level, d in peered["closed"].items()}
        summary["peers_of_engine_alone"] = {level: s for level, s in shares.items() if s}
    path = report.write_json(out, "serve", settings, {"runs": runs, "offline": offline, "paired": paired,
                                                      "side_by_side": beside, "replicas": replicated,
                                                      "interference": inter, "peers": peered}, summary)
    echo(f"wrote {path}")
    return summary
