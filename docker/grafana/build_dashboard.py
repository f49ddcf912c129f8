"""Writes the Tandem Grafana dashboard (compose's and the Helm chart's copy) from the panel
list below; tests/deploy/test_monitoring.py checks every metric it queries and runs its queries
against a real Prometheus.

    python docker/grafana/build_dashboard.py

Variables: `datasource` (any Prometheus), `namespace` (Kubernetes; compose has none and "All"
matches series without the label), `router_job` (the router's scrape job: `tandem-router` in
compose, `<release>-tandem-router` under a ServiceMonitor) and `model`. Every selector carries
the namespace matcher, and the model matcher where the metric has a `model` label (elsewhere a
chosen model would empty the panel).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTS = [ROOT / "docker" / "grafana" / "dashboards" / "tandem.json",
        ROOT / "charts" / "tandem" / "dashboards" / "tandem.json"]

RATE = "[$__rate_interval]"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ROUTER = 'job=~"$router_job"'


def model_metrics() -> set[str]:
    """Series names whose metric has a `model` label (router and worker registries)."""
    sys.path.insert(0, str(ROOT))
    from prometheus_client import CollectorRegistry

    from router.metrics import RouterMetrics
    from worker.metrics import WorkerMetrics

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""],
                "summary": ["_sum", "_count"]}
    out = set()
    for make in (RouterMetrics, lambda r: WorkerMetrics(r, "decode")):
        reg = CollectorRegistry()
        make(reg)
        # Declared label names, not samples: a labelled metric has none until first used.
        for collector in set(reg._collector_to_names):
            if "model" in getattr(collector, "_labelnames", ()):
                out |= {collector._name + sfx for sfx in suffixes[collector._type]}
    return out


MODEL_METRICS = model_metrics()


def scoped(expr: str) -> str:
    """Every `tandem_*` selector in `expr` with the namespace (and model) matchers added."""
    def add(m: re.Match) -> str:
        name, inner = m.group(1), (m.group(2) or "")[1:-1]
        matchers = [x for x in (inner, 'namespace=~"$namespace"',
                                'model=~"$model"' if name in MODEL_METRICS else "") if x]
        return f"{name}{{{','.join(matchers)}}}"
    return re.sub(r"\b(tandem_[a-z0-9_]+)(\{[^}]*\})?", add, expr)


def q(expr: str, legend: str) -> dict:
    return {"expr": scoped(expr), "legendFormat": legend, "datasource": DATASOURCE}


def quantiles(metric: str, by: str = "") -> list[dict]:
    extra = f", {by}" if by else ""
    return [q(f"histogram_quantile({p}, sum by (le{extra}) (rate({metric}_bucket{RATE})))",
              f"p{int(p * 100)}")
            for p in (0.5, 0.9, 0.99)]


def variable(name: str, query: str, label: str, all_value: str | None = ".*") -> dict:
    v = {"name": name, "label": label, "type": "query", "datasource": DATASOURCE, "refresh": 2,
         "query": {"query": query, "refId": name}, "definition": query, "sort": 1,
         "includeAll": all_value is not None, "multi": all_value is not None,
         "current": {"text": "All", "value": "$__all"} if all_value is not None else {}}
    if all_value is not None:
        v["allValue"] = all_value
    return v


TEMPLATING = [
    {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
     "current": {}, "refresh": 1},
    variable("namespace", "label_values(tandem_requests_total, namespace)", "Namespace"),
    variable("router_job", "label_values(tandem_router_inflight_requests, job)", "Router job"),
    variable("model", "label_values(tandem_requests_total, model)", "Model"),
]


PANELS = [
    ("Time to first token", "s", quantiles("tandem_time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("tandem_inter_token_latency_seconds")),
    ("Prefix cache hit ratio (router)", "percentunit", [q(
        f"sum(rate(tandem_prefix_cache_hit_tokens_total{{{ROUTER}}}{RATE})) / "
        f"clamp_min(sum(rate(tandem_prompt_tokens_total{{{ROUTER}}}{RATE})), 1)", "hit ratio")]),
    ("Route plans", "reqps",
     [q(f"sum by (plan) (rate(tandem_route_decisions_total{RATE}))", "{{plan}}")]),
    ("Requests by status", "reqps",
     [q(f"sum by (status) (rate(tandem_requests_total{RATE}))", "{{status}}")]),
    ("Tokens per second", "short", [
        q(f"sum(rate(tandem_completion_tokens_total{RATE}))", "completion"),
        q(f"sum(rate(tandem_prompt_tokens_total{{{ROUTER}}}{RATE}))", "prompt")]),
    ("KV transfer bytes/s", "Bps", [q("sum by (instance, transport) "
                                      f"(rate(tandem_kv_transfer_bytes_total{RATE}))",
                                      "{{instance}} {{transport}}")]),
    ("KV transfer time", "s", quantiles("tandem_kv_transfer_seconds")),
    ("Worker queue (waiting / running)", "short", [
        q("tandem_worker_waiting_requests", "{{instance}} waiting"),
        q("tandem_worker_running_requests", "{{instance}} running")]),
    ("Worker KV cache usage", "percentunit", [q("tandem_worker_kv_usage", "{{instance}}")]),
    ("Errors and retries", "short", [
        q(f"sum by (kind) (rate(tandem_retries_total{RATE}))", "retry {{kind}}"),
        q(f"sum(rate(tandem_kv_transfer_failures_total{RATE}))", "kv transfer failures"),
        q(f"sum(rate(tandem_kv_pull_fallbacks_total{RATE}))", "local-prefill fallbacks"),
        q(f"sum(rate(tandem_load_shed_total{RATE}))", "load shed (503)")]),
    ("Router overhead", "s", quantiles("tandem_router_overhead_seconds")),
    ("Live workers and index", "short", [
        q("tandem_live_workers", "{{role}}"), q("tandem_redis_up", "redis up"),
        q("tandem_router_inflight_requests", "{{instance}} in flight")]),
    ("Worker prefill time", "s", quantiles("tandem_prefill_time_seconds", "job")[2:]),
]


def build() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "datasource": DATASOURCE,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{**t, "refId": chr(65 + j)} for j, t in enumerate(targets)],
        })
    return {"uid": "tandem", "title": "Tandem", "schemaVersion": 39, "version": 1, "editable": True,
            "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "tags": ["tandem"],
            "templating": {"list": TEMPLATING}, "panels": panels}


if __name__ == "__main__":
    for out in OUTS:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(build(), indent=2) + "\n")
        print(f"wrote {out}")
