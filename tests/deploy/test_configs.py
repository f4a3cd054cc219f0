"""What CI can check of the deployment without a Docker engine: the compose file, the Dockerfile,
the Prometheus configuration and its alerting rules, and the Grafana dashboard and the rules against the
service's real /metrics."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy import alert_rules
from tests.serving.server import Server

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker/grafana/dashboards/routing-service.json"


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed; the README's test command installs it"
    return path


COMPOSE_ENV = {"PATH": "/usr/bin:/bin", "GRAFANA_ADMIN_PASSWORD": "not-a-default"}


def test_compose_file_is_valid_and_complete() -> None:
    out = subprocess.run([tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml"), "config"],
                         capture_output=True, text=True, cwd=ROOT, env=COMPOSE_ENV)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    services = cfg["services"]
    assert {"routing-service", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        assert svc.get("restart") == "unless-stopped", name
        assert "healthcheck" in svc, name
    gpu = services["routing-service"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    profiled = subprocess.run([tool("docker-compose"), "--profile", "cpu", "config", "--services"],
                              capture_output=True, text=True, cwd=ROOT, env=COMPOSE_ENV)
    assert "routing-service-cpu" in profiled.stdout.split()
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "not-a-default"


def test_compose_refuses_to_start_grafana_without_a_password() -> None:
    out = subprocess.run([tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml"), "config"],
                         capture_output=True, text=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in out.stderr


def test_dockerfile_lints_clean() -> None:
    out = subprocess.run([tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert "HEALTHCHECK" in text and "USER 10001" in text and text.count("FROM ") >= 2
    assert "TORCH_VARIANT" in text


def test_a_change_of_the_code_leaves_the_dependencies_layers_cached() -> None:
    """The environment the image runs (torch, the backbone, the service's dependencies) is built from
    ``pyproject.toml`` alone, and the service's code is a layer of its own: a change of the code rebuilds in
    seconds instead of reinstalling every dependency and copying the whole environment again."""
    text = (ROOT / "Dockerfile").read_text()
    stages = {m.group(2): (m.group(1), m.group(3)) for m in re.finditer(  # name -> (built on, instructions)
        r"^FROM (\S+) AS (\S+)\n(.*?)(?=^FROM |\Z)", text, flags=re.M | re.S)}

    def lineage(name: str) -> list[str]:  # the stage and those it is built on
        on = stages[name][0]
        return [*(lineage(on) if on in stages else []), name]

    shipped = re.findall(r"^COPY --from=(\S+) (\S+)", stages["runtime"][1], flags=re.M)
    venv = next(stage for stage, path in shipped if path == "/opt/venv")
    copied = [c for s in lineage(venv) for c in re.findall(r"^COPY (.+)$", stages[s][1], flags=re.M)]
    assert copied == ["pyproject.toml ./"]
    assert ("builder", "/opt/service") in shipped and "COPY service" in stages["builder"][1]


def test_prometheus_config_is_valid() -> None:
    """The configuration, and the alerting rules it loads (``promtool check config`` reads its rule files)."""
    out = subprocess.run([tool("promtool"), "check", "config", str(ROOT / "docker/prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "prometheus-alerts.yml" in out.stdout and f"SUCCESS: {len(alert_rules())} rules found" in out.stdout, \
        out.stdout


def test_alerts_fire_on_their_cases_and_only_there() -> None:
    """``promtool test rules``: each alert of ``docker/prometheus-alerts.yml`` fires on series that should raise it,
    with its labels and text, and stays quiet on traffic that should not (``tests/deploy/alerts-test.yml``)."""
    out = subprocess.run([tool("promtool"), "test", "rules", "tests/deploy/alerts-test.yml"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    cases = yaml.safe_load((ROOT / "tests/deploy/alerts-test.yml").read_text())["tests"]
    tested = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert tested == set(alert_rules()), "every alert has a case where it fires"


def queried_metrics(source: str) -> set[str]:
    """The service's metric names that the Grafana dashboard's queries, or the alerting rules, read."""
    if source == "dashboard":
        dash = json.loads(DASHBOARD.read_text())
        exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    else:
        exprs = list(alert_rules().values())
    assert exprs
    names = set()
    for e in exprs:
        names |= set(re.findall(r"\b(routing_[a-z_]+)", e))
    return names


def test_dashboard_is_provisioned_with_the_datasource() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ds = yaml.safe_load((ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    assert all(p["datasource"]["uid"] == uid for p in dash["panels"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("request rate", "latency", "queue wait", "batch size", "tokens per batch", "errors", "cpu memory",
                  "gpu memory"):
        assert topic in titles, topic


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_queried_metric_exists_in_real_metrics_output(tiny: Server, source: str) -> None:
    httpx.post(f"{tiny.url}/v1/classify", json={"inputs": ["hello"]})
    text = httpx.get(f"{tiny.url}/metrics").text
    exported = set()
    for fam in text_string_to_metric_families(text):
        exported.add(fam.name)
        exported |= {s.name for s in fam.samples}
    exported |= set(re.findall(r"^# TYPE (\S+)", text, re.MULTILINE))  # families without samples (CUDA on CPU)
    exported |= {n + suffix for n in list(exported) for suffix in ("_bucket", "_sum", "_count")}
    missing = sorted(queried_metrics(source) - exported)
    assert not missing, f"the {source} queries metrics the service does not export: {missing}"
