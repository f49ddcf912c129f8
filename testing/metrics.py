"""Reading a service's Prometheus metrics in tests."""

from __future__ import annotations

import re

import httpx


def scrape(client: httpx.Client) -> dict[str, float]:
    """A service's /metrics as {series: value}."""
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def series_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s series whose labels include `labels` (others, like `model`, free)."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'([a-zA-Z_]+)="([^"]*)"', rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total
