"""`routing-service bench sharing`: what one backbone carrying many heads costs and saves.

- Memory: proportional set size (PSS, shared pages counted once) of the server's processes after the
  same traffic: both bundled models (320 test tweets through each, requests of 32 texts); one head
  against eight heads (copies of the bundled heads under other names) on one backbone.
- Cost of K = 1, 2, 4, 8 heads asked of the same texts in one request (``"models": [...]``), at 1 and 32
  texts per request, one client, measured in turns: texts/s, and each K's time per text over K = 1.
- Mixed traffic: 32 clients, each request to one of the two bundled models, against one model alone,
  measured in turns (servers up side by side).

With ``--baseline PATH`` (a checkout of an earlier version of this repository), its server is measured
beside this one's in the memory and mixed-traffic parts: the same traffic, in turns.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from service.bench.load import closed_loop, run_async
from service.bench.report import echo, table, write_json
from service.bench.serve import in_turns
from service.bench.server import LocalServer
from service.training.data import sample_test_texts

BUNDLED = ("tweet-sentiment", "bbc-news-topics")
MIB = 2**20


def heads_repository(repository: Path, into: Path, copies: int) -> list[str]:
    """``into``: the bundled models and ``copies`` - 1 copies of each under other names (``<name>-2`` ...),
    in the order the K-heads measure takes them: tweet-sentiment, bbc-news-topics, tweet-sentiment-2, ..."""
    names = []
    for k in range(1, copies + 1):
        for model in BUNDLED:
            name = model if k == 1 else f"{model}-{k}"
            shutil.copytree(repository / model, into / name)
            if k > 1:
                manifest = json.loads((into / name / "manifest.json").read_text())
                manifest["name"] = name
                (into / name / "manifest.json").write_text(json.dumps(manifest, indent=2))
            names.append(name)
    return names


async def _requests(url: str, body: Callable[[int], dict[str, Any]], per_request: int, seconds: float) -> float:
    """One client sending ``body(k)`` one request after another for ``seconds``: texts per second."""
    done, k = 0, 0
    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=120)) as client:
        end = time.monotonic() + seconds
        t0 = time.monotonic()
        while time.monotonic() < end:
            async with client.post("/v1/classify", json=body(k)) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"/v1/classify answered {r.status}: {await r.text()}")
            done += per_request
            k += 1
        return done / (time.monotonic() - t0)


def heads_cost(url: str, names: list[str], texts: list[str], ks: list[int], batch_sizes: list[int], seconds: float,
               rounds: int) -> list[dict[str, Any]]:
    """Texts/s with K heads per request, for each batch size, K measured in turns; cost over K = 1."""
    rows = []
    for b in batch_sizes:
        def measure(k: int, b: int = b) -> Callable[[], float]:
            def body(n: int) -> dict[str, Any]:
                start = (n * b) % max(1, len(texts) - b)
                return {"inputs": texts[start : start + b], "models": names[:k]}
            return lambda: run_async(_requests(url, body, b, seconds))

        echo(f"  {b} text(s) per request, K = {ks}, {rounds} rounds in turns", err=True)
        per = in_turns({f"K={k}": measure(k) for k in ks}, rounds)
        base = sum(per["K=1"]) / len(per["K=1"])
        for k in ks:
            mean = sum(per[f"K={k}"]) / len(per[f"K={k}"])
            rows.append({"texts_per_request": b, "heads": k, "texts_per_s": mean, "rounds": per[f"K={k}"],
                         "cost_over_one_head": base / mean})
    return rows


def after_traffic(server: LocalServer, models: list[str], texts: list[str], per_request: int = 32) -> dict[str, float]:
    """PSS of ``server`` (MiB) after ``texts`` went through each of ``models`` in requests of ``per_request``."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as client:
        for model in models:
            for k in range(0, len(texts), per_request):
                r = client.post(f"/v1/models/{model}/classify", json={"inputs": texts[k : k + per_request]})
                r.raise_for_status()
    time.sleep(1.0)
    pss = server.pss()
    if pss is None:
        raise RuntimeError("cannot read the servers' memory (/proc/<pid>/smaps_rollup)")
    return {part: v / MIB for part, v in pss.items()} | {"total": sum(pss.values()) / MIB}


