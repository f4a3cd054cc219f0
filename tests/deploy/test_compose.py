"""The compose stack's CPU profile, brought up with podman-compose: Prometheus (Debian's package
standing in for the upstream image, which no registry here can serve) scrapes the service on the
compose network and loads the alerting rules. Grafana's image cannot be had here and is left out.
Run alone with -m container."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator

import httpx
import pytest
import tritonclient.grpc as triton
import yaml

from tests.deploy import alert_rules, podman
from tests.serving.server import free_port

pytestmark = pytest.mark.container
COMPOSE = podman.ROOT / "docker-compose.yml"


def compose(*args: str, env: dict[str, str], check: bool = True, timeout: float = 600) -> str:
    exe = podman.need("podman-compose")
    out = podman.run(exe, "-f", str(COMPOSE), "-p", "routing-ci", *args, cwd=podman.ROOT, env=env, check=check,
                     timeout=timeout)
    return out.stdout + out.stderr


def test_containers_on_one_network_resolve_each_other_by_name() -> None:
    """The compose stack needs it (Prometheus scrapes the service by its name): checked first, in seconds, where
    the stack's test would time out minutes later on a failed lookup."""
    podman.assert_names_resolve(podman.ensure_base())


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, str]]:
    podman.assert_names_resolve(podman.ensure_base())  # the stack is no use without it: fail before building
    cfg = yaml.safe_load(COMPOSE.read_text())
    podman.ensure_prometheus(cfg["services"]["prometheus"]["image"])
    podman.build("localhost/routing-service:cpu")  # the tag compose's CPU profile names (layers are cached)
    env = {**os.environ, "CONTAINERS_CONF": str(podman.containers_conf()), "TORCH_VARIANT": "cpu",
           "GRAFANA_ADMIN_PASSWORD": "compose-test", "ROUTING_PUBLISHED_PORT": str(free_port()),
           "ROUTING_GRPC_PUBLISHED_PORT": str(free_port())}
    compose("--profile", "cpu", "up", "-d", "--no-build", "routing-service-cpu", "prometheus", env=env)
    try:
        yield env
    finally:
        compose("--profile", "cpu", "down", "-v", "-t", "20", env=env, check=False)


def prometheus_api(path: str) -> dict | None:
    """Ask Prometheus's HTTP API from inside its own container (no host port is needed); None while
    Prometheus is not answering yet (the callers poll)."""
    out = podman.cli("exec", "routing-ci_prometheus_1", "wget", "-qO-", f"http://127.0.0.1:9090/api/v1/{path}",
                     check=False)
    if out.returncode != 0:
        return None
    doc = json.loads(out.stdout)
    assert doc["status"] == "success", doc
    return doc["data"]


def prometheus_query(query: str) -> list[dict]:
    """A query's result; empty while Prometheus is not answering yet."""
    data = prometheus_api(f"query?query={query}")
    return [] if data is None else data["result"]


def test_prometheus_scrapes_the_service_on_the_compose_network(stack: dict[str, str]) -> None:
    port = stack["ROUTING_PUBLISHED_PORT"]
    t0 = time.monotonic()
    up: list[dict] = []
    while time.monotonic() - t0 < 300:
        up = prometheus_query("up")
        if up and up[0]["value"][1] == "1":
            break
        time.sleep(3)
    assert up and up[0]["metric"]["job"] == "routing-service" and up[0]["value"][1] == "1", up
    ready = 0  # /metrics answers while the models are still loading: wait for readiness to classify
    while ready != 200 and time.monotonic() - t0 < 300:
        with contextlib.suppress(httpx.TransportError):
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code
        time.sleep(1)
    assert ready == 200, "the service never became ready"
    r = httpx.post(f"http://127.0.0.1:{port}/v1/classify", json={"inputs": ["What a great day!"]}, timeout=60)
    assert r.status_code == 200, r.text
    grpc = triton.InferenceServerClient(f"127.0.0.1:{stack['ROUTING_GRPC_PUBLISHED_PORT']}")  # the published gRPC port
    assert grpc.is_server_ready() and grpc.is_model_ready("tweet-sentiment")
    t1 = time.monotonic()
    seen: list[dict] = []
    while time.monotonic() - t1 < 60:  # scraped every 5 s
        seen = prometheus_query('routing_requests_total{endpoint="/v1/classify",status="200"}')
        if seen and float(seen[0]["value"][1]) >= 1:
            break
        time.sleep(2)
    assert seen and float(seen[0]["value"][1]) >= 1, seen
    rules = prometheus_api("rules")  # the alerting rules compose mounts beside the configuration
    loaded = {r["name"] for g in (rules or {"groups": []})["groups"] for r in g["rules"]}
    assert loaded == set(alert_rules()), rules
