"""The Kubernetes manifests: every built-in resource (the GPU overlay's patch applied) validates
strictly against the Kubernetes schemas (kubernetes-validate, offline), and the custom resources of
the Prometheus Operator and KServe agree with the Deployment they point at."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from tests.deploy import alert_groups

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker/kubernetes"
VERSIONS = ["1.30.0", "1.35.0"]  # the oldest and a recent release the manifests must satisfy


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base() -> dict[str, dict[str, Any]]:
    """The base kustomization's resources by kind."""
    kust = docs(K8S / "kustomization.yaml")[0]
    out = {}
    for name in kust["resources"]:
        for d in docs(K8S / name):
            out[d["kind"]] = d
    return out


def gpu_deployment() -> dict[str, Any]:
    kust = docs(K8S / "gpu/kustomization.yaml")[0]
    assert kust["resources"] == [".."]
    (patch,) = kust["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "routing-service"}
    ops = yaml.safe_load((K8S / "gpu" / patch["path"]).read_text())
    return jsonpatch.apply_patch(copy.deepcopy(base()["Deployment"]), ops)


def builtin() -> list[tuple[str, dict[str, Any]]]:
    out = [(f"base {k}", d) for k, d in base().items()]
    out.append(("gpu Deployment", gpu_deployment()))
    out.append(("extras HPA on the queue depth", docs(K8S / "extras/hpa-queue-depth.yaml")[0]))
    return out


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "resource"), builtin(), ids=[n for n, _ in builtin()])
def test_builtin_resources_validate_strictly(name: str, resource: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(resource, version, strict=True)


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_deployment_drains_before_it_is_killed_and_runs_locked_down() -> None:
    dep = base()["Deployment"]
    spec = dep["spec"]["template"]["spec"]
    c = container(dep)
    env = {e["name"]: e["value"] for e in c["env"]}
    pre_stop = float(re.search(r"sleep\((\d+(?:\.\d+)?)\)", " ".join(c["lifecycle"]["preStop"]["exec"]["command"]))[1])
    assert spec["terminationGracePeriodSeconds"] > float(env["ROUTING_DRAIN_TIMEOUT_S"]) + pre_stop + 5
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"USER {spec['securityContext']['runAsUser']}:" in dockerfile and spec["securityContext"]["runAsNonRoot"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])  # the only writable place
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc, hpa, pdb = base()["Service"], base()["HorizontalPodAutoscaler"], base()["PodDisruptionBudget"]
    assert svc["spec"]["selector"].items() <= labels.items() and pdb["spec"]["selector"]["matchLabels"].items() <= \
        labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] in {p["name"] for p in c["ports"]}
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                              "name": dep["metadata"]["name"]}
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"


def test_gpu_overlay_asks_for_a_gpu_and_the_cuda_build() -> None:
    c = container(gpu_deployment())
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"].endswith(":cuda")
    assert {"name": "ROUTING_DEVICE", "value": "cuda"} in c["env"]


def test_custom_resources_agree_with_the_deployment() -> None:
    dep = base()["Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    c = container(dep)
    pod_monitor, service_monitor = docs(K8S / "extras/monitoring.yaml")
    for mon in (pod_monitor, service_monitor):
        assert mon["apiVersion"] == "monitoring.coreos.com/v1"
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # not a built-in kind: checked here instead
            kubernetes_validate.validate(mon, VERSIONS[-1], strict=True)
        assert mon["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pod_monitor["kind"] == "PodMonitor" and service_monitor["kind"] == "ServiceMonitor"
    assert pod_monitor["spec"]["podMetricsEndpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}
    assert service_monitor["spec"]["endpoints"][0]["port"] == base()["Service"]["spec"]["ports"][0]["name"]
    isvc = docs(K8S / "extras/inferenceservice.yaml")[0]
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    (pc,) = isvc["spec"]["predictor"]["containers"]
    assert pc["name"] == "kserve-container" and pc["image"] == c["image"]
    assert pc["ports"][0]["containerPort"] == c["ports"][0]["containerPort"] == 8000
    assert pc["readinessProbe"]["httpGet"]["path"] == "/readyz"
    models = {p.name for p in (ROOT / "models").iterdir() if (p / "manifest.json").is_file()}
    assert isvc["metadata"]["name"] in models  # KServe V1 paths name the model: /v1/models/<name>:predict
    runtime = docs(K8S / "extras/servingruntime.yaml")[0]
    assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1", "ServingRuntime")
    (rc,) = runtime["spec"]["containers"]
    assert rc["name"] == "kserve-container" and rc["image"] == c["image"]
    assert rc["ports"][0]["containerPort"] == c["ports"][0]["containerPort"] == 8000
    assert rc["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert set(runtime["spec"]["protocolVersions"]) == {"v1", "v2"}  # KServe V1 and the Open Inference Protocol
    assert [f["name"] for f in runtime["spec"]["supportedModelFormats"]] == ["routing-head"]


def test_prometheus_rule_holds_the_compose_stacks_alerting_rules() -> None:
    """``extras/alerts.yaml`` is the Prometheus Operator's form of ``docker/prometheus-alerts.yml``: the same groups
    (tested by ``promtool test rules`` there), so that the two deployments alert alike."""
    (rule,) = docs(K8S / "extras/alerts.yaml")
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # not a built-in kind: checked here instead
        kubernetes_validate.validate(rule, VERSIONS[-1], strict=True)
    assert rule["metadata"]["labels"].items() <= base()["Deployment"]["metadata"]["labels"].items()
    assert rule["spec"]["groups"] == alert_groups()
