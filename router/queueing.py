"""The queueing model the SLO planner sizes pools with (router/planner.py): prompts waiting for
a prefill worker as M/M/n (Erlang C), and the streams on a decode worker as Poisson."""

from __future__ import annotations

import math


def erlang_c(n: int, offered: float) -> float:
    """The probability that a request waits in M/M/n with `offered` erlangs (1.0 when n cannot
    carry it)."""
    if offered <= 0:
        return 0.0
    if n <= offered:
        return 1.0
    b = 1.0  # Erlang B, by its recurrence
    for k in range(1, n + 1):
        b = offered * b / (k + offered * b)
    rho = offered / n
    return b / (1 - rho + rho * b)


def prefill_replicas(prompts_per_s: float, service_s: float, slo_s: float, quantile: float,
                     max_utilization: float, limit: int = 4096) -> int:
    """The fewest prefill workers for which `quantile` of prompts (each `service_s` of work)
    start within `slo_s - service_s`: P(wait > t) = C(n, a) exp(-(n - a) t / service_s)."""
    offered = prompts_per_s * service_s
    if offered <= 0:
        return 0
    n = max(1, math.ceil(offered / max_utilization))
    slack = slo_s - service_s
    if slack <= 0:  # one prompt alone outlasts the SLO: capacity is all that helps
        return n
    while n < limit and (erlang_c(n, offered) * math.exp(-(n - offered) * slack / service_s)
                         > 1 - quantile):
        n += 1
    return n


def target_batch(max_batch: float, z: float) -> float:
    """The mean batch whose `z`-quantile, the streams on a worker counted as Poisson, is
    `max_batch`: b + z * sqrt(b) = max_batch (at least 1)."""
    root = (-z + math.sqrt(z * z + 4 * max_batch)) / 2
    return max(root * root, 1.0)
