"""`routing-service bench repository`: models loaded and unloaded while the server runs.

- Load time: a copy of the bundled ``tweet-sentiment`` head (another name) loaded onto the running backbone
  and unloaded again, ``loads`` times; the time of each ``load`` call (HTTP round trip, warm-up batch
  included), and the server's own figure (``routing_model_load_seconds``).
- Memory: PSS of the server's processes before the first load, with the head loaded, and after its unload.
- Under load: clients at ``concurrency`` send one text per request, half to the copy and half to
  ``tweet-sentiment``, while the copy is reloaded (other weights) and then unloaded. Every request must be
  answered: 200, or 404 for the copy once it is unloaded; no 5xx, no transport error.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from safetensors.torch import load_file, save_file

from service.bench.load import run_async
from service.bench.report import echo, table, write_json
from service.bench.server import LocalServer
from service.training.data import sample_test_texts

MODEL = "tweet-sentiment"
KEY = "bench-admin-key"
MIB = 2**20


def copy_model(source: Path, into: Path, name: str, seed: int | None = None) -> Path:
    """Model folder ``source`` copied to ``into/name``; with ``seed``, its head's weights perturbed (1e-3 relative,
    seeded: a retrained head of the same shape)."""
    import torch

    folder = into / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(source, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["name"] = name
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        state = load_file(str(folder / "head.safetensors"))
        state = {k: v + 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                 for k, v in state.items()}
        save_file(state, str(folder / "head.safetensors"))
    return folder


def _mib(server: LocalServer) -> float:
    time.sleep(1.0)  # freed pages settle
    pss = server.pss()
    if pss is None:
        raise RuntimeError("cannot read the server's memory (/proc/<pid>/smaps_rollup)")
    return sum(pss.values()) / MIB


def _control(client: httpx.Client, action: str, name: str) -> float:
    t0 = time.perf_counter()
    r = client.post(f"/v2/repository/models/{name}/{action}", json={})
    if r.status_code != 200:
        raise RuntimeError(f"{action} {name}: {r.status_code} {r.text}")
    return time.perf_counter() - t0


def load_times(server: LocalServer, copy: str, loads: int) -> dict[str, Any]:
    """``loads`` loads and unloads of model ``copy``; memory before, loaded and after."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        before = _mib(server)
        seconds, server_seconds, loaded = [], [], 0.0
        for k in range(loads):
            seconds.append(_control(client, "load", copy))
            page = client.get("/metrics").text
            server_seconds.append(next(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                                       if line.startswith(f'routing_model_load_seconds{{model="{copy}"}}')))
            if k == 0:
                loaded = _mib(server)
            _control(client, "unload", copy)
            echo(f"  load {k + 1}: {1000 * seconds[-1]:.1f} ms (server: {1000 * server_seconds[-1]:.1f} ms)", err=True)
        after = _mib(server)
    return {"load_ms": [1000 * s for s in seconds], "server_load_ms": [1000 * s for s in server_seconds],
            "median_load_ms": 1000 * statistics.median(seconds),
            "median_server_load_ms": 1000 * statistics.median(server_seconds),
            "pss_mib": {"before_load": before, "loaded": loaded, "after_unload": after},
            "after_over_before": after / before}


async def _traffic(url: str, models: tuple[str, str], texts: list[str], concurrency: int,
                   stop: threading.Event) -> Counter[str]:
    """Closed-loop clients, each request one text to one of ``models`` in turn, until ``stop``; status counts."""
    counts: Counter[str] = Counter()
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def client(c: int) -> None:
            k = c
            while not stop.is_set():
                model = models[k % 2]
                try:
                    async with session.post(f"/v1/models/{model}/classify",
                                            json={"inputs": [texts[k % len(texts)]]}) as r:
                        await r.read()
                        counts[f"{model} {r.status}"] += 1
                except aiohttp.ClientError as e:
                    counts[f"{model} {type(e).__name__}"] += 1
                k += 1

        await asyncio.gather(*(client(c) for c in range(concurrency)))
    return counts


