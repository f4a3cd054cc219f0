"""A real Prometheus (Debian's package) scrapes the service with the project's own config, adapted to
the test port, answers a counter and a histogram_quantile p95 through its HTTP API, and evaluates the alerting
rules on what it scraped."""

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy import alert_rules
from tests.serving.server import Server, free_port, metric

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prometheus(tiny: Server, tmp_path_factory: pytest.TempPathFactory):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed; the README's test command installs it (Debian package)"
    service = tiny
    tmp_path = tmp_path_factory.mktemp("prometheus")
    cfg = yaml.safe_load((ROOT / "docker/prometheus.yml").read_text())
    job = cfg["scrape_configs"][0]
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{service.port}"]
    job["scrape_interval"] = "1s"
    cfg["global"]["evaluation_interval"] = "1s"
    for rules in cfg["rule_files"]:  # beside the configuration, as compose mounts them
        shutil.copy(ROOT / "docker" / rules, tmp_path / rules)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:  # Prometheus takes a while to open its storage and listen
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "Prometheus not ready after 60 s"
            time.sleep(0.2)
        yield service, url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def query(url: str, promql: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["data"]["result"]


def test_prometheus_reads_request_counter_and_p95(prometheus) -> None:
    service, url = prometheus
    served = metric(httpx.get(f"{service.url}/metrics").text, "routing_requests_total", endpoint="/v1/classify",
                    status="200")  # the server is shared: what it answered before this test
    end = time.monotonic() + 60
    count, p95 = 0.0, None
    while time.monotonic() < end:
        for k in range(5):
            assert httpx.post(f"{service.url}/v1/classify", json={"inputs": [f"text {k}"]}).status_code == 200
        counter = query(url, 'sum(routing_requests_total{endpoint="/v1/classify",status="200"})')
        quantile = query(url, 'histogram_quantile(0.95, sum by (le) '
                              '(rate(routing_request_duration_seconds_bucket{endpoint="/v1/classify"}[15s])))')
        if counter and quantile and quantile[0]["value"][1] not in ("NaN", "+Inf"):
            count, p95 = float(counter[0]["value"][1]), float(quantile[0]["value"][1])
            if count >= served + 10:
                break
        time.sleep(1)
    assert count >= served + 10, "Prometheus never scraped the request counter"
    assert p95 is not None and 0 < p95 < 10


def test_prometheus_evaluates_the_alerting_rules_on_the_scraped_service(prometheus) -> None:
    """Every rule of ``docker/prometheus-alerts.yml`` loads and evaluates without error on the service's real
    series, and a healthy service that answered its requests raises no alert."""
    service, url = prometheus
    for k in range(3):
        assert httpx.post(f"{service.url}/v1/classify", json={"inputs": [f"text {k}"]}).status_code == 200
    end = time.monotonic() + 60
    rules: list[dict] = []
    while time.monotonic() < end:  # evaluated every second once loaded
        r = httpx.get(f"{url}/api/v1/rules", timeout=10)
        assert r.status_code == 200, r.text
        rules = [rule for g in r.json()["data"]["groups"] for rule in g["rules"]]
        if rules and all(rule.get("health") == "ok" for rule in rules) and \
                query(url, 'up{job="routing-service"}'):
            break
        time.sleep(0.5)
    assert {rule["name"] for rule in rules} == set(alert_rules())
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]
    time.sleep(2)  # a few evaluations with the service's series in
    alerts = httpx.get(f"{url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    assert alerts == [], alerts
