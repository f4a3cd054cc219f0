"""`routing-service bench heads`: many heads on one backbone.

- Heads: ``K`` perturbed copies of the bundled ``tweet-sentiment`` head (same shape, other weights, seeded) in a
  temporary repository beside the bundled model.
- Head step (offline, in this process, on its main thread): one batch of ``batch`` test tweets through the
  backbone alone, and the whole step with every text on one head, each text on a head of its own run head by
  head, and the same gathered (the heads' parameters stacked, one call); in turns. The head step's share of a
  batch is the whole step less the backbone alone.
- Served (one server, head cache large enough for every head, the bundled model pinned): time to ready, memory
  (PSS of the server's processes) with the pinned model only and with every head in memory, then texts/s, p50,
  p99 and mean batch at concurrency ``c`` (closed loop) for the single-head workload (every request to
  ``tweet-sentiment``) and for requests that each name a head drawn uniformly from the first ``K`` heads, for
  each ``K``, in turns; and an open loop (Poisson arrivals at ``open_share`` of the single-head rate) of both.
- With a budget (a second server, head cache of ``budget_heads`` heads' bytes, every head in use): the same
  uniform workload, texts/s, p50, p99, hit rate and evictions; and a sample of (head, text) answers compared
  with the first server's (<= 1e-5).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from service.bench.load import Level, closed_loop, open_loop, run_async
from service.bench.report import echo, median_ms, table, write_json
from service.bench.repository import MIB, copy_model
from service.bench.serve import in_turns
from service.bench.server import LocalServer
from service.training.data import sample_test_texts

MODEL = "tweet-sentiment"


def make_heads(source: Path, repo: Path, k: int) -> list[str]:
    """``k`` perturbed copies of the model folder ``source`` in ``repo`` (head-0000, ...); their names."""
    names = [f"head-{i:04d}" for i in range(k)]
    t0 = time.monotonic()
    for i, name in enumerate(names):
        copy_model(source, repo, name, seed=i + 1)
        if (i + 1) % 100 == 0 or i + 1 == k:
            echo(f"  {i + 1}/{k} heads written ({time.monotonic() - t0:.0f} s)", err=True)
    return names


def head_step(repo: Path, model: str, names: list[str], texts: list[str], batch: int, reps: int, rounds: int
              ) -> dict[str, Any]:
    """One batch's backbone alone and its whole step on one head (``model``), on a head per text (by head,
    gathered)."""
    from service.serving.core.work import Task
    from service.serving.engine.engine import Engine

    engine = Engine.load([repo / model] + [repo / n for n in names[:batch]], device="cpu")
    rng = random.Random(0)
    chosen = [rng.choice(texts) for _ in range(batch)]
    workloads = {"one head": [Task(t, model=model) for t in chosen],
                 "a head per text": [Task(t, model=names[i % len(names)]) for i, t in enumerate(chosen)]}

    def step(tasks: list[Task], gather: bool) -> Callable[[], float]:
        def measure() -> float:
            engine.gather_heads = gather
            plans = [[w for plan in engine.plan(tasks) for w in plan] for _ in range(reps + 1)]
            engine.run_chunks(plans.pop())  # warm-up at this shape
            return median_ms(lambda: engine.run_chunks(plans.pop()), reps)
        return measure

    ids = [list(w.ids) for plan in engine.plan(workloads["one head"]) for w in plan]
    measures = {"backbone alone": lambda: median_ms(lambda: engine.backbone.run_chunks(ids), reps),
                "one head": step(workloads["one head"], False),
                "a head per text, by head": step(workloads["a head per text"], False),
                "a head per text, gathered": step(workloads["a head per text"], True)}
    per = in_turns(measures, rounds, unit="ms per batch")
    engine.gather_heads = False
    ms = {name: statistics.median(values) for name, values in per.items()}
    backbone = ms["backbone alone"]
    rows = [{"step": name, "batch_ms": ms[name], "head_ms": ms[name] - backbone,
             "head_share": (ms[name] - backbone) / ms[name]} for name in measures if name != "backbone alone"]
    return {"batch": batch, "rounds_ms": per, "backbone_ms": backbone, "rows": rows}


def _pss_mib(server: LocalServer) -> float:
    time.sleep(1.0)
    pss = server.pss()
    if pss is None:
        raise RuntimeError("cannot read the server's memory (/proc/<pid>/smaps_rollup)")
    return sum(pss.values()) / MIB


CACHE_SERIES = ("hits_total", "misses_total", "evictions_total", "resident_heads")


def _cache_metrics(url: str) -> dict[str, float]:
    """The head cache's counters and resident heads now, from one scrape of the server's metrics."""
    page = httpx.get(f"{url}/metrics", timeout=30).text
    values = dict.fromkeys(CACHE_SERIES, 0.0)
    for line in page.splitlines():
        for series in CACHE_SERIES:
            if line.startswith(f"routing_head_cache_{series} "):
                values[series] = float(line.rsplit(" ", 1)[1])
    return values


async def _answers(url: str, pairs: list[tuple[str, str]], concurrency: int) -> list[dict[str, float] | int]:
    """Each (head, text)'s scores, or its status when not 200."""
    out: list[dict[str, float] | int] = [0] * len(pairs)
    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=300)) as session:
        queue = list(enumerate(pairs))

        async def client() -> None:
            while queue:
                k, (head, text) = queue.pop()
                async with session.post(f"/v1/models/{head}/classify", json={"inputs": [text]}) as r:
                    out[k] = (await r.json())["results"][0]["scores"] if r.status == 200 else r.status

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


