"""A simulated cluster's workers coming and going mid-run (`python -m sim autoscale`): a worker
asked for serves `startup_s` later (model load, graph capture); one scaled down leaves the
router's live set at once (it gets no new request) and is gone once its queue, batch and the
requests routed to it are done (a drain: nothing fails). Worker-hours count every worker from
when it was asked for until it is gone: a starting or draining worker holds its GPU too."""

from __future__ import annotations

from router.worker_info import WorkerInfo
from sim.simulator import Cluster, SimWorker

POOLS = ("prefill", "decode")


class Fleet:
    def __init__(self, cluster: Cluster, startup_s: float) -> None:
        self.c = cluster
        self.startup_s = startup_s
        self.asked_at: dict[str, float] = {w.info.worker_id: 0.0 for w in cluster.workers}
        self.gone_at: dict[str, float] = {}
        self.starting: dict[str, list[str]] = {pool: [] for pool in POOLS}
        self.draining: list[SimWorker] = []
        self._seq = {pool: sum(w.info.role == pool for w in cluster.workers) for pool in POOLS}
        self.started = dict.fromkeys(POOLS, 0)  # workers asked for mid-run
        self.drained = dict.fromkeys(POOLS, 0)  # workers scaled down (drained or cancelled)

    def live(self, pool: str) -> list[SimWorker]:
        return [w for w in self.c.workers if w.info.role == pool]

    def size(self, pool: str) -> int:
        """Live and starting workers: what the pool will have once they have started."""
        return len(self.live(pool)) + len(self.starting[pool])

    def scale(self, pool: str, n: int) -> None:
        """Ask for `n` workers in `pool` (live and starting): start or drain the difference."""
        now = self.c.clock.now
        while self.size(pool) < n:
            wid = f"{pool}-{self._seq[pool]}"
            self._seq[pool] += 1
            self.asked_at[wid] = now
            self.starting[pool].append(wid)
            self.started[pool] += 1
            self.c.clock.after(self.startup_s, self._up, pool, wid)
        while self.size(pool) > n:
            self.drained[pool] += 1
            if self.starting[pool]:  # the last one asked for is the furthest from serving
                self.gone_at[self.starting[pool].pop()] = now
                continue
            live = self.live(pool)
            if pool == "decode" and len(live) <= 1:
                return  # the router needs a worker that decodes
            # The one with the least in flight drains soonest.
            w = min(live, key=lambda w: (w.info.inflight, len(w.running) + len(w.queue)))
            self.c.workers.remove(w)
            self.draining.append(w)

    def _up(self, pool: str, wid: str) -> None:
        if wid not in self.starting[pool]:
            return  # scaled down before it started
        self.starting[pool].remove(wid)
        p = self.c.profile
        info = WorkerInfo(wid, pool, f"sim://{wid}", block_size=p.block_size,
                          capacity=p.num_blocks, block_bytes=p.block_bytes)
        w = SimWorker(self.c, info)
        self.c.workers.append(w)
        self.c.by_id[wid] = w

    def reap(self) -> None:
        """The draining workers that have finished everything are gone."""
        still = []
        for w in self.draining:
            busy = (w.info.inflight or w.queue or w.prefilling or w.running or w.joining
                    or w.local)
            if busy:
                still.append(w)
            else:
                self.gone_at[w.info.worker_id] = self.c.clock.now
        self.draining = still

    def worker_seconds(self, start: float, end: float) -> dict[str, float]:
        """Each pool's workers' time within [start, end]."""
        out = dict.fromkeys(POOLS, 0.0)
        for wid, t in self.asked_at.items():
            gone = min(self.gone_at.get(wid, end), end)
            out[wid.split("-")[0]] += max(0.0, gone - max(t, start))
        return out
