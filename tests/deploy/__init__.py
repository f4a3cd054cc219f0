"""The deployment's checks. The alerting rules, which several of them read, are read here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ALERTS = Path(__file__).resolve().parents[2] / "docker/prometheus-alerts.yml"


def alert_groups() -> list[dict[str, Any]]:
    """The rule groups of ``docker/prometheus-alerts.yml`` (what Prometheus loads and the PrometheusRule holds)."""
    return yaml.safe_load(ALERTS.read_text())["groups"]


def alert_rules() -> dict[str, str]:
    """Each alert of ``docker/prometheus-alerts.yml``: its expression."""
    return {r["alert"]: r["expr"] for g in alert_groups() for r in g["rules"]}