def uniform(names: list[str], seed: int) -> Callable[[int], str]:
    """Request ``k``'s path: a head drawn uniformly from ``names`` (seeded)."""
    rng = random.Random(seed)
    draws = [rng.choice(names) for _ in range(100_000)]
    return lambda k: f"/v1/models/{draws[k % len(draws)]}/classify"


def served(repo: Path, model: str, names: list[str], ks: list[int], texts: list[str], concurrency: int, seconds: float,
           rounds: int, open_share: float, pairs: list[tuple[str, str]], logs: Path) -> dict[str, Any]:
    """One server, ``model`` pinned and room for every head: readiness, memory, the workloads in turns, an open
    loop, and the answers to ``pairs`` (the reference for :func:`budgeted`)."""
    head_bytes = (repo / names[0] / "head.safetensors").stat().st_size
    t0 = time.monotonic()
    server = LocalServer(logs, model_repository=repo, models=model, default_model=model, max_queue=100000,
                         head_cache_bytes=int(2 * head_bytes * (len(names) + 1))).wait_ready()
    ready_s = time.monotonic() - t0
    try:
        pss_one = _pss_mib(server)
        echo(f"  ready in {ready_s:.1f} s with {model} pinned ({pss_one:.0f} MiB); bringing {len(names)} heads in",
             err=True)
        t1 = time.monotonic()
        statuses = run_async(_answers(server.url, [(n, texts[0]) for n in names], concurrency))
        warm_s = time.monotonic() - t1
        if any(isinstance(s, int) for s in statuses):
            raise RuntimeError(f"bringing the heads in failed: {[s for s in statuses if isinstance(s, int)][:5]}")
        pss_all = _pss_mib(server)
        echo(f"  every head in memory after {warm_s:.1f} s ({pss_all:.0f} MiB)", err=True)
        levels: dict[str, list[dict[str, Any]]] = {}

        def closed(name: str, path: str | Callable[[int], str]) -> Callable[[], float]:
            def measure() -> float:
                row = run_async(closed_loop(server.url, path, texts, concurrency, seconds)).row()
                levels.setdefault(name, []).append(row)
                return row["throughput"]
            return measure

        measures = {"single head": closed("single head", f"/v1/models/{model}/classify")}
        measures.update({f"K={k}": closed(f"K={k}", uniform(names[:k], seed=k)) for k in ks})
        per = in_turns(measures, rounds)
        single = statistics.mean(per["single head"])
        rate = open_share * single
        opened: dict[str, dict[str, Any]] = {}
        for name, path in ((f"K={max(ks)}", uniform(names, seed=1)), ("single head", f"/v1/models/{model}/classify")):
            level: Level = run_async(open_loop(server.url, path, texts, rate, 2 * seconds, seed=3))
            opened[name] = level.row()
            echo(f"  open loop at {rate:.1f}/s, {name}: p50 {opened[name]['p50_ms']:.0f} ms, p99 "
                 f"{opened[name]['p99_ms']:.0f} ms", err=True)
        reference = run_async(_answers(server.url, pairs, concurrency))
    finally:
        server.stop()
    return {"ready_s": ready_s, "warm_s": warm_s, "head_bytes": head_bytes,
            "pss_mib": {"pinned_only": pss_one, "every_head": pss_all},
            "per_head_mib": (pss_all - pss_one) / len(names), "rounds": per, "levels": levels,
            "open_loop": {"rate": rate, "levels": opened}, "reference": reference}