def under_load(server: LocalServer, repo: Path, model: str, copy: str, texts: list[str], concurrency: int,
               seconds: float) -> dict[str, Any]:
    """Reload ``copy`` (other weights) and then unload it while clients send to it and to ``model``."""
    stop = threading.Event()
    result: dict[str, Counter[str]] = {}
    thread = threading.Thread(target=lambda: result.update(counts=run_async(
        _traffic(server.url, (copy, model), texts, concurrency, stop))))
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        _control(client, "load", copy)
        thread.start()
        time.sleep(seconds / 3)
        copy_model(repo / model, repo, copy, seed=1)
        reload_s = _control(client, "load", copy)  # loads the new weights beside the old head, then swaps
        time.sleep(seconds / 3)
        unload_s = _control(client, "unload", copy)
        time.sleep(seconds / 3)
        stop.set()
        thread.join()
    counts = result["counts"]
    server_errors = sum(n for k, n in counts.items() if not k.endswith((" 200", " 404")))
    lost_404 = counts.get(f"{model} 404", 0)
    return {"concurrency": concurrency, "seconds": seconds, "statuses": dict(sorted(counts.items())),
            "reload_ms": 1000 * reload_s, "unload_ms": 1000 * unload_s,
            "answered": sum(counts.values()), "errors": server_errors + lost_404}


def measure(repository: Path, model: str, texts: list[str], loads: int, concurrency: int, seconds: float,
            logs: Path) -> dict[str, Any]:
    """Both measures on a server of ``repository/model`` (in a temporary repository with a copy of it)."""
    copy = f"{model}-copy"
    with tempfile.TemporaryDirectory(prefix="bench-repository-") as tmp:
        repo = Path(tmp) / "models"
        shutil.copytree(repository / model, repo / model)
        copy_model(repository / model, repo, copy)
        echo(f"bench repository: {copy} ({(repo / copy / 'head.safetensors').stat().st_size / MIB:.1f} MiB of head "
             f"weights) onto the running backbone of {model}", err=True)
        # the copy loads at runtime: its load time is read from its own series (ROUTING_METRICS_MODELS names it)
        server = LocalServer(logs, model_repository=repo, models=model, default_model=model,
                             model_control="explicit", admin_keys=KEY, max_queue=100000,
                             metrics_models=f"{model},{copy}").wait_ready()
        try:
            loading = load_times(server, copy, loads)
            load = under_load(server, repo, model, copy, texts, concurrency, seconds)
        finally:
            server.stop()
    return {"model": model, "copy": copy, "loading": loading, "under_load": load}


def run(repository: Path, loads: int, concurrency: int, seconds: float, out: Path) -> dict[str, Any]:
    texts = sample_test_texts(MODEL, 1000)
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as logs:
        results = measure(repository, MODEL, texts, loads, concurrency, seconds, Path(logs))
    loading, load, copy = results["loading"], results["under_load"], results["copy"]
    summary = {"median_load_ms": loading["median_load_ms"], "median_server_load_ms": loading["median_server_load_ms"],
               "load_under_100_ms": loading["median_load_ms"] < 100,
               "memory_after_unload_over_before": loading["after_over_before"],
               "memory_within_5_percent": abs(loading["after_over_before"] - 1) <= 0.05,
               "answers_under_load": load["answered"], "errors_under_load": load["errors"]}
    pss = loading["pss_mib"]
    echo(f"\nload of a {MODEL}-size head onto the running backbone, {loads} times (each then unloaded):")
    echo(table([{"measure": "load call (HTTP, warm-up batch included)", "median_ms": loading["median_load_ms"],
                 "min_ms": min(loading["load_ms"]), "max_ms": max(loading["load_ms"])},
                {"measure": "server's load seconds", "median_ms": loading["median_server_load_ms"],
                 "min_ms": min(loading["server_load_ms"]), "max_ms": max(loading["server_load_ms"])}],
               ["measure", "median_ms", "min_ms", "max_ms"]))
    echo(f"\nmemory (PSS of the server's processes, MiB): before the first load {pss['before_load']:.1f}, loaded "
         f"{pss['loaded']:.1f}, after the last unload {pss['after_unload']:.1f} "
         f"({loading['after_over_before']:.3f}x before)")
    echo(f"\nreload and unload of {copy} during c={concurrency} on it and {MODEL} ({seconds:.0f} s): reload "
         f"{load['reload_ms']:.0f} ms, unload {load['unload_ms']:.0f} ms; answers by model and status: "
         f"{load['statuses']}; errors (5xx, transport, or a 404 for {MODEL}): {load['errors']}")
    path = write_json(out, "repository", {"model": MODEL, "loads": loads, "concurrency": concurrency,
                                          "seconds": seconds}, results, summary)
    echo(f"\nsummary: {json.dumps(summary)}\nwrote {path}")
    return summary
