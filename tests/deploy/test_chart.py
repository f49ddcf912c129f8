"""The Helm chart renders for the default and the GPU/RDMA values, passes `helm lint --strict`,
and every manifest validates against the Kubernetes schemas (kubernetes-validate)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.tools import ROOT, find

CHART = ROOT / "charts" / "tandem"
HELM = find("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary (run `make tools`)")


def render(*args: str) -> list[dict]:
    out = subprocess.run([HELM, "template", "rel", str(CHART), *args], check=True,
                         capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def validate(docs: list[dict]) -> None:
    # CRDs (ServiceMonitor) have no schema in the bundle; everything else must pass --strict.
    core = [d for d in docs if d["apiVersion"] != "monitoring.coreos.com/v1"]
    validator = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(validator), "--strict", "-k", "1.37.0", "-"], input=yaml.safe_dump_all(core),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") == len(core)


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_lint_strict():
    r = subprocess.run([HELM, "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_default_values_render_valid_manifests():
    docs = render()
    validate(docs)
    deps = by_kind(docs, "Deployment")
    assert set(deps) == {"rel-tandem-router", "rel-tandem-prefill", "rel-tandem-decode", "rel-tandem-redis"}
    assert deps["rel-tandem-prefill"]["spec"]["replicas"] == 2
    for name in ("rel-tandem-router", "rel-tandem-prefill", "rel-tandem-decode"):
        c = deps[name]["spec"]["template"]["spec"]["containers"][0]
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        env = {e["name"]: e for e in c["env"]}
        assert env["TANDEM_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "rel-tandem-secrets"
        assert any(a.startswith("--redis-url=redis://rel-tandem-redis:6379") for a in c["args"])
    worker = deps["rel-tandem-decode"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in worker["containers"][0]["resources"]["limits"]
    assert worker["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    # The router's command line must be one our CLI accepts.
    from tandem.cli import build_parser

    router_args = deps["rel-tandem-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    build_parser().parse_args(["router", *router_args])
    build_parser().parse_args(worker["containers"][0]["args"])
    assert len(by_kind(docs, "PodDisruptionBudget")) == 3
    assert "rel-tandem-router" in by_kind(docs, "HorizontalPodAutoscaler")
    assert not by_kind(docs, "ServiceMonitor")
    secret = by_kind(docs, "Secret")["rel-tandem-secrets"]
    assert len(secret["stringData"]["internal-token"]) == 40  # generated when not given


def test_network_policy_only_router_reaches_workers_and_only_workers_reach_kv_ports():
    docs = render()
    pol = by_kind(docs, "NetworkPolicy")["rel-tandem-workers"]
    http_rule, kv_rule = pol["spec"]["ingress"]
    assert [p["port"] for p in http_rule["ports"]] == [8200]
    sources = [f["podSelector"]["matchLabels"] for f in http_rule["from"]]
    assert {"app.kubernetes.io/component": "router", "app.kubernetes.io/name": "tandem",
            "app.kubernetes.io/instance": "rel"} in sources
    assert [p["port"] for p in kv_rule["ports"]] == [9000]
    assert [f["podSelector"]["matchLabels"] for f in kv_rule["from"]] == [
        {"app.kubernetes.io/instance": "rel", "tandem.dev/pool": "worker"}]


def test_gpu_rdma_values_render_valid_manifests():
    docs = render("-f", str(CHART / "values-gpu-rdma.yaml"), "--set", "apiKeys={k1,k2}")
    validate(docs)
    deps = by_kind(docs, "Deployment")
    assert "rel-tandem-redis" not in deps  # external Redis
    for role in ("prefill", "decode"):
        spec = deps[f"rel-tandem-{role}"]["spec"]["template"]["spec"]
        c = spec["containers"][0]
        for side in ("requests", "limits"):
            assert c["resources"][side]["nvidia.com/gpu"] == 1
            assert c["resources"][side]["rdma/hca"] == 1
        assert "--device=cuda" in c["args"] and "--transport=nixl" in c["args"]
        assert any(a == "--redis-url=redis://redis.infra.svc:6379/0" for a in c["args"])
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        term = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["podAffinityTerm"]["topologyKey"] == "network.topology/block"
    assert "rel-tandem" in by_kind(docs, "ServiceMonitor")
    secret = by_kind(docs, "Secret")["rel-tandem-secrets"]
    assert secret["stringData"]["keys"].split() == ["k1", "k2"]
    router = deps["rel-tandem-router"]["spec"]["template"]["spec"]["containers"][0]
    assert "--api-keys-file=/etc/tandem/keys/keys" in router["args"]


def test_external_redis_is_required_when_the_bundled_one_is_off():
    r = subprocess.run([HELM, "template", "rel", str(CHART), "--set", "redis.enabled=false"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "redis.externalUrl is required" in r.stderr
