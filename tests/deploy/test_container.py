"""The image, built and run for real with podman (no Docker daemon, no registry): it becomes ready as
uid 10001 on a read-only root filesystem, classifies and explains, exports metrics, and drains and
exits 0 on SIGTERM. Run alone with ``pytest -m container``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.deploy import podman
from tests.serving.server import free_port

pytestmark = pytest.mark.container
TAG = "localhost/routing-service:cpu-test"


@pytest.fixture(scope="module")
def image() -> str:
    t0 = time.monotonic()
    podman.build(TAG)
    size = podman.image_size(TAG)
    print(f"\nimage {TAG}: {size / 2**20:.0f} MiB, built in {time.monotonic() - t0:.0f} s")
    return TAG


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[tuple[str, str, float]]:
    port = free_port()
    t0 = time.monotonic()
    cid = podman.cli("run", "-d", "--network", "host", "--read-only", "--tmpfs", "/tmp",
                     "--user", "10001:10001", "-e", f"ROUTING_PORT={port}", "-e", "ROUTING_HOST=127.0.0.1",
                     "-e", f"ROUTING_GRPC_PORT={free_port()}",  # the host's network: a port of its own
                     "-e", "ROUTING_DRAIN_TIMEOUT_S=10", image, "serve").stdout.strip()  # as SageMaker starts it
    # (compose's test starts the image without an argument)
    url = f"http://127.0.0.1:{port}"
    ready = None
    try:
        while time.monotonic() - t0 < 300:
            state = podman.cli("inspect", "--format", "{{.State.Running}}", cid).stdout.strip()
            assert state == "true", podman.cli("logs", cid).stderr[-3000:]
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    ready = time.monotonic() - t0
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert ready is not None, "not ready after 300 s"
        print(f"\ncontainer ready after {ready:.1f} s")
        yield cid, url, ready
    finally:
        podman.cli("rm", "-f", cid, check=False)


def test_image_runs_as_uid_10001_and_serves(container: tuple[str, str, float]) -> None:
    cid, url, _ = container
    user = podman.cli("exec", cid, "id", "-u").stdout.strip()
    assert user == "10001"
    r = httpx.post(f"{url}/v1/classify", json={"inputs": ["I love this new phone, the battery lasts forever!"]},
                   timeout=60)
    assert r.status_code == 200 and r.json()["results"][0]["label"] == "positive", r.text
    e = httpx.post(f"{url}/v1/explain", json={"inputs": ["The food was great but the service was slow."]},
                   timeout=60).json()["results"][0]
    c = e["credit"][e["label"]]
    assert sum(c["tokens"]) + c["baseline"] == pytest.approx(c["logit"], abs=1e-4)
    metrics = httpx.get(f"{url}/metrics").text
    assert 'routing_requests_total{endpoint="/v1/classify",status="200"} 1.0' in metrics
    assert httpx.get(f"{url}/").status_code == 200  # the page ships in the image
    assert httpx.get(f"{url}/ping").status_code == 200  # SageMaker's health check, and its requests' route
    r = httpx.post(f"{url}/invocations", json={"inputs": "I love this new phone, the battery lasts forever!"})
    assert r.status_code == 200 and r.json()[0]["label"] == "positive", r.text


def test_sigterm_drains_and_exits_0(container: tuple[str, str, float]) -> None:
    cid = container[0]
    podman.cli("kill", "--signal", "TERM", cid)
    code = podman.cli("wait", cid, timeout=60).stdout.strip()
    logs = podman.cli("logs", cid).stderr
    assert code == "0", logs[-3000:]
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    assert any("draining" in doc["message"] for doc in lines) and any("drained" in doc["message"] for doc in lines)
