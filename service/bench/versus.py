"""This service against peer frameworks serving the same model function (``service.bench.peers``), all started
and measured in turns with the same load generator and texts, each while the others are paused (an idle
framework that polls would take CPU from the one measured): closed loops at several concurrencies, then
open-loop Poisson arrivals at fractions of this service's capacity. A ``baseline`` checkout of this
repository can run beside them (to compare a change of the batching policy under the same load). In the
same turns, every server paused, the model function alone in the bench's process computes the batches a
closed loop of at most ``max_batch_size`` clients forms (each batch holds every client): what no server of
that function can exceed on this machine at that concurrency."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from service.bench.load import Level, Stats, closed_loop, metrics_stats, open_loop, run_async
from service.bench.report import echo, repository_for
from service.bench.server import LocalServer, PeerServer, ServerProcess, ready_together

THIS = "routing-service"
ENGINE = "engine alone"  # the model function with no server, on the batches the clients form


@dataclass
class Contender:
    """A server under test: where to send a text, and how to read its batch totals and CPU."""

    name: str
    server: ServerProcess
    path: str
    stats: Stats
    cpu: Callable[[], dict[str, float] | None]


def peer_stats(server: PeerServer) -> Stats:
    """A peer's batch totals from the sizes its model logs (it has no compute time: 0)."""
    def read() -> tuple[float, float, float]:
        texts, batches = server.batches()
        return float(texts), float(batches), 0.0
    return read


def with_fronts(n: int) -> str:
    """The name of this service with ``n`` fronts set (``ROUTING_WORKERS=n``) beside its default."""
    return f"{THIS}, {n} front{'s' if n > 1 else ''}"


def start(peers: list[str], repository: Path, model: str, device: str, max_batch_size: int, max_wait_ms: float,
          logs: Path, baseline: Path | None, fronts: Sequence[int] = ()) -> list[Contender]:
    """This service (its defaults but the batch settings: its fronts as ``ROUTING_WORKERS=auto`` picks them on this
    machine's CPUs, one on a CPU box), with each number of ``fronts`` too, the baseline's (``model`` from its own
    checkout's models where it has it: see :func:`service.bench.report.repository_for`) and each peer, all up and
    answering."""
    settings = {"model_repository": repository.resolve(), "models": model, "default_model": model,
                "max_queue": 100000, "device": device, "max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms}
    local: list[tuple[str, Path | None, dict[str, object]]] = [
        (THIS, None, {}), *((with_fronts(n), None, {"workers": n}) for n in fronts),
        *([("baseline", baseline, {"model_repository": repository_for(baseline, repository, model)})]
          if baseline else [])]
    servers = ready_together([
        *(functools.partial(LocalServer, logs, checkout=checkout, **{**settings, **more})
          for _, checkout, more in local),
        *(functools.partial(PeerServer, logs, peer, (repository / model).resolve(), device, max_batch_size,
                            max_wait_ms) for peer in peers)])
    return [Contender(name, s, s.path, peer_stats(s), s.cpu) if isinstance(s, PeerServer)
            else Contender(name, s, "/v1/classify", metrics_stats(s.url), s.cpu)
            for name, s in zip([name for name, _, _ in local] + peers, servers, strict=True)]


def stop(contenders: list[Contender]) -> None:
    for c in contenders:
        c.server.stop()


def _total_cpu(c: Contender) -> Callable[[], dict[str, float] | None]:
    """A contender's CPU seconds as one figure (the parts differ from framework to framework), and for this
    service's servers the fronts' part too (``front``: every process but the backbones'; ``host``: of it, the engine
    host's, with several fronts)."""
    def read() -> dict[str, float] | None:
        parts = c.cpu()
        if parts is None:
            return None
        if "models" not in parts:
            return {"server": sum(parts.values())}
        return {"server": parts["server"] + parts["models"], "front": parts["server"],
                **({"host": parts["host"]} if "host" in parts else {})}
    return read


def row(level: Level, **extra: Any) -> dict[str, Any]:
    r = level.row()
    keep = {k: r[k] for k in ("throughput", "p50_ms", "p99_ms", "mean_batch", "errors", "requests", "load_cpus")}
    return {**extra, **keep, "server_cpu_ms": r.get("server_cpu_ms"), "front_cpu_ms": r.get("front_cpu_ms"),
            "host_cpu_ms": r.get("host_cpu_ms"), "load_generator_cpu_ms": r.get("load_generator_cpu_ms")}


@contextlib.contextmanager
def paused(contenders: list[Contender]) -> Iterator[None]:
    """Every one of ``contenders`` stopped (SIGSTOP) until the block ends."""
    for o in contenders:
        o.server.pause()
    try:
        yield
    finally:
        for o in contenders:
            o.server.resume()


@contextlib.contextmanager
def alone(contenders: list[Contender], c: Contender, texts: list[str]) -> Iterator[None]:
    """``c`` with every other contender paused, after a second of warm-up (it may itself have been paused)."""
    with paused([o for o in contenders if o is not c]):
        run_async(closed_loop(c.server.url, c.path, texts, 4, 1.0, stats=c.stats))
        yield


def rows_in_turns(contenders: list[Contender], measure: Callable[[Contender], dict[str, Any]], rounds: int,
                  label: str, texts: list[str], engine: Callable[[], float] | None = None,
                  ) -> tuple[dict[str, list[dict[str, Any]]], list[float]]:
    """``measure`` of each contender once per round, the others paused (:func:`alone`), the order rotating from
    round to round; with ``engine`` (texts/s of the model function alone), it takes a turn too, every
    contender paused. Each contender's rows, and the engine's texts/s per round (empty without it)."""
    per: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contenders}
    alone_rounds: list[float] = []
    turns: list[Contender | None] = [*contenders, *([None] if engine else [])]  # None: the engine's turn
    for r in range(rounds):
        for c in turns[r % len(turns):] + turns[: r % len(turns)]:
            if c is not None:
                with alone(contenders, c, texts):
                    per[c.name].append(measure(c))
            elif engine is not None:
                with paused(contenders):
                    alone_rounds.append(engine())
        echo(f"  {label}, round {r + 1}: " + ", ".join(
            f"{n} {v[-1]['throughput']:.1f}/s p99 {v[-1]['p99_ms']:.0f} ms batch {v[-1]['mean_batch']:.1f}"
            for n, v in per.items()) + (f", {ENGINE} {alone_rounds[-1]:.1f}/s" if alone_rounds else ""), err=True)
    return per, alone_rounds


def mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one contender at one level: throughput and batch averaged, latencies the worst round's
    p99 and the median round's p50 (each round's percentiles are over its own requests)."""
    n = len(rows)
    p50 = sorted(r["p50_ms"] for r in rows)[n // 2]
    cpu = {f"{part}_cpu_ms": sum(r[f"{part}_cpu_ms"] for r in rows) / n for part in ("server", "front", "host")
           if all(r.get(f"{part}_cpu_ms") is not None for r in rows)}  # per text answered, the rounds' mean
    return {"throughput": sum(r["throughput"] for r in rows) / n, "p50_ms": p50,
            "p99_ms": max(r["p99_ms"] for r in rows), "mean_batch": sum(r["mean_batch"] for r in rows) / n,
            "errors": sum(r["errors"] for r in rows), "rounds": [round(r["throughput"], 1) for r in rows], **cpu}


def compare(contenders: list[Contender], texts: list[str], levels: list[int], seconds: float, rounds: int,
            open_fractions: list[float], engine: dict[int, Callable[[], float]] | None = None,
            processes: int = 1, per_request: int = 1, load_cpus: Collection[int] | None = None) -> dict[str, Any]:
    """Closed loops at ``levels`` (each client sending ``per_request`` texts a request), then open loops at
    ``open_fractions`` of this service's best closed-loop throughput (one text a request), each measured in turns,
    the load from ``processes`` processes (on ``load_cpus``, where given); per level, each contender's mean row (texts
    a second) and its ratio to this service.
    ``engine[level]``: texts/s of the model function alone on the batches a closed loop of ``level`` clients
    forms, measured in that level's turns; each contender's share of it at that level."""
    closed: dict[int, tuple[dict[str, list[dict[str, Any]]], list[float]]] = {}
    for level in levels:
        closed[level] = rows_in_turns(contenders, lambda c, level=level: row(run_async(closed_loop(
            c.server.url, c.path, texts, level, seconds, cpu=_total_cpu(c), stats=c.stats, processes=processes,
            per_request=per_request, cpus=load_cpus)), concurrency=level, texts_per_request=per_request),
            rounds, f"c={level}" + (f" x{per_request}" if per_request > 1 else ""), texts,
            engine=(engine or {}).get(level))
    capacity = max(mean_row(per[THIS])["throughput"] for per, _ in closed.values())
    opened: dict[float, dict[str, list[dict[str, Any]]]] = {}
    for fraction in open_fractions:
        rate = fraction * capacity
        opened[fraction], _ = rows_in_turns(contenders, lambda c, rate=rate, fraction=fraction: row(run_async(
            open_loop(c.server.url, c.path, texts, rate, seconds, cpu=_total_cpu(c), stats=c.stats,
                      processes=processes, cpus=load_cpus)),
            fraction=fraction, rate=rate), rounds, f"open loop at {fraction:.0%} of {capacity:.1f} texts/s", texts)

    def summary(per: dict[str, list[dict[str, Any]]], alone_rounds: list[float] | None = None) -> dict[str, Any]:
        means = {n: mean_row(rows) for n, rows in per.items()}
        ours = means[THIS]["throughput"]
        limit = sum(alone_rounds) / len(alone_rounds) if alone_rounds else None
        return {n: {**m, "this_over_it": ours / m["throughput"] if m["throughput"] else float("nan"),
                    **({"of_engine_alone": m["throughput"] / limit} if limit else {})}
                for n, m in means.items()}

    return {"capacity_texts_per_s": capacity, "texts_per_request": per_request,
            "closed": {lv: {"rounds": per, "summary": summary(per, alone_rounds),
                            **({ENGINE: {"rounds": alone_rounds, "throughput": sum(alone_rounds) / len(alone_rounds)}}
                               if alone_rounds else {})}
                       for lv, (per, alone_rounds) in closed.items()},
            "open": {f: {"rate": f * capacity, "rounds": per, "summary": summary(per)} for f, per in opened.items()}}


@dataclass(frozen=True)
class Plan:
    """What ``bench serve`` compares: the peers (keys of ``service.bench.server.PEERS``), a baseline checkout,
    the closed-loop levels, the open-loop fractions of capacity, and the rounds of turns."""

    peers: list[str]
    baseline: Path | None
    levels: list[int]
    open_fractions: list[float]
    rounds: int
    fronts: list[int] = field(default_factory=list)
    """Also this service with each of these numbers of front processes (``ROUTING_WORKERS``)."""
    load_processes: int = 1
    """Processes of the load generator (see :func:`service.bench.load.closed_loop`)."""
    texts_per_request: int = 1
    """Texts in each request of the closed loops (the open loops send one)."""


def measure(plan: Plan, repository: Path, model: str, device: str, max_batch_size: int, max_wait_ms: float,
            logs: Path, texts: list[str], seconds: float,
            engine: dict[int, Callable[[], float]] | None = None) -> dict[str, Any]:
    """Start every contender, compare them (see :func:`compare`, ``engine`` too), stop them; print the tables."""
    names = [THIS, *map(with_fronts, plan.fronts), *(["baseline"] if plan.baseline else []),
             *plan.peers]
    echo(f"  {', '.join(names)}: each measured while the others are paused, closed loops at {plan.levels} ("
         f"{plan.texts_per_request} text{'s' if plan.texts_per_request > 1 else ''} a request) and open loops at "
         f"{plan.open_fractions} of capacity, {plan.rounds} rounds in turns, {seconds:.0f} s each", err=True)
    contenders = start(plan.peers, repository, model, device, max_batch_size, max_wait_ms, logs, plan.baseline,
                       plan.fronts)
    try:
        result = compare(contenders, texts, plan.levels, seconds, plan.rounds, plan.open_fractions, engine,
                         plan.load_processes, plan.texts_per_request)
        result["versions"] = {peer: version(peer) for peer in plan.peers}
        result["pss_mib"] = memory(contenders)
    finally:
        stop(contenders)
    report(result)
    return result


def memory(contenders: list[Contender]) -> dict[str, dict[str, float]]:
    """This service's servers' proportional set size now (MiB), after the comparison: the backbones' processes and
    the rest (see ``LocalServer.pss``)."""
    out = {}
    for c in contenders:
        pss = c.server.pss() if isinstance(c.server, LocalServer) else None
        if pss is not None:
            out[c.name] = {**{part: b / 2**20 for part, b in pss.items()}, "total": sum(pss.values()) / 2**20}
    return out


def report(result: dict[str, Any]) -> None:
    from service.bench.report import table

    cols = ["server", "texts/s", "this / it", "p50_ms", "p99_ms", "mean_batch", "errors", "rounds"]

    def rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"server": n, "texts/s": m["throughput"], "this / it": m["this_over_it"],
                 "of engine alone": m.get("of_engine_alone", ""), **{c: m[c] for c in cols[3:]}}
                for n, m in summary.items()]

    def engine_row(d: dict[str, Any]) -> list[dict[str, Any]]:
        e = d.get(ENGINE)
        return [] if e is None else [{"server": ENGINE, "texts/s": e["throughput"], "of engine alone": 1.0,
                                      "rounds": [round(v, 1) for v in e["rounds"]]}]

    per = result.get("texts_per_request", 1)
    echo(f"\nthe same model behind each server, closed loop ({per} text{'s' if per > 1 else ''} per request), measured "
         "in turns; texts/s and batch averaged over the rounds, p50 the median round's, p99 the worst round's; the "
         "engine alone: the model function with no server on the batches the clients form (where the texts in flight "
         "are at most the servers' max_batch_size: batches of that many texts in the clients' order), every server "
         "paused:")
    echo(table([{"concurrency": lv, **r} for lv, d in result["closed"].items()
                for r in rows(d["summary"]) + engine_row(d)], ["concurrency", *cols[:3], "of engine alone", *cols[3:]]))
    if result["open"]:
        echo(f"\nopen loop: Poisson arrivals at fractions of this service's best closed-loop throughput "
             f"({result['capacity_texts_per_s']:.1f} texts/s), latency from each request's scheduled time:")
        echo(table([{"load": f, "rate": d["rate"], **r} for f, d in result["open"].items()
                    for r in rows(d["summary"])], ["load", "rate", *cols]))
