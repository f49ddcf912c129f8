"""Writes the Tandem Grafana dashboard (compose's and the Helm chart's copy) from the panel
list below; tests/test_deploy.py checks every metric it queries.

    python docker/grafana/build_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTS = [ROOT / "docker" / "grafana" / "dashboards" / "tandem.json", ROOT / "charts" / "tandem" / "dashboards" / "tandem.json"]

RATE = "[$__rate_interval]"


def q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend, "datasource": {"type": "prometheus", "uid": "prometheus"}}


def quantiles(metric: str, by: str = "") -> list[dict]:
    extra = f", {by}" if by else ""
    return [q(f"histogram_quantile({p}, sum by (le{extra}) (rate({metric}_bucket{RATE})))", f"p{int(p * 100)}")
            for p in (0.5, 0.9, 0.99)]


PANELS = [
    ("Time to first token", "s", quantiles("tandem_time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("tandem_inter_token_latency_seconds")),
    ("Prefix cache hit ratio (router)", "percentunit", [q(
        f"sum(rate(tandem_prefix_cache_hit_tokens_total{{job=\"tandem-router\"}}{RATE})) / "
        f"clamp_min(sum(rate(tandem_prompt_tokens_total{{job=\"tandem-router\"}}{RATE})), 1)", "hit ratio")]),
    ("Route plans", "reqps", [q(f"sum by (plan) (rate(tandem_route_decisions_total{RATE}))", "{{plan}}")]),
    ("Requests by status", "reqps", [q(f"sum by (status) (rate(tandem_requests_total{RATE}))", "{{status}}")]),
    ("Tokens per second", "short", [
        q(f"sum(rate(tandem_completion_tokens_total{RATE}))", "completion"),
        q(f"sum(rate(tandem_prompt_tokens_total{{job=\"tandem-router\"}}{RATE}))", "prompt")]),
    ("KV transfer bytes/s", "Bps", [q(f"sum by (instance, transport) (rate(tandem_kv_transfer_bytes_total{RATE}))",
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
            "datasource": {"type": "prometheus", "uid": "prometheus"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{**t, "refId": chr(65 + j)} for j, t in enumerate(targets)],
        })
    return {"uid": "tandem", "title": "Tandem", "schemaVersion": 39, "version": 1, "editable": True,
            "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "tags": ["tandem"],
            "templating": {"list": []}, "panels": panels}


if __name__ == "__main__":
    for out in OUTS:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(build(), indent=2) + "\n")
        print(f"wrote {out}")