def budgeted(repo: Path, model: str, names: list[str], budget_heads: int, texts: list[str], concurrency: int,
             seconds: float, pairs: list[tuple[str, str]], reference: list[Any], logs: Path) -> dict[str, Any]:
    """A server whose head cache holds ``budget_heads`` heads, every head in use: the uniform workload, the hit
    rate, evictions, and the answers to ``pairs`` against ``reference``."""
    head_bytes = (repo / names[0] / "head.safetensors").stat().st_size
    server = LocalServer(logs, model_repository=repo, models=model, default_model=model, max_queue=100000,
                         head_cache_bytes=budget_heads * head_bytes).wait_ready()
    try:
        before = _cache_metrics(server.url)
        row = run_async(closed_loop(server.url, uniform(names, seed=2), texts, concurrency, seconds)).row()
        after = _cache_metrics(server.url)
        hits, misses, evictions = (after[k] - before[k] for k in ("hits_total", "misses_total", "evictions_total"))
        got = run_async(_answers(server.url, pairs, concurrency))
        resident = _cache_metrics(server.url)["resident_heads"]
    finally:
        server.stop()
    wrong = 0
    for g, w in zip(got, reference, strict=True):
        if isinstance(g, int) or isinstance(w, int) or max(abs(g[k] - w[k]) for k in w) > 1e-5:
            wrong += 1
    return {"budget_heads": budget_heads, "heads": len(names), **row, "hits": hits, "misses": misses,
            "hit_rate": hits / max(hits + misses, 1), "evictions": evictions, "resident_heads_after": resident,
            "answers_compared": len(pairs), "answers_differing": wrong}


def run(repository: Path, ks: list[int], concurrency: int, seconds: float, rounds: int, budget_heads: int,
        open_share: float, out: Path) -> dict[str, Any]:
    texts = sample_test_texts(MODEL, 1000)
    rng = random.Random(5)
    with tempfile.TemporaryDirectory(prefix="bench-heads-") as tmp:
        repo, logs = Path(tmp) / "models", Path(tmp) / "logs"
        shutil.copytree(repository / MODEL, repo / MODEL)
        echo(f"bench heads: {max(ks)} perturbed copies of {MODEL}'s head in {repo}", err=True)
        names = make_heads(repository / MODEL, repo, max(ks))
        pairs = [(rng.choice(names), rng.choice(texts)) for _ in range(200)]
        echo("head step, offline (this process's main thread):", err=True)
        step = head_step(repo, MODEL, names, texts, 32, 7, rounds)
        echo(f"served, every head in memory, c={concurrency}:", err=True)
        serving = served(repo, MODEL, names, ks, texts, concurrency, seconds, rounds, open_share, pairs, logs)
        echo(f"served with a budget of {budget_heads} heads:", err=True)
        budget = budgeted(repo, MODEL, names, budget_heads, texts, concurrency, 2 * seconds, pairs,
                          serving.pop("reference"), logs)
    return report(ks, concurrency, step, serving, budget, out, {"ks": ks, "concurrency": concurrency,
                                                               "seconds": seconds, "rounds": rounds,
                                                               "budget_heads": budget_heads,
                                                               "open_share": open_share})


