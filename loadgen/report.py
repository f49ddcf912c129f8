"""Turns `RequestRecord`s and the router's counters into the JSON + Markdown report (and PNG
plots where matplotlib is installed)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadgen.runner import RequestRecord

log = logging.getLogger(__name__)


@dataclass
class SLO:
    ttft_s: float = 1.0
    itl_s: float = 0.2


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = sorted(values)

    def p(q: float) -> float:
        return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]

    return {"p50": p(0.5), "p90": p(0.9), "p99": p(0.99), "mean": sum(v) / len(v)}


def scrape(base_url: str) -> dict[str, float]:
    """The target's Prometheus samples as {series: value}, or {} when it has none. They are
    optional extras of a report (hit ratio, route plans): a target whose /metrics is missing or
    not Prometheus text (vllm-router answers "Only POST requests are supported for transparent
    proxy") costs those fields, never the run."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        resp = httpx.get(f"{root}/metrics", timeout=5)
        if resp.status_code != 200:
            return {}
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
        return out
    except (httpx.HTTPError, ValueError, TypeError) as e:
        log.warning("no Prometheus counters at %s/metrics (%s); reporting without them", root, e)
        return {}


def counter_delta(before: dict, after: dict, prefix: str) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after
            if k.startswith(prefix) and not k.endswith("_created")}


def summarize(records: list[RequestRecord], wall_s: float, slo: SLO, before: dict,
              after: dict) -> dict:
    ok = [r for r in records if r.error is None]
    itl = [x for r in ok for x in r.itl_s]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo.ttft_s
            and (not r.itl_s or max(r.itl_s) <= slo.itl_s)]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    hits = sum(counter_delta(before, after, "tandem_prefix_cache_hit_tokens_total").values())
    prompt = sum(counter_delta(before, after, "tandem_prompt_tokens_total").values())
    plans: dict[str, float] = {}  # summed over models
    for k, v in counter_delta(before, after, "tandem_route_decisions_total").items():
        if v:
            plan = k.split('plan="')[1].split('"')[0]
            plans[plan] = plans.get(plan, 0.0) + v
    return {
        "requests": len(records), "ok": len(ok), "errors": errors, "wall_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        # First token as the router saw it (the client's TTFT waits for the first visible text).
        "server_ttft_s": percentiles([r.server_ttft_s for r in ok if r.server_ttft_s is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "goodput_requests_per_s": len(good) / wall_s if wall_s else 0.0,
        "goodput_fraction": len(good) / len(records) if records else 0.0,
        "prefix_hit_ratio": hits / prompt if prompt else None, "route_plans": plans,
    }


def markdown(summary: dict, title: str) -> str:
    def ms(d: dict, k: str) -> str:
        return "–" if d[k] is None else f"{d[k] * 1e3:.1f}"

    lines = [f"## {title}", "",
             f"{summary['ok']}/{summary['requests']} requests ok in {summary['wall_s']:.1f} s; "
             f"{summary['request_throughput']:.2f} req/s, {summary['output_tokens_per_s']:.1f} "
             f"output tokens/s; goodput {summary['goodput_requests_per_s']:.2f} req/s "
             f"({summary['goodput_fraction']:.0%} within TTFT ≤ {summary['slo']['ttft_s']} s and "
             f"ITL ≤ {summary['slo']['itl_s']} s)", "",
             "| ms | p50 | p90 | p99 |", "|---|---|---|---|"]
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "end to end")):
        d = summary[key]
        lines.append(f"| {label} | {ms(d, 'p50')} | {ms(d, 'p90')} | {ms(d, 'p99')} |")
    hr = summary["prefix_hit_ratio"]
    lines += ["", f"Prefix hit ratio: {'–' if hr is None else f'{hr:.3f}'}; plans: "
              f"{summary['route_plans'] or '–'}; errors: {summary['errors'] or 'none'}"]
    return "\n".join(lines) + "\n"


def _pyplot():
    """matplotlib's pyplot on the file-only backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, title: str, out: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot(records: list[RequestRecord], out: Path, title: str) -> Path | None:
    if (plt := _pyplot()) is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ok = [r for r in records if r.error is None]
    series = {"TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
              "ITL": [x for r in ok for x in r.itl_s],
              "end to end": [r.e2e_s for r in ok if r.e2e_s is not None]}
    for ax, (name, vals) in zip(axes, series.items(), strict=True):
        vals = sorted(v * 1e3 for v in vals)
        if vals:
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    return _save(plt, fig, title, out)


def plot_rates(rows: list[dict], out: Path, title: str) -> Path | None:
    """Throughput and goodput, and TTFT p50/p99, against the offered rate of a rate sweep."""
    if (plt := _pyplot()) is None:
        return None
    rates = [r["rate"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(rates, [r["request_throughput"] for r in rows], marker="o", label="completed")
    left.plot(rates, [r["goodput_requests_per_s"] for r in rows], marker="o",
              label="within SLO (goodput)")
    left.set_xlabel("offered load (sessions/s)")
    left.set_ylabel("requests/s")
    left.legend()
    for q in ("p50", "p99"):
        right.plot(rates, [(r["ttft_s"][q] or 0) * 1e3 for r in rows], marker="o",
                   label=f"TTFT {q}")
    right.set_xlabel("offered load (sessions/s)")
    right.set_ylabel("ms")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return _save(plt, fig, title, out)


def write(summary: dict, records: list[RequestRecord], out_dir: Path, name: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md"}
    paths["json"].write_text(json.dumps(summary, indent=2) + "\n")
    paths["md"].write_text(markdown(summary, name))
    png = plot(records, out_dir / f"{name}.png", name)
    if png:
        paths["png"] = png
    return paths
