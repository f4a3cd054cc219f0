"""The real server for API tests (uvicorn in a subprocess, free port), the app state alone in this process,
reading /metrics, and holding concurrent requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx

from service.bench.server import LocalServer as Server
from service.bench.server import free_port, ready_together
from service.config import Settings
from service.serving.observe.metrics import Metrics
from service.serving.state import AppState

__all__ = ["Server", "free_port", "in_flight", "loaded", "metric", "running", "side_by_side"]


def running(log_dir: Path, **settings: object) -> Iterator[Server]:
    """A server with ``settings``, ready, for a ``for`` loop or a fixture to ``yield from``; stopped afterwards."""
    server = Server(log_dir, **settings).wait_ready()
    try:
        yield server
    finally:
        server.stop()


def side_by_side(log_dir: Path, *settings: dict[str, object]) -> list[Server]:
    """A server for each of ``settings``, started together and ready (see ``ready_together``)."""
    return ready_together([functools.partial(Server, log_dir, **s) for s in settings])


@contextlib.asynccontextmanager
async def loaded(settings: Settings) -> AsyncIterator[AppState]:
    """The app's state with ``settings``, its models loaded (asserted ready), without HTTP; closed on exit."""
    st = AppState(settings=settings, metrics=Metrics())
    await st.load()
    assert st.lifecycle.ready, st.lifecycle.error
    try:
        yield st
    finally:
        await st.close(1.0)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` in a /metrics page."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def in_flight(server: Server, bodies: list[dict], answer: Callable[[httpx.Response | httpx.TransportError], None],
              wait_s: float = 60, already: int = 0) -> threading.Thread:
    """POST every body to /v1/classify at once from a background thread and return when the server
    holds them all in flight (besides ``already`` requests it held before); ``answer`` gets each response (or
    transport error) as it comes. Join the returned thread to wait for all of them."""
    sent = threading.Event()

    async def load() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def one(body: dict) -> None:
                try:
                    answer(await client.post("/v1/classify", json=body))
                except httpx.TransportError as e:
                    answer(e)

            tasks = [asyncio.create_task(one(b)) for b in bodies]
            for _ in range(int(wait_s / 0.02)):  # until the server holds them all (and this /metrics request)
                page = (await client.get("/metrics")).text
                if metric(page, "routing_requests_in_flight") >= len(bodies) + already + 1:
                    break
                await asyncio.sleep(0.02)
            sent.set()
            await asyncio.gather(*tasks)

    thread = threading.Thread(target=lambda: asyncio.run(load()))
    thread.start()
    assert sent.wait(wait_s), "the server never held every request in flight"
    return thread
