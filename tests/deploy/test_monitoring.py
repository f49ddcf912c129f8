"""Dashboards, alerts and the compose file agree with the code; the compose topology, run as
processes, is scraped by a real Prometheus that answers the dashboard's hit-ratio query."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from testing.cluster import Router, Worker
from testing.processes import free_port
from tests.deploy.tools import ROOT, find

DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "tandem.json"
NAME = re.compile(r"\btandem_[a-z0-9_]+")


def exported_series() -> set[str]:
    """Every series name the router, workers and KV transfer layer can export."""
    from kv_transfer.metrics import TransferMetrics
    from router.metrics import RouterMetrics
    from worker.metrics import WorkerMetrics

    reg = CollectorRegistry()
    RouterMetrics(reg)
    reg2 = CollectorRegistry()  # the workers' names overlap the router's (prompt tokens, ...)
    WorkerMetrics(reg2, "decode")
    TransferMetrics(reg2)
    names = set()
    for r in (reg, reg2):
        for fam in r.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                        "gauge": [""], "summary": ["_sum", "_count"]}[fam.type]
            names |= {fam.name + s for s in suffixes}
    return names


def dashboard_variables() -> dict[str, str]:
    """The dashboard's query variables: name -> `label_values(metric, label)`."""
    dash = json.loads(DASHBOARD.read_text())
    return {v["name"]: v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"}


def variable_values(api: httpx.Client) -> dict[str, list[str]]:
    """What Grafana offers for each variable, asked of Prometheus as Grafana asks it."""
    out = {}
    for name, definition in dashboard_variables().items():
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", definition).groups()
        r = api.get(f"/api/v1/label/{label}/values", params={"match[]": metric})
        out[name] = r.json()["data"]
    return out


def substitute(expr: str, values: dict[str, list[str]]) -> str:
    """`expr` as Grafana sends it: each variable as the regex of its values ("All" if none)."""
    for name, vals in values.items():
        expr = expr.replace(f"${name}", "|".join(vals) if vals else ".*")
    return expr.replace("$__rate_interval", "1m")


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_every_metric_the_dashboard_queries_is_exported():
    exported = exported_series()
    used = {n for e in dashboard_exprs() for n in NAME.findall(e)}
    assert len(used) >= 15
    assert used <= exported, f"not exported: {sorted(used - exported)}"


def test_every_metric_the_alerts_use_is_exported():
    rules = yaml.safe_load((DOCKER / "prometheus" / "alerts.yml").read_text())
    used = {n for g in rules["groups"] for r in g["rules"] for n in NAME.findall(r["expr"])}
    assert used and used <= exported_series(), sorted(used - exported_series())


def test_dashboard_copies_are_generated_and_identical():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboard",
                                                  DOCKER / "grafana" / "build_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    want = json.dumps(mod.build(), indent=2) + "\n"
    for out in mod.OUTS:
        assert out.read_text() == want, (
            f"{out} is stale: run python docker/grafana/build_dashboard.py")


def test_compose_services_run_commands_our_cli_accepts():
    from tandem.cli import build_parser

    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "router", "prefill-1", "prefill-2", "decode-1", "decode-2", "prometheus",
            "grafana"} <= set(services)
    roles = []
    for name, svc in services.items():
        # GPU ones: test_images
        if name.startswith(("prefill", "decode")) and not svc.get("profiles"):
            args = build_parser().parse_args(svc["command"])
            roles.append(args.command)
            assert args.advertise_host == name and args.redis_url == "redis://redis:6379/0"
            assert svc["build"]["target"] == "worker"
    assert sorted(roles) == ["decode", "decode", "prefill", "prefill"]
    router = build_parser().parse_args(["router", *services["router"]["command"]])
    assert (router.redis_url == "redis://redis:6379/0"
            and services["router"]["build"]["target"] == "router")
    # Prometheus scrapes every Tandem service of the compose file.
    prom = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert targets == {"router", "prefill-1", "prefill-2", "decode-1", "decode-2"}


def test_dockerfile_copies_every_package():
    text = (DOCKER / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"include = \[(.*?)\]", pyproject).group(1)
    for pkg in re.findall(r'"(\w+)\*"', packages):
        assert f"COPY {pkg} {pkg}" in text, pkg
    assert "USER tandem" in text and text.count("HEALTHCHECK") == 2


