"""`tandem up --autoscale`: the local cluster follows the router's SLO planner
(router/planner.py, docs/planner.md). Every `interval_s` it reads the planner's
`tandem_planner_desired_replicas{pool}` from the router's /metrics and starts a worker of a pool
that has fewer (the same process `tandem up` starts; it registers in Redis once ready) or drains
one of a pool that has more (SIGTERM: the worker deregisters, finishes its requests and exits),
one worker per pool a round, within the bounds given."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable

from tandem.launcher import Cluster

POOLS = ("prefill", "decode")
_SERIES = re.compile(r'^tandem_planner_desired_replicas\{([^}]*)\}\s+(\S+)$')


def desired_replicas(metrics_text: str) -> dict[str, int]:
    """Each pool's desired replicas in a router's Prometheus text (the largest over its
    models: the local cluster's workers serve one)."""
    out: dict[str, int] = {}
    for line in metrics_text.splitlines():
        m = _SERIES.match(line)
        if not m:
            continue
        pool = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).get("pool")
        if pool in POOLS:
            out[pool] = max(out.get(pool, 0), round(float(m.group(2))))
    return out


def read_router(url: str) -> Callable[[], dict[str, int]]:
    def read() -> dict[str, int]:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            return desired_replicas(r.read().decode())

    return read


class LocalAutoscaler:
    def __init__(self, cluster: Cluster, bounds: dict[str, tuple[int, int]],
                 read: Callable[[], dict[str, int]], interval_s: float = 5.0,
                 say: Callable[[str], None] = print) -> None:
        self.cluster, self.bounds, self.read = cluster, bounds, read
        self.interval_s, self.say = interval_s, say
        self._last = -float("inf")

    def tick(self) -> None:
        """One round, if `interval_s` has passed since the last (the supervisor calls it often)."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        try:
            desired = self.read()
        except OSError as e:  # the router restarting: the next round reads again
            self.say(f"[tandem] autoscale: could not read the router's metrics ({e})")
            return
        for pool in POOLS:
            if pool not in desired:
                continue  # no decision yet (no traffic routed)
            lo, hi = self.bounds[pool]
            want, have = min(max(desired[pool], lo), hi), len(self.cluster.pool(pool))
            if want > have:
                name, url = self.cluster.add_worker(pool)
                self.say(f"[tandem] autoscale: {pool} {have} -> {have + 1}: starting {name} "
                         f"at {url}")
            elif want < have:
                name = self.cluster.retire_worker(pool)
                self.say(f"[tandem] autoscale: {pool} {have} -> {have - 1}: draining {name}")