def run(repository: Path, texts_n: int, seconds: float, rounds: int, ks: list[int], batch_sizes: list[int],
        baseline: Path | None, out: Path) -> dict[str, Any]:
    """The whole benchmark: print tables, write JSON, return the summary."""
    texts = sample_test_texts("tweet-sentiment", texts_n)
    logs = out.parent / "logs"
    result: dict[str, Any] = {"settings": {"texts": len(texts), "seconds": seconds, "rounds": rounds, "ks": ks,
                                           "batch_sizes": batch_sizes,
                                           "baseline": str(baseline) if baseline else None}}
    with tempfile.TemporaryDirectory(prefix="heads-") as tmp:
        repo = Path(tmp)
        names = heads_repository(repository.resolve(), repo, max(1, (max(ks) + 1) // 2))
        head_bytes = (repo / BUNDLED[0] / "head.safetensors").stat().st_size
        traffic = texts[:320]

        echo("memory (PSS, MiB) after 320 test tweets through each model:", err=True)
        memory: dict[str, dict[str, float]] = {}
        versions: list[tuple[str, Path | None]] = [("this", None)] + ([("baseline", baseline)] if baseline else [])
        for version, checkout in versions:
            for label, models in ((f"{version}: both bundled models", list(BUNDLED)),
                                  *(((f"{version}: 1 head", [BUNDLED[0]]),
                                     (f"{version}: {len(names)} heads", names)) if checkout is None else ())):
                server = LocalServer(logs, checkout=checkout, model_repository=repo, models=",".join(models),
                                     default_model=models[0]).wait_ready()
                try:
                    memory[label] = after_traffic(server, models, traffic)
                finally:
                    server.stop()
                echo(f"  {label}: {memory[label]}", err=True)
        result["memory_mib"] = memory
        one, many = memory["this: 1 head"]["total"], memory[f"this: {len(names)} heads"]["total"]
        allowed = (one + (len(names) - 1) * head_bytes / MIB) * 1.10
        result["heads_memory"] = {"one_head_mib": one, "heads": len(names), "heads_mib": many,
                                  "head_file_mib": head_bytes / MIB, "allowed_mib": allowed, "met": many <= allowed}
        if baseline is not None:
            both = "both bundled models"
            result["both_models_ratio"] = memory[f"this: {both}"]["total"] / memory[f"baseline: {both}"]["total"]

        echo(f"cost of K heads per request ({len(names)} heads loaded on one backbone):", err=True)
        server = LocalServer(logs, model_repository=repo, models=",".join(names), default_model=names[0]).wait_ready()
        try:
            run_async(closed_loop(server.url, "/v1/classify", texts, 4, 2.0))  # warm-up
            result["heads_cost"] = heads_cost(server.url, names, texts, ks, batch_sizes, seconds, rounds)
        finally:
            server.stop()

        echo("mixed traffic at concurrency 32 (each request to one of the two models) against one model alone, "
             "in turns:", err=True)
        servers = {"this": LocalServer(logs, model_repository=repo, models=",".join(BUNDLED), default_model=BUNDLED[0])}
        if baseline is not None:
            servers["baseline"] = LocalServer(logs, checkout=baseline, model_repository=repo,
                                              models=",".join(BUNDLED), default_model=BUNDLED[0])
        try:
            for s in servers.values():
                s.wait_ready()
            mixed = [f"/v1/models/{m}/classify" for m in BUNDLED]
            alone = f"/v1/models/{BUNDLED[0]}/classify"
            measures = {}
            for version, s in servers.items():
                run_async(closed_loop(s.url, mixed, texts, 8, 2.0))  # warm-up
                measures[f"{version} mixed"] = _served(s.url, mixed, texts, seconds)
                measures[f"{version} one model"] = _served(s.url, alone, texts, seconds)
            per = in_turns(measures, rounds)
        finally:
            for s in servers.values():
                s.stop()
        result["mixed"] = {n: {"rounds": v, "mean": sum(v) / len(v)} for n, v in per.items()}

    result["summary"] = summary(result)
    report(result)
    write_json(out, "sharing", result["settings"], {k: v for k, v in result.items() if k != "settings"},
               result["summary"])
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the goals are judged by."""
    two = {r["texts_per_request"]: r["cost_over_one_head"] for r in result["heads_cost"] if r["heads"] == 2}
    mixed = result["mixed"]
    out: dict[str, Any] = {"two_heads_cost": two, "heads_memory_met": result["heads_memory"]["met"],
                           "mixed_over_one_model_alone": mixed["this mixed"]["mean"] / mixed["this one model"]["mean"]}
    if "baseline one model" in mixed:
        out["mixed_over_baseline_one_model"] = mixed["this mixed"]["mean"] / mixed["baseline one model"]["mean"]
    if "both_models_ratio" in result:
        out["both_models_memory_ratio"] = result["both_models_ratio"]
    return out


def _served(url: str, path: str | list[str], texts: list[str], seconds: float) -> Callable[[], float]:
    return lambda: run_async(closed_loop(url, path, texts, 32, seconds)).row()["throughput"]


def report(result: dict[str, Any]) -> None:
    """The tables of a result."""
    mem = result["memory_mib"]
    echo("Memory (PSS, MiB) of the server's processes after the same traffic")
    echo(table([{"servers": k, **{p: round(v, 1) for p, v in m.items()}} for k, m in mem.items()],
               ["servers", "server", "backbones", "total"]))
    h = result["heads_memory"]
    echo(f"{h['heads']} heads: {h['heads_mib']:.1f} MiB against 1 head {h['one_head_mib']:.1f} + "
         f"{h['heads'] - 1} x {h['head_file_mib']:.2f} MiB, +10% = {h['allowed_mib']:.1f}: "
         f"{'met' if h['met'] else 'NOT met'}")
    if "both_models_ratio" in result:
        echo(f"both bundled models, this / baseline: {result['both_models_ratio']:.3f} (goal <= 0.65)")
    echo("\nK heads per request (texts/s; cost = time per text over one head)")
    echo(table([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "rounds"}
                for r in result["heads_cost"]], ["texts_per_request", "heads", "texts_per_s", "cost_over_one_head"]))
    echo("\nMixed traffic at concurrency 32 (texts/s, mean of the rounds in turns)")
    echo(table([{"server": n, "texts_per_s": round(v["mean"], 1), "rounds": [round(x, 1) for x in v["rounds"]]}
                for n, v in result["mixed"].items()], ["server", "texts_per_s", "rounds"]))
    echo("\n" + ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
                          for k, v in result["summary"].items()))