PROMTOOL = find("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool (Debian package `prometheus`)")
def test_prometheus_config_and_alert_rules_pass_promtool(tmp_path):
    rules = tmp_path / "alerts.yml"
    rules.write_text((DOCKER / "prometheus" / "alerts.yml").read_text())
    cfg = (DOCKER / "prometheus" / "prometheus.yml").read_text().replace(
        "/etc/prometheus/alerts.yml", str(rules))
    (tmp_path / "prometheus.yml").write_text(cfg)
    r = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "7 rules found" in r.stdout


PROMETHEUS = find("prometheus")


@pytest.mark.redis
@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian package `prometheus`)")
def test_real_prometheus_scrapes_the_processes_and_answers_the_hit_ratio(tiny_folder, tmp_path):
    ns = f"prom-{uuid.uuid4().hex[:6]}"
    workers = [Worker("prefill", str(tiny_folder), cache_dir=tmp_path, namespace=ns),
               Worker("prefill", str(tiny_folder), cache_dir=tmp_path, namespace=ns),
               Worker("decode", str(tiny_folder), cache_dir=tmp_path, namespace=ns)]
    router = Router(tiny_folder, ns, cache_dir=tmp_path)
    port = free_port()
    # Job names as a ServiceMonitor gives them under Helm (one per Service: <release>-tandem-<x>),
    # not compose's: the dashboard must find the router's job through its variable.
    cfg = {"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "rel-tandem-router",
         "static_configs": [{"targets": [f"127.0.0.1:{router.port}"]}]},
        {"job_name": "rel-tandem-prefill",
         "static_configs": [{"targets": [f"127.0.0.1:{w.port}" for w in workers[:2]]}]},
        {"job_name": "rel-tandem-decode",
         "static_configs": [{"targets": [f"127.0.0.1:{workers[2].port}"]}]}]}
    (tmp_path / "prom.yml").write_text(yaml.safe_dump(cfg))
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prom.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=open(tmp_path / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    try:
        router.wait_workers(3)
        msgs = [{"role": "system", "content": "You are a careful assistant who answers briefly."}]
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)
        hit = next(e for e in dashboard_exprs() if "tandem_prefix_cache_hit_tokens_total" in e)
        query = None
        deadline, value, up = time.monotonic() + 90, None, None
        turn = 0
        while time.monotonic() < deadline:
            # A multi-turn conversation (each turn resends the history) until Prometheus sees hits.
            msgs.append({"role": "user", "content": f"Question number {turn}: tell me more."})
            r = router.client.post("/v1/chat/completions", json={
                "model": "tiny-random", "messages": msgs[-9:], "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            msgs.append({"role": "assistant",
                         "content": r.json()["choices"][0]["message"]["content"]})
            turn += 1
            try:
                up = api.get("/api/v1/query", params={"query": "sum(up)"}).json()["data"]["result"]
                values = variable_values(api)
                query = substitute(hit, values)
                res = api.get("/api/v1/query", params={"query": query}).json()["data"]["result"]
                if (values["router_job"] and res and up and float(up[0]["value"][1]) == 4
                        and float(res[0]["value"][1]) > 0):
                    value = float(res[0]["value"][1])
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass  # Prometheus still starting: it answers 503 "Service Unavailable", not JSON
            time.sleep(0.5)
        assert value is not None, f"no hit ratio from Prometheus (up={up})"
        assert 0 < value < 1  # later turns hit the earlier turns' blocks; the first turn cannot
        workers_up = api.get("/api/v1/query",
                             params={"query": 'count(tandem_worker_kv_usage)'}).json()
        assert float(workers_up["data"]["result"][0]["value"][1]) == 3
        values = variable_values(api)
        assert values["router_job"] == ["rel-tandem-router"] and values["model"] == ["tiny-random"]
        # Every panel's query is valid PromQL with the variables as Grafana fills them, for "All"
        # and for the one model; the panels of what this traffic produced show data (retries,
        # failures and the like may have no series yet).
        produced = ("tandem_time_to_first_token_seconds", "tandem_requests_total",
                    "tandem_route_decisions_total", "tandem_prefix_cache_hit_tokens_total",
                    "tandem_worker_kv_usage", "tandem_live_workers")
        for model in (".*", "tiny-random"):
            for expr in dashboard_exprs():
                r = api.get("/api/v1/query",
                            params={"query": substitute(expr, {**values, "model": [model]})})
                assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
                if any(name in expr for name in produced):
                    assert r.json()["data"]["result"], (model, expr)
    finally:
        prom.terminate()
        prom.wait(10)
        router.close()
        for w in workers:
            w.close()
