"""The real server for API tests (uvicorn in a subprocess, free port), and reading /metrics."""

from __future__ import annotations

from service.bench.server import LocalServer as Server
from service.bench.server import free_port

__all__ = ["Server", "free_port", "metric"]


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
