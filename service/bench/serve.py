"""`routing-service bench serve`: closed-loop HTTP load at several concurrency levels, the same load
with dynamic batching off, and the engine's offline limit on the same texts, all in one run."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.bench.report import echo
from service.bench.server import LocalServer


def test_texts(preset: str, limit: int, seed: int = 0) -> list[str]:
    """A seeded sample of the test split of a bundled dataset (needs the `train` extra)."""
    from service.training.data import make_dataset, preset_path, read_examples

    path, opts = preset_path(preset)
    texts = make_dataset(read_examples(path, **opts), preset).test.texts
    return random.Random(seed).sample(texts, min(limit, len(texts)))


@dataclass
class Level:
    concurrency: int
    seconds: float
    latencies: list[float]
    errors: int
    texts: int
    batch_sum: float
    batch_count: float

    def row(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def q(p: float) -> float:
            return 1000 * lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

        return {"concurrency": self.concurrency, "throughput": self.texts / self.seconds, "p50_ms": q(0.5),
                "p95_ms": q(0.95), "p99_ms": q(0.99), "mean_batch": self.batch_sum / max(self.batch_count, 1),
                "errors": self.errors, "requests": len(self.latencies) + self.errors}


def _batch_stats(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    s = c = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == "routing_batch_size":
            for sample in fam.samples:
                if sample.name.endswith("_sum"):
                    s += sample.value
                elif sample.name.endswith("_count"):
                    c += sample.value
    return s, c


async def closed_loop(url: str, path: str, texts: list[str], concurrency: int, seconds: float,
                      body: dict[str, Any] | None = None) -> Level:
    """``concurrency`` clients, each sending one text at a time for ``seconds``."""
    s0, c0 = _batch_stats(url)
    latencies: list[float] = []
    errors = 0
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def worker(w: int) -> None:
            nonlocal errors
            k = w
            while time.monotonic() < end:
                t0 = time.perf_counter()
                try:
                    r = await client.post(path, json={"inputs": [texts[k % len(texts)]], **(body or {})})
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
                k += concurrency

        t_start = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.monotonic() - t_start
    s1, c1 = _batch_stats(url)
    return Level(concurrency, elapsed, latencies, errors, len(latencies), s1 - s0, c1 - c0)


def offline_limit(repository: Path, model: str, texts: list[str], batch_sizes: list[int], seconds: float,
                  device: str) -> dict[str, Any]:
    """The engine alone (no HTTP, no queue): best throughput over ``batch_sizes`` on ``texts``."""
    from service.serving.engine import Engine, Task

    engine = Engine.load(repository / model, device=device)
    ordered = sorted(texts, key=len)  # similar lengths together, as the batcher does: the best case
    by_size = {}
    for bs in batch_sizes:
        batches = [ordered[k : k + bs] for k in range(0, len(ordered), bs)]
        n = k = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            batch = batches[k % len(batches)]
            engine.run([Task(t) for t in batch])
            n += len(batch)
            k += 1
        by_size[bs] = n / (time.perf_counter() - t0)
        echo(f"  offline batch size {bs}: {by_size[bs]:.1f} texts/s", err=True)
    best = max(by_size, key=lambda b: by_size[b])
    return {"by_batch_size": by_size, "best_batch_size": best, "throughput": by_size[best]}


def run(model: str, preset: str, levels: list[int], duration: float, n_texts: int, repository: Path, device: str,
        max_wait_ms: float, max_batch_size: int, offline_batch_sizes: list[int], url: str | None,
        out: Path) -> dict[str, Any]:
    """The whole benchmark: print tables, write JSON, return the summary."""
    from service.bench import report

    texts = test_texts(preset, n_texts)
    echo(f"bench serve: model {model}, {len(texts)} test texts (mean {sum(map(len, texts)) / len(texts):.0f}"
         f" chars), levels {levels}, {duration:.0f} s each", err=True)
    logs = out.parent / "logs"
    runs: dict[str, list[dict]] = {}
    configs = [("batching", {"max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms})]
    if url is None:
        configs.append(("no_batching", {"max_batch_size": 1, "max_wait_ms": 0}))
    for name, cfg in configs:
        server = None
        if url is None:
            server = LocalServer(logs, model_repository=repository, models=model, default_model=model,
                                 max_queue=100000, device=device, **cfg).wait_ready()
        target = server.url if server else str(url)
        try:
            asyncio.run(closed_loop(target, "/v1/classify", texts, 4, 2.0))  # warm-up
            runs[name] = []
            for c in levels:
                row = asyncio.run(closed_loop(target, "/v1/classify", texts, c, duration)).row()
                runs[name].append(row)
                echo(f"  {name} c={c}: {row['throughput']:.1f} texts/s, p50 {row['p50_ms']:.0f} ms, "
                     f"p99 {row['p99_ms']:.0f} ms, mean batch {row['mean_batch']:.1f}, errors {row['errors']}",
                     err=True)
        finally:
            if server is not None:
                server.stop()
    offline = offline_limit(repository, model, texts, offline_batch_sizes, duration, device)
    cols = ["concurrency", "throughput", "p50_ms", "p95_ms", "p99_ms", "mean_batch", "errors", "requests"]
    for name, rows in runs.items():
        echo(f"\n{name} (texts/s, latency per request of one text):")
        echo(report.table(rows, cols))
    by_size = {k: round(v, 1) for k, v in offline["by_batch_size"].items()}
    echo(f"\noffline engine limit: {offline['throughput']:.1f} texts/s at batch size {offline['best_batch_size']}"
         f" (texts/s by batch size: {by_size})")
    summary: dict[str, object] = {"offline_texts_per_s": offline["throughput"]}
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
        summary["p99_vs_limit"] = {r["concurrency"]: [r["p99_on_ms"], r["p99_limit_ms"]] for r in ratios}
    echo(f"\nserved / offline at saturation (c={best['concurrency']}): "
         f"{summary['served_over_offline_at_saturation']:.3f}")
    settings = {"model": model, "texts": len(texts), "levels": levels, "duration_s": duration, "device": device,
                "max_wait_ms": max_wait_ms, "max_batch_size": max_batch_size, "url": url}
    path = report.write_json(out, "serve", settings, {"runs": runs, "offline": offline}, summary)
    echo(f"wrote {path}")
    return summary
