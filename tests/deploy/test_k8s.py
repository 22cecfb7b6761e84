"""The Kubernetes manifests pass the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
no unknown fields) where a schema exists, and hang together: selectors, ports, probes on
/health, autoscalers aimed at the Deployment and reading a gauge the server exports.
(`kubectl apply --dry-run=client` needs an API server, which CI does not have.)"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dspark_serve.server.cli import build_parser
from tests.deploy.test_grafana import exported_names, promql_metric_names

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSIONS = ("1.29.0", "1.37.0")  # an older still-common cluster and the newest schemas
KINDS = {
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("v1", "ConfigMap"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}


def manifests() -> dict[str, dict]:
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            assert doc["metadata"]["name"], f
            out[doc["kind"]] = doc
    return out


@pytest.fixture(scope="module")
def docs():
    return manifests()


def test_every_manifest_is_a_known_kind(docs):
    assert set(docs) == {k for _, k in KINDS}
    for kind, d in docs.items():
        assert (d["apiVersion"], kind) in KINDS


@pytest.mark.parametrize("version", VERSIONS)
def test_core_manifests_pass_the_kubernetes_schema(docs, version):
    for d in docs.values():
        if d["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: checked structurally below
        kubernetes_validate.validate(d, version, strict=True)
    # the check can fail: a misspelt field or a wrong type is rejected
    bad = copy.deepcopy(docs["Deployment"])
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)
    bad = copy.deepcopy(docs["Service"])
    bad["spec"]["ports"][0]["port"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


def test_deployment_service_and_probes_agree(docs):
    dep, svc = docs["Deployment"], docs["Service"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    exposed = int(re.search(r"^EXPOSE (\d+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1))
    assert exposed in ports.values()
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in ports or p["targetPort"] in ports.values()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert get["port"] in ports or get["port"] in ports.values(), probe
    # the container's flags are flags the server accepts
    build_parser().parse_args(container.get("args", []))
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) in ports.values() and ann["prometheus.io/path"] == "/metrics"


def _targets_deployment(ref, dep):
    return (ref["kind"], ref["name"], ref.get("apiVersion")) == (
        "Deployment",
        dep["metadata"]["name"],
        dep["apiVersion"],
    )


def test_keda_scaledobject_scales_on_the_waiting_gauge(docs):
    so, dep = docs["ScaledObject"], docs["Deployment"]
    spec = so["spec"]
    assert _targets_deployment(spec["scaleTargetRef"], dep)
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trig,) = spec["triggers"]
    assert trig["type"] == "prometheus"
    meta = trig["metadata"]
    assert re.fullmatch(r"https?://[\w.-]+(:\d+)?", meta["serverAddress"])
    assert float(meta["threshold"]) > 0 and isinstance(meta["threshold"], str)  # KEDA wants strings
    names = promql_metric_names(meta["query"])
    assert names and names <= exported_names()
    assert any(n.endswith("num_requests_waiting") for n in names)


def test_hpa_scales_on_the_waiting_gauge_through_the_adapter_rule(docs):
    hpa, dep, cm = docs["HorizontalPodAutoscaler"], docs["Deployment"], docs["ConfigMap"]
    assert _targets_deployment(hpa["spec"]["scaleTargetRef"], dep)
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    want = metric["pods"]["metric"]["name"]
    (rule,) = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    series = re.match(r"([\w:]+)\{", rule["seriesQuery"]).group(1)
    assert series in exported_names()
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert served == want == "num_requests_waiting"
