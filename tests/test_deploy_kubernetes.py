"""deploy/kubernetes: every manifest validates against Kubernetes' own schemas (strict, so an
unknown or misspelt field fails), the Prometheus Operator resources carry the tested rules, and
the safety properties of the layout hold (vLLM's admin routes never leave the pod, probes and a
drain before SIGTERM, vLLM at a version the supervisor accepts)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from haru_supervisor._vllm import MIN_VLLM_VERSION
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBE.glob("*.yaml"))
KUBERNETES_VERSION = "1.34"
"""The oldest release the manifests target (DRA's resource.k8s.io/v1 is GA there)."""
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}
"""Prometheus Operator resources: their schemas are not Kubernetes'; checked below by hand."""
_VLLM_IMAGE = re.compile(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)")


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = [
        (path.name, doc)
        for path in MANIFESTS
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]
    assert len(found) >= 8, found
    return found


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def pod_specs() -> list[dict[str, Any]]:
    return [doc["spec"]["template"]["spec"] for doc in by_kind("Deployment")]


@pytest.mark.parametrize(
    ("name", "doc"),
    [(n, d) for n, d in documents() if d["kind"] not in CUSTOM_KINDS],
    ids=lambda value: (
        value if isinstance(value, str) else f"{value['kind']}/{value['metadata']['name']}"
    ),
)
def test_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    doc = by_kind("Deployment")[0]
    broken = yaml.safe_load(yaml.safe_dump(doc))
    probe = broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
    probe["periodSecondz"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecondz"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_prometheus_rule_carries_the_tested_rules() -> None:
    (rule,) = by_kind("PrometheusRule")
    tested = yaml.safe_load((ROOT / "deploy" / "prometheus" / "haru-rules.yml").read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == tested


def test_service_monitors_scrape_the_services_with_their_tokens() -> None:
    monitors = {m["metadata"]["name"]: m for m in by_kind("ServiceMonitor")}
    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    server = monitors["haru-server"]["spec"]
    assert server["selector"]["matchLabels"] == services["haru-server"]["spec"]["selector"]
    ports = {p["name"] for p in services["haru-server"]["spec"]["ports"]}
    for endpoint in server["endpoints"]:
        assert endpoint["port"] in ports
        assert endpoint["path"] == "/metrics"
        assert endpoint["authorization"]["credentials"]["key"] == "api-token"
    supervisors = monitors["haru-supervisors"]["spec"]["endpoints"]
    assert [e["port"] for e in supervisors] == ["supervisor"]


def test_vllm_listens_on_loopback_and_no_service_exposes_it() -> None:
    vllm_ports: set[int] = set()
    for spec in pod_specs():
        for container in spec["containers"]:
            if "vllm" not in container["image"]:
                continue
            args = container["args"]
            assert "--host=127.0.0.1" in args, container["name"]
            assert "--enable-sleep-mode" in args
            port = next(int(a.split("=", 1)[1]) for a in args if a.startswith("--port="))
            vllm_ports.add(port)
            assert not container.get("ports"), "a vLLM port is declared on the pod"
    assert vllm_ports
    for service in by_kind("Service"):
        for port in service["spec"]["ports"]:
            assert port["port"] not in vllm_ports, service["metadata"]["name"]
            assert port.get("targetPort") not in vllm_ports, service["metadata"]["name"]


def test_the_gateway_exposes_only_the_openai_routes() -> None:
    (config,) = [c for c in by_kind("ConfigMap") if "gateway.conf" in c["data"]]
    conf = config["data"]["gateway.conf"]
    locations = re.findall(r"location\s+(\S+)\s*\{([^}]*)\}", conf)
    proxied = [path for path, body in locations if "proxy_pass" in body]
    assert proxied == ["/v1/"]
    assert any(path == "/" and "return 404" in body for path, body in locations)


def test_server_probes_and_drain_before_sigterm() -> None:
    (server,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "haru-server"]
    spec = server["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause > 0
    assert spec["terminationGracePeriodSeconds"] > pause
    assert server["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (budget,) = by_kind("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"] == server["spec"]["selector"]["matchLabels"]
    assert budget["spec"]["minAvailable"] < server["spec"]["replicas"]
    # Secrets come from files or secret references, never literal values in the manifest.
    for env in container["env"]:
        if "TOKEN" in env["name"]:
            assert env["name"].endswith("_FILE"), env
        if env["name"] == "DATABASE_URL":
            assert "secretKeyRef" in env["valueFrom"]


@pytest.mark.parametrize(
    "path",
    [*MANIFESTS, ROOT / "deploy" / "compose.yaml", ROOT / "README.md"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_examples_name_a_vllm_the_supervisor_accepts(path: Path) -> None:
    minimum = Version(".".join(str(part) for part in MIN_VLLM_VERSION))
    for found in _VLLM_IMAGE.findall(path.read_text()):
        assert Version(found) >= minimum, f"{path.name}: vLLM {found} < {minimum}"


def test_the_vllm_version_check_catches_an_old_pin(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text("image: vllm/vllm-openai:v0.11.0\n")
    with pytest.raises(AssertionError, match=r"0\.11\.0"):
        test_examples_name_a_vllm_the_supervisor_accepts(old)