def report(ks: list[int], concurrency: int, step: dict[str, Any], serving: dict[str, Any], budget: dict[str, Any],
           out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    echo(f"\nhead step of a batch of {step['batch']} tweets (median ms; backbone alone {step['backbone_ms']:.1f}):")
    echo(table(step["rows"], ["step", "batch_ms", "head_ms", "head_share"]))
    single = statistics.mean(serving["rounds"]["single head"])
    rows = []
    for name, values in serving["rounds"].items():
        levels = serving["levels"][name]
        rows.append({"workload": name, "texts_per_s": statistics.mean(values), "vs_single": statistics.mean(values) /
                     single, "p50_ms": statistics.mean(r["p50_ms"] for r in levels),
                     "p99_ms": statistics.mean(r["p99_ms"] for r in levels),
                     "mean_batch": statistics.mean(r["mean_batch"] for r in levels)})
    echo(f"\nserved at c={concurrency}, in turns (means over rounds):")
    echo(table(rows, ["workload", "texts_per_s", "vs_single", "p50_ms", "p99_ms", "mean_batch"]))
    pss, k_max = serving["pss_mib"], max(ks)
    allowed = pss["pinned_only"] + 1.2 * k_max * serving["head_bytes"] / MIB
    echo(f"\nmemory (PSS, MiB): {MODEL} only {pss['pinned_only']:.0f}; with {k_max} heads {pss['every_head']:.0f} "
         f"({serving['per_head_mib']:.2f} MiB a head, weights {serving['head_bytes'] / MIB:.2f} MiB); allowed "
         f"{allowed:.0f}. Ready in {serving['ready_s']:.1f} s; every head brought in after {serving['warm_s']:.1f} s.")
    opened = serving["open_loop"]
    echo(f"open loop at {opened['rate']:.1f}/s: " + "; ".join(
        f"{n} p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms" for n, r in opened["levels"].items()))
    echo(f"\nbudget of {budget['budget_heads']} heads, {budget['heads']} in use: {budget['throughput']:.1f} texts/s, "
         f"p50 {budget['p50_ms']:.0f} ms, p99 {budget['p99_ms']:.0f} ms, hit rate {budget['hit_rate']:.3f}, "
         f"{budget['evictions']:.0f} evictions, errors {budget['errors']}; answers differing from the unlimited "
         f"server's: {budget['answers_differing']} of {budget['answers_compared']}")
    k_row = next(r for r in rows if r["workload"] == f"K={k_max}")
    summary = {"heads": k_max, "ready_s": serving["ready_s"], "ready_under_30_s": serving["ready_s"] < 30,
               "pss_mib": pss["every_head"], "pss_allowed_mib": allowed, "memory_ok": pss["every_head"] <= allowed,
               "uniform_vs_single": k_row["vs_single"], "uniform_at_least_0_8": k_row["vs_single"] >= 0.8,
               "budget_hit_rate": budget["hit_rate"], "budget_p99_ms": budget["p99_ms"],
               "budget_answers_differing": budget["answers_differing"], "budget_errors": budget["errors"]}
    path = write_json(out, "heads", settings, {"head_step": step, "served": serving, "budget": budget, "rows": rows},
                      summary)
    echo(f"\nsummary: {json.dumps(summary)}\nwrote {path}")
    return summary


def metrics_page(repository: Path, heads: int, out: Path, baseline: Path | None = None, model: str = MODEL,
                 text: str = "a text for every head") -> dict[str, Any]:
    """The size of ``/metrics`` once ``heads`` perturbed copies of ``model``'s head have each answered ``text`` (a
    head cache with room for all, ``model`` pinned): at the default ``ROUTING_METRICS_MODELS``, with every model
    labelled, and with ``baseline`` (another checkout's service, e.g. the version before the setting) the same
    way."""
    setups: list[tuple[str, Path | None, dict[str, str]]] = [
        ("default (pinned)", None, {}), ("ROUTING_METRICS_MODELS=all", None, {"metrics_models": "all"})]
    if baseline is not None:
        setups.append((f"baseline {baseline}", baseline, {}))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        repo, logs = Path(tmp) / "models", Path(tmp) / "logs"
        shutil.copytree(repository / model, repo / model)
        echo(f"bench metrics: {heads} perturbed copies of {model}'s head in {repo}", err=True)
        names = make_heads(repository / model, repo, heads)
        head_bytes = (repo / names[0] / "head.safetensors").stat().st_size
        for name, checkout, extra in setups:
            server = LocalServer(logs, checkout, model_repository=repo, models=model, default_model=model,
                                 max_queue=100000, head_cache_bytes=int(2 * head_bytes * (heads + 1)),
                                 **extra).wait_ready()
            try:
                statuses = run_async(_answers(server.url, [(n, text) for n in [model, *names]], 16))
                page = httpx.get(f"{server.url}/metrics", timeout=60).text
            finally:
                server.stop()
            failed = [s for s in statuses if isinstance(s, int)]
            if failed:
                raise RuntimeError(f"{name}: {len(failed)} heads did not answer (statuses {sorted(set(failed))})")
            series = sum(1 for line in page.splitlines() if line and not line.startswith("#"))
            rows.append({"setting": name, "bytes": len(page.encode()), "kb": round(len(page.encode()) / 1000, 1),
                         "series": series})
            echo(f"  {name}: /metrics {rows[-1]['kb']:,} kB, {series:,} series", err=True)
    echo(table(rows, ["setting", "kb", "series"]))
    summary = {"default_kb": rows[0]["kb"], "default_series": rows[0]["series"], "goal_kb": 200,
               "goal_met": rows[0]["kb"] <= 200}
    path = write_json(out, "metrics", {"heads": heads, "model": model, "baseline": str(baseline) if baseline else None},
                      {"rows": rows}, summary)
    echo(f"\nsummary: {json.dumps(summary)}\nwrote {path}")
    return summary
