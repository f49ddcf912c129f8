"""The Helm chart renders for the default and the GPU/RDMA values, passes `helm lint --strict`,
and every manifest validates against the Kubernetes schemas (kubernetes-validate) or, for the
custom resources, against the models generated from their CRDs (cloudcoil's KEDA and
prometheus-operator packages)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.tools import ROOT, find

CHART = ROOT / "charts" / "tandem"
# Each custom resource the chart renders: the cloudcoil models package its kind's model is in.
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "prometheus_operator.v1",
        ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheus_operator.v1",
        ("keda.sh/v1alpha1", "ScaledObject"): "keda.v1alpha1"}
PROMTOOL = find("promtool")
HELM = find("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary (run `make tools`)")


# Where an operator pushed the images (the chart has no default: it refuses to install without).
IMAGES = ("--set", "image.router.repository=registry.example/tandem-router",
          "--set", "image.worker.repository=registry.example/tandem-worker")


def render(*args: str) -> list[dict]:
    out = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES, *args], check=True,
                         capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def validate(docs: list[dict]) -> None:
    # Custom resources have no schema in kubernetes-validate's bundle: each is checked against
    # its CRD's generated model, strictly (a field the CRD lacks is an error, as with
    # `kubectl apply --validate=strict`); everything else must pass --strict.
    custom = [d for d in docs if (d["apiVersion"], d["kind"]) in CRDS]
    for doc in custom:
        validate_custom(doc)
    core = [d for d in docs if d not in custom]
    validator = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(validator), "--strict", "-k", "1.37.0", "-"],
                       input=yaml.safe_dump_all(core), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") == len(core)


def crd_model(api_version: str, kind: str):
    # Imported on first use, not at collection: the generated models take seconds to import,
    # and every test process of `make test` collects this file.
    module = importlib.import_module(f"cloudcoil.models.{CRDS[api_version, kind]}")
    return getattr(module, kind)


def validate_custom(doc: dict) -> None:
    """`doc` conforms to its CRD's schema, with no field the schema does not name."""
    model = crd_model(doc["apiVersion"], doc["kind"]).model_validate(doc)
    # The models ignore unknown fields, so a field they dropped is one the CRD does not have.
    assert model.model_dump(mode="json", by_alias=True, exclude_unset=True) == doc, \
        f"{doc['kind']} {doc['metadata']['name']} has fields its CRD does not define"


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_lint_strict():
    r = subprocess.run([HELM, "lint", "--strict", str(CHART), *IMAGES],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_without_its_images_the_chart_refuses_to_install_and_says_how_to_get_them():
    r = subprocess.run([HELM, "template", "rel", str(CHART)], capture_output=True, text=True)
    assert r.returncode != 0
    assert "image.router.repository is not set" in r.stderr and "docker/build.sh" in r.stderr
    only_router = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES[:2]],
                                 capture_output=True, text=True)
    assert (only_router.returncode != 0
            and "image.worker.repository is not set" in only_router.stderr)


def test_default_values_render_valid_manifests():
    docs = render()
    validate(docs)
    deps = by_kind(docs, "Deployment")
    assert (set(deps)
            == {"rel-tandem-router", "rel-tandem-prefill", "rel-tandem-decode", "rel-tandem-redis"})
    assert deps["rel-tandem-prefill"]["spec"]["replicas"] == 2
    for name in ("rel-tandem-router", "rel-tandem-prefill", "rel-tandem-decode"):
        c = deps[name]["spec"]["template"]["spec"]["containers"][0]
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        env = {e["name"]: e for e in c["env"]}
        assert (env["TANDEM_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
                == "rel-tandem-secrets")
        assert any(a.startswith("--redis-url=redis://rel-tandem-redis:6379") for a in c["args"])
    worker = deps["rel-tandem-decode"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in worker["containers"][0]["resources"]["limits"]
    assert "add" not in worker["containers"][0]["securityContext"]["capabilities"]  # no RDMA
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
    http_rule, kv_rule, metrics_rule = pol["spec"]["ingress"]
    assert [p["port"] for p in http_rule["ports"]] == [8200]
    sources = [f["podSelector"]["matchLabels"] for f in http_rule["from"]]
    assert {"app.kubernetes.io/component": "router", "app.kubernetes.io/name": "tandem",
            "app.kubernetes.io/instance": "rel"} in sources
    assert [p["port"] for p in kv_rule["ports"]] == [9000]
    assert [f["podSelector"]["matchLabels"] for f in kv_rule["from"]] == [
        {"app.kubernetes.io/instance": "rel", "tandem.dev/pool": "worker"}]


def _admits(rule: dict, pod_labels: dict, namespace_labels: dict, port: int) -> bool:
    """Does one NetworkPolicy ingress rule let a pod (labels, its namespace's labels) reach `port`?
    (matchLabels selectors, as this chart writes them.)"""
    if port not in [p["port"] for p in rule.get("ports", [])]:
        return False
    if "from" not in rule:
        return True
    for peer in rule["from"]:
        ns_sel = peer.get("namespaceSelector")
        pod_sel = peer.get("podSelector")
        ns_ok = ns_sel is not None and all(namespace_labels.get(k) == v
                                           for k, v in ns_sel.get("matchLabels", {}).items())
        pod_ok = pod_sel is not None and all(pod_labels.get(k) == v
                                             for k, v in pod_sel.get("matchLabels", {}).items())
        if ns_sel is not None and pod_sel is not None and ns_ok and pod_ok:
            return True
        if ns_sel is not None and pod_sel is None and ns_ok:
            return True
        if ns_sel is None and pod_sel is not None and pod_ok and namespace_labels.get("self"):
            return True
    return False


def test_prometheus_in_the_monitoring_namespace_may_scrape_workers_and_nothing_else_may():
    docs = render(
        "--set", "networkPolicy.routerIngressFrom[0].podSelector.matchLabels.role=gateway")
    pols = by_kind(docs, "NetworkPolicy")
    workers, router = pols["rel-tandem-workers"], pols["rel-tandem-router"]
    deps = by_kind(docs, "Deployment")
    worker_port = (deps["rel-tandem-decode"]["spec"]["template"]["spec"]["containers"][0]["ports"]
                   [0]["containerPort"])
    prometheus = ({"app.kubernetes.io/name": "prometheus"},
                  {"kubernetes.io/metadata.name": "monitoring"})
    stranger = ({"app": "curious"}, {"kubernetes.io/metadata.name": "default"})
    assert any(_admits(r, *prometheus, worker_port) for r in workers["spec"]["ingress"])
    assert not any(_admits(r, *stranger, worker_port) for r in workers["spec"]["ingress"])
    assert not any(_admits(r, *prometheus, 9000) for r in workers["spec"]["ingress"])  # KV port
    assert any(_admits(r, *prometheus, 8000) for r in router["spec"]["ingress"])
    assert not any(_admits(r, *stranger, 8000) for r in router["spec"]["ingress"])
    # The Deployments' pod annotations point Prometheus at that same port.
    pod = deps["rel-tandem-decode"]["spec"]["template"]["metadata"]
    assert pod["annotations"]["prometheus.io/port"] == str(worker_port)


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
        caps = c["securityContext"]["capabilities"]
        assert caps["drop"] == ["ALL"] and caps["add"] == ["IPC_LOCK"]  # pinned memory for RDMA
        assert any(a == "--redis-url=redis://redis.infra.svc:6379/0" for a in c["args"])
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        term = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["podAffinityTerm"]["topologyKey"] == "network.topology/block"
        # Pulls between pods go over RDMA: pods share no PID/IPC namespace, so a cuda_ipc (or
        # shared-memory) lane between them never forms (docs/deployment.md, RDMA and UCX).
        env = {e["name"]: e.get("value") for e in c["env"]}
        lanes = env["UCX_TLS"].split(",")
        assert "rc" in lanes and "cuda_copy" in lanes and env["UCX_IB_GPU_DIRECT_RDMA"] == "yes"
        assert not {"cuda_ipc", "cma", "posix", "sm", "shm"} & set(lanes)
        assert not spec.get("shareProcessNamespace") and not spec.get("hostIPC")
    assert "rel-tandem" in by_kind(docs, "ServiceMonitor")
    secret = by_kind(docs, "Secret")["rel-tandem-secrets"]
    assert secret["stringData"]["keys"].split() == ["k1", "k2"]
    router = deps["rel-tandem-router"]["spec"]["template"]["spec"]["containers"][0]
    assert "--api-keys-file=/etc/tandem/keys/keys" in router["args"]


def test_external_redis_is_required_when_the_bundled_one_is_off():
    r = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES, "--set",
                        "redis.enabled=false"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "redis.externalUrl is required" in r.stderr


def test_redis_cluster_mode_passes_the_flag_to_every_service():
    docs = render("--set", "redis.enabled=false", "--set", "redis.cluster=true",
                  "--set", "redis.externalUrl=redis://redis-cluster.infra.svc:6379")
    validate(docs)
    deps = by_kind(docs, "Deployment")
    assert "rel-tandem-redis" not in deps
    from tandem.cli import build_parser

    for name in ("rel-tandem-router", "rel-tandem-prefill", "rel-tandem-decode"):
        args = deps[name]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--redis-cluster" in args
        parsed = build_parser().parse_args((["router"] if name.endswith("router") else []) + args)
        assert parsed.redis_cluster is True
    r = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES, "--set",
                        "redis.cluster=true"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "redis.cluster needs redis.externalUrl" in r.stderr


def test_autoscaling_is_cpu_alone_unless_a_metrics_provider_is_named():
    hpa = by_kind(render(), "HorizontalPodAutoscaler")["rel-tandem-router"]
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Resource"]  # metrics-server suffices
    docs = render("--set", "router.autoscaling.inflight.provider=prometheus-adapter")
    validate(docs)
    metrics = by_kind(docs, "HorizontalPodAutoscaler")["rel-tandem-router"]["spec"]["metrics"]
    assert metrics[0]["pods"]["metric"]["name"] == "tandem_router_inflight_requests"
    docs = render("--set", "router.autoscaling.inflight.provider=keda")
    validate(docs)
    assert not by_kind(docs, "HorizontalPodAutoscaler")  # KEDA makes its own
    scaled = by_kind(docs, "ScaledObject")["rel-tandem-router"]
    prom = scaled["spec"]["triggers"][0]
    assert (prom["type"] == "prometheus"
            and "tandem_router_inflight_requests" in prom["metadata"]["query"])
    assert scaled["spec"]["scaleTargetRef"]["name"] in by_kind(docs, "Deployment")
    assert not by_kind(render("--set", "router.autoscaling.enabled=false"),
                       "HorizontalPodAutoscaler")
    r = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES,
                        "--set", "router.autoscaling.inflight.provider=bogus"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "prometheus-adapter" in r.stderr and "keda" in r.stderr


def test_prometheus_rule_has_the_compose_alerts_scoped_to_the_release(tmp_path):
    docs = render("--set", "prometheusRule.enabled=true")
    rule = by_kind(docs, "PrometheusRule")["rel-tandem"]
    chart_rules = rule["spec"]["groups"][0]["rules"]
    compose = yaml.safe_load((ROOT / "docker" / "prometheus" / "alerts.yml").read_text())
    compose_rules = compose["groups"][0]["rules"]
    def strip(r):
        return {k: v for k, v in r.items() if k != "expr"}
    assert [strip(r) for r in chart_rules] == [strip(r) for r in compose_rules]
    for r in chart_rules:  # every series selected belongs to this release's jobs
        assert r["expr"].count('job=~"rel-tandem-.*"') == r["expr"].count("{")
    if PROMTOOL:
        path = tmp_path / "rules.yml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        r = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_helm_test_hook_sends_one_chat_request_to_the_router():
    docs = render("--set", "apiKeys={k1,k2}")
    pod = by_kind(docs, "Pod")["rel-tandem-test-chat"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    assert c["args"][1:] == ["smollm2-135m-instruct", "http://rel-tandem-router:8000/v1/chat/completions"]
    assert by_kind(docs, "Service")["rel-tandem-router"]["spec"]["ports"][0]["port"] == 8000
    compile(c["args"][0], "helm-test", "exec")  # the script is valid Python
    assert c["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "rel-tandem-secrets", "key": "keys"}


def test_an_existing_secret_holds_the_internal_token_and_nothing_is_generated():
    args = ("--set", "internalTokenSecret.name=vault-tandem", "--set",
            "internalTokenSecret.key=token")
    docs = render(*args)
    validate(docs)
    assert "rel-tandem-secrets" not in by_kind(docs, "Secret")  # no API keys either: no Secret
    for d in by_kind(docs, "Deployment").values():
        if d["metadata"]["name"].endswith("redis"):
            continue
        env = {e["name"]: e for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert (env["TANDEM_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]
                == {"name": "vault-tandem", "key": "token"})
    assert render(*args) == docs  # GitOps: two renders, one result


@pytest.mark.parametrize(("flag", "message"), [
    ("router.replicas=two", "/router/replicas"),
    ("prefill.transport=udp", "/prefill/transport"),
    ("decode.gpus=-1", "/decode/gpus"),
    ("redis.cluster=yes", "/redis/cluster"),
    ("router.polcy=kv_aware", "polcy"),  # a typo is refused, not ignored
    ("vllm.kvEvents.transport=udp", "/vllm/kvEvents/transport"),
    ("vllm.kvEvents.bufferSteps=0", "/vllm/kvEvents/bufferSteps"),
])
def test_the_values_schema_refuses_bad_values_at_install(flag, message):
    r = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES, "--set", flag],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "schema" in r.stderr and message in r.stderr, r.stderr


@pytest.mark.parametrize(("source", "sets", "volume_key"), [
    ("pvc", ["model.pvc.claimName=llama-weights", "model.pvc.subPath=llama-3.1-8b"],
     "persistentVolumeClaim"),
    ("hostPath", ["model.hostPath.path=/mnt/models/llama-3.1-8b"], "hostPath"),
    ("imageVolume", ["model.imageVolume.reference=registry.example/models/llama:3.1-8b"], "image"),
    ("huggingface", ["model.huggingface.repo=meta-llama/Llama-3.1-8B-Instruct",
                     "model.huggingface.endpoint=http://hf-mirror.infra:8080",
                     "model.huggingface.tokenSecret.name=hf-token"], "emptyDir"),
])
def test_models_come_from_outside_the_image_for_workers_and_router(source, sets, volume_key):
    from tandem.cli import build_parser

    args = ["--set", "model.name=llama-3.1-8b", "--set", f"model.source={source}"]
    for s in sets:
        args += ["--set", s]
    docs = render(*args)
    validate(docs)
    deps = by_kind(docs, "Deployment")
    for name in ("rel-tandem-router", "rel-tandem-prefill", "rel-tandem-decode"):
        spec = deps[name]["spec"]["template"]["spec"]
        volume = {v["name"]: v for v in spec["volumes"]}["model"]
        assert volume_key in volume
        c = spec["containers"][0]
        mount = {m["name"]: m for m in c["volumeMounts"]}["model"]
        assert mount["mountPath"] == "/models/llama-3.1-8b"
        if source == "pvc":
            assert mount["subPath"] == "llama-3.1-8b" and volume[volume_key]["readOnly"] is True
        if name.endswith("router"):
            assert "--tokenizer=/models/llama-3.1-8b" in c["args"]
        else:
            assert "--model=/models/llama-3.1-8b" in c["args"]
        inits = spec.get("initContainers", [])
        if source != "huggingface":
            assert not inits
            continue
        (init,) = inits
        assert init["command"] == ["tandem"]
        parsed = build_parser().parse_args(init["args"])  # a command line our CLI accepts
        assert (parsed.hf_repo == "meta-llama/Llama-3.1-8B-Instruct"
                and parsed.out == "/models/llama-3.1-8b")
        assert parsed.tokenizer_only is name.endswith("router")  # the router takes no weights
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_ENDPOINT"]["value"] == "http://hf-mirror.infra:8080"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models/llama-3.1-8b"}]


def test_a_model_source_without_its_location_is_refused():
    for source, message in (("pvc", "model.pvc.claimName is required"),
                            ("huggingface", "model.huggingface.repo is required")):
        r = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES, "--set",
                            f"model.source={source}"],
                           capture_output=True, text=True)
        assert r.returncode != 0 and message in r.stderr, r.stderr


VALUES_FILES = sorted(CHART.glob("values*.yaml"))


@pytest.mark.parametrize("values", VALUES_FILES, ids=lambda p: p.name)
def test_every_values_file_lints_and_renders_valid_manifests(values):
    r = subprocess.run([HELM, "lint", "--strict", str(CHART), *IMAGES, "-f", str(values)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    validate(render("-f", str(values)))


def test_the_vllm_engine_runs_vllm_with_the_nixl_connector_behind_the_router():
    from tandem.cli import build_parser

    assert ({p.name for p in VALUES_FILES}
            >= {"values.yaml", "values-gpu-vllm.yaml", "values-gpu-rdma.yaml"})
    docs = render("-f", str(CHART / "values-gpu-vllm.yaml"), "--set", "decode.gpus=2")
    sets = by_kind(docs, "StatefulSet")
    assert set(sets) == {"rel-tandem-prefill", "rel-tandem-decode"}
    assert not {"rel-tandem-prefill", "rel-tandem-decode"} & set(by_kind(docs, "Deployment"))
    urls = []
    for role, gpus in (("prefill", 1), ("decode", 2)):
        sts = sets[f"rel-tandem-{role}"]
        assert sts["spec"]["serviceName"] == f"rel-tandem-{role}"
        assert by_kind(docs, "Service")[f"rel-tandem-{role}"]["spec"]["clusterIP"] == "None"
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert c["image"].startswith("vllm/vllm-openai:")
        args = c["args"]
        assert '--kv-transfer-config={"kv_connector":"NixlConnector","kv_role":"kv_both"}' in args
        assert "--enable-prompt-tokens-details" in args  # cached tokens reach the answers
        assert (f"--tensor-parallel-size={gpus}" in args
                and "--served-model-name=llama-3.1-8b-instruct" in args)
        assert "--model=/models/llama-3.1-8b-instruct" in args
        for side in ("requests", "limits"):
            assert c["resources"][side]["nvidia.com/gpu"] == gpus
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "9000"
        assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "internal-token"
        shm = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}["dshm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        urls += [f"http://rel-tandem-{role}-{i}.rel-tandem-{role}.default.svc:8200"
                 for i in range(2)]
    router = (by_kind(docs, "Deployment")["rel-tandem-router"]["spec"]["template"]["spec"]
              ["containers"][0])
    parsed = build_parser().parse_args(["router", *router["args"]])
    assert not hasattr(parsed, "workers")  # no static list: the bridges register the pods in Redis
    env = {e["name"]: e for e in router["env"]}
    assert (env["TANDEM_ROUTER_VLLM_API_KEY"]["valueFrom"]
            == env["TANDEM_INTERNAL_TOKEN"]["valueFrom"])

    # Without KV events the router lists every pod by its DNS name (the approximate index).
    docs = render("-f", str(CHART / "values-gpu-vllm.yaml"), "--set", "vllm.kvEvents.enabled=false")
    validate(docs)
    router = (by_kind(docs, "Deployment")["rel-tandem-router"]["spec"]["template"]["spec"]
              ["containers"][0])
    parsed = build_parser().parse_args(["router", *router["args"]])
    from router.workers import parse_static

    listed = [parse_static(w) for w in parsed.workers]
    assert [(b, url) for b, _, url, _ in listed] == [("vllm", u) for u in urls]
    assert {m for *_, m in listed} == {"llama-3.1-8b-instruct"}
    for sts in by_kind(docs, "StatefulSet").values():
        spec = sts["spec"]["template"]["spec"]
        assert [c["name"] for c in spec["containers"]] == ["worker"]
        assert not any(a.startswith("--kv-events-config") for a in spec["containers"][0]["args"])
        assert "kv-events" not in {v["name"] for v in spec["volumes"]}


POD = "rel-tandem-prefill-0"


def kv_events_config(vllm: dict) -> dict:
    (arg,) = [a for a in vllm["args"] if a.startswith("--kv-events-config=")]
    return json.loads(arg.split("=", 1)[1])


def bridge_settings(bridge: dict, pod: str = POD):
    """The sidecar's command line as `tandem` parses it and its settings validate it, with
    $(POD_NAME) expanded as the kubelet does."""
    from tandem.cli import build_parser
    from tandem.flags import given
    from vllm_bridge.settings import BridgeSettings

    assert bridge["command"] == ["tandem", "--log-json", "vllm-bridge"]
    argv = [a.replace("$(POD_NAME)", pod) for a in bridge["command"][1:] + bridge["args"]]
    parsed = build_parser().parse_args(argv)
    assert parsed.command == "vllm-bridge"
    return BridgeSettings(**given(parsed, BridgeSettings))


def test_each_vllm_pod_publishes_kv_events_over_ipc_to_a_bridge_sidecar_that_registers_it():
    docs = render("-f", str(CHART / "values-gpu-vllm.yaml"))
    validate(docs)
    for role in ("prefill", "decode"):
        spec = by_kind(docs, "StatefulSet")[f"rel-tandem-{role}"]["spec"]["template"]["spec"]
        vllm, bridge = spec["containers"]
        assert (vllm["name"], bridge["name"]) == ("worker", "tandem-bridge")
        cfg = kv_events_config(vllm)
        assert cfg["enable_kv_cache_events"] is True and cfg["publisher"] == "zmq"
        assert cfg["endpoint"] == "ipc:///run/tandem-kv/events"  # vLLM binds ipc:// addresses
        assert cfg["replay_endpoint"] == "ipc:///run/tandem-kv/replay"  # replay on
        assert cfg["topic"] == "kv@$(POD_NAME)@llama-3.1-8b-instruct"
        assert {p["name"] for p in vllm["ports"]} == {"http", "kv"}  # nothing on the network
        env = {e["name"]: e for e in vllm["env"]}
        assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        # The sockets' folder: one memory emptyDir both containers mount.
        volume = {v["name"]: v for v in spec["volumes"]}["kv-events"]
        assert volume["emptyDir"]["medium"] == "Memory"
        for c in (vllm, bridge):
            assert {"name": "kv-events", "mountPath": "/run/tandem-kv"} in c["volumeMounts"]
        # The sidecar: the router image (the tandem CLI, no torch), vLLM on loopback, the same
        # sockets and topic, registered under the pod's name and stable DNS URL.
        assert bridge["image"] == "registry.example/tandem-router:latest"
        pod = f"rel-tandem-{role}-0"
        s = bridge_settings(bridge, pod)
        assert s.vllm_url == "http://127.0.0.1:8200"
        assert s.public_url == f"http://{pod}.rel-tandem-{role}.default.svc:8200"
        assert s.events_endpoint == cfg["endpoint"] and s.replay_endpoint == cfg["replay_endpoint"]
        assert s.topic == cfg["topic"].replace("$(POD_NAME)", pod)
        assert s.role == role and s.resolved_worker_id == pod
        assert s.redis_url == "redis://rel-tandem-redis:6379/0" and s.namespace == "rel"
        assert str(s.model_folder) == "/models/llama-3.1-8b-instruct"  # the digest, as workers'
        mount = {m["name"]: m for m in bridge["volumeMounts"]}["model"]
        assert mount["readOnly"] is True and mount["subPath"] == "Llama-3.1-8B-Instruct"
        benv = {e["name"]: e for e in bridge["env"]}
        token = {"secretKeyRef": {"name": "rel-tandem-secrets", "key": "internal-token"}}
        assert benv["TANDEM_BRIDGE_INTERNAL_TOKEN"]["valueFrom"] == token  # signs the registration
        assert benv["TANDEM_BRIDGE_VLLM_API_KEY"]["valueFrom"] == env["VLLM_API_KEY"]["valueFrom"]
        assert benv["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert bridge["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert bridge["resources"]["limits"]["memory"]


def test_kv_events_over_tcp_reach_only_the_named_peers_and_a_bridge_may_run_elsewhere():
    from tandem.cli import build_parser

    peer = {"podSelector": {"matchLabels": {"app": "kv-indexer"}}}
    docs = render("--set", "engine=vllm", "--set", "vllm.kvEvents.transport=tcp",
                  "--set", "vllm.kvEvents.from[0].podSelector.matchLabels.app=kv-indexer",
                  "--set", "vllm.kvEvents.reportFullPrefix=true",
                  "--set", "redis.enabled=false", "--set", "redis.cluster=true",
                  "--set", "redis.externalUrl=redis://redis-cluster.infra.svc:6379")
    validate(docs)
    spec = by_kind(docs, "StatefulSet")["rel-tandem-prefill"]["spec"]["template"]["spec"]
    vllm, bridge = spec["containers"]
    cfg = kv_events_config(vllm)
    assert (cfg["endpoint"], cfg["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")
    assert {p["name"]: p["containerPort"] for p in vllm["ports"]} == {
        "http": 8200, "kv": 9000, "kv-events": 5557, "kv-replay": 5558}
    assert "kv-events" not in {v["name"] for v in spec["volumes"]}
    s = bridge_settings(bridge)
    assert (s.events_endpoint, s.replay_endpoint) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert s.redis_cluster is True and s.redis_url == "redis://redis-cluster.infra.svc:6379"
    assert s.model_folder is None  # model.source=image: vLLM's own image, no folder to read
    assert "volumeMounts" not in bridge
    router = (by_kind(docs, "Deployment")["rel-tandem-router"]["spec"]["template"]["spec"]
              ["containers"][0])
    parsed = build_parser().parse_args(["router", *router["args"]])
    assert parsed.vllm_report_full_prefix is True and not hasattr(parsed, "workers")
    # The event ports: the named peers only (the sidecar reads them on loopback).
    rules = by_kind(docs, "NetworkPolicy")["rel-tandem-workers"]["spec"]["ingress"]
    ns = {"self": True}
    for port in (5557, 5558):
        assert any(_admits(r, {"app": "kv-indexer"}, ns, port) for r in rules)
        for labels in ({"app.kubernetes.io/instance": "rel", "app.kubernetes.io/name": "tandem",
                        "app.kubernetes.io/component": "router"},
                       {"app.kubernetes.io/instance": "rel", "tandem.dev/pool": "worker"}):
            assert not any(_admits(r, labels, ns, port) for r in rules)
    assert [r["from"] for r in rules if 5557 in [p["port"] for p in r["ports"]]] == [[peer]]
    # No `from`: no rule opens them at all.
    docs = render("--set", "engine=vllm", "--set", "vllm.kvEvents.transport=tcp")
    rules = by_kind(docs, "NetworkPolicy")["rel-tandem-workers"]["spec"]["ingress"]
    assert not [r for r in rules if 5557 in [p["port"] for p in r["ports"]]]
    # A bridge of one's own elsewhere: no sidecar, and still no static list on the router.
    docs = render("--set", "engine=vllm", "--set", "vllm.kvEvents.transport=tcp",
                  "--set", "vllm.kvEvents.bridge.enabled=false")
    validate(docs)
    for sts in by_kind(docs, "StatefulSet").values():
        (vllm,) = sts["spec"]["template"]["spec"]["containers"]
        assert kv_events_config(vllm)["endpoint"] == "tcp://*:5557"
    router = (by_kind(docs, "Deployment")["rel-tandem-router"]["spec"]["template"]["spec"]
              ["containers"][0])
    assert not any(a.startswith("--worker") for a in router["args"])
    # ipc sockets without the sidecar could be read by nobody: refused.
    r = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES, "--set", "engine=vllm",
                        "--set", "vllm.kvEvents.bridge.enabled=false"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "vllm.kvEvents.transport=ipc needs" in r.stderr, r.stderr


def test_kv_tiers_pass_their_flags_and_give_the_disk_tier_a_volume_of_its_own():
    docs = render("--set", "prefill.kvTiers.hostGb=4", "--set", "prefill.kvTiers.disk.enabled=true",
                  "--set", "prefill.kvTiers.disk.gb=20", "--set",
                  "prefill.kvTiers.disk.sizeLimit=21Gi", "--set", "decode.kvTiers.hostGb=2",
                  "--set", "decode.kvTiers.disk.enabled=true",
                  "--set", "decode.kvTiers.disk.storageClassName=fast-ssd")
    validate(docs)
    deployments = by_kind(docs, "Deployment")
    prefill = deployments["rel-tandem-prefill"]["spec"]["template"]["spec"]
    args = prefill["containers"][0]["args"]
    assert {"--host-kv-gb=4", "--disk-kv-dir=/var/cache/tandem-kv", "--disk-kv-gb=20"} <= set(args)
    assert {"name": "kv-disk", "mountPath": "/var/cache/tandem-kv"} in (
        prefill["containers"][0]["volumeMounts"])
    (vol,) = [v for v in prefill["volumes"] if v["name"] == "kv-disk"]
    assert vol["emptyDir"] == {"sizeLimit": "21Gi"}
    decode = deployments["rel-tandem-decode"]["spec"]["template"]["spec"]
    (vol,) = [v for v in decode["volumes"] if v["name"] == "kv-disk"]
    claim = vol["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "fast-ssd"
    # Off by default: no flags, no volume.
    plain = by_kind(render(), "Deployment")["rel-tandem-prefill"]["spec"]["template"]["spec"]
    assert not any(a.startswith(("--host-kv", "--disk-kv")) for a in plain["containers"][0]["args"])
    assert all(v["name"] != "kv-disk" for v in plain["volumes"])


def test_workers_report_their_zone_rack_and_node_as_their_locality():
    docs = render("--set", "decode.locality.zone=us-east-1a", "--set", "decode.locality.rack=r7")
    validate(docs)
    deployments = by_kind(docs, "Deployment")
    decode = deployments["rel-tandem-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert "--locality=us-east-1a/r7/$(NODE_NAME)" in decode["args"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in (
        decode["env"])
    prefill = deployments["rel-tandem-prefill"]["spec"]["template"]["spec"]["containers"][0]
    assert "--locality=zone/rack/$(NODE_NAME)" in prefill["args"]
    off = by_kind(render("--set", "prefill.locality.enabled=false"), "Deployment")
    args = off["rel-tandem-prefill"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--locality") for a in args)
    # A zone that is not a locality level is refused at install.
    r = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES, "--set",
                        "decode.locality.zone=a/b"], capture_output=True, text=True)
    assert r.returncode != 0 and "locality" in r.stderr
