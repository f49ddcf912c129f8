"""The scaling policies `python -m sim autoscale` compares, and what they read of a simulated
cluster: `RouterView` measures what a router measures (router/planner_loop.py reads the same
from its metrics and worker directory).

- `static`: a fixed fleet (static_peak, static_mean);
- `queue_depth`: Kubernetes' HPA algorithm (as KEDA drives it) on each pool's requests in
  flight per replica: desired = ceil(total / target) outside a 10% tolerance, up at once (by at
  most max(100%, 4 pods) a period), down to the highest recommendation of the last 300 s;
- `planner`: the router's SLO planner (router/planner.py), its real code.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

from router.planner import Planner
from router.planner_inputs import Measurements, stream_batch, streamed_tokens_per_s
from sim.fleet import POOLS
from sim.simulator import Cluster, SimRequest


class RouterView:
    """What a router measures of the cluster: the prompts it routed (uncached tokens after the
    prefix index), the tokens it streamed back, the workers' loads and measured rates, and the
    inter-token latency against the decode batch."""

    def __init__(self, cluster: Cluster, requests: list[SimRequest]) -> None:
        self.c, self.requests = cluster, requests
        self._next = 0  # the first request not yet seen routed
        self._open: list[SimRequest] = []  # routed, not done
        self._last = 0.0
        self._batches: list[float] = []  # the decode batch of a stream, sampled each second
        self._streams: list[int] = []  # the streams decoding, sampled each second
        self._seen: dict[int, int] = {}  # tokens of each open request already counted
        self.completed = 0
        self.measurements: Measurements | None = None
        self.step: tuple[float, float] | None = None

    def live(self, pool: str) -> list:
        return [w.info for w in self.c.workers if w.info.role == pool]

    def sample(self) -> None:
        decode = self.live("decode")
        self._batches.append(stream_batch(decode))
        self._streams.append(sum(int(w.load.get("running", 0)) for w in decode))

    def queue(self, pool: str) -> int:
        """Requests in flight on the pool's live workers (KEDA's queue metric)."""
        if pool == "prefill":
            return sum(w.inflight for w in self.live("prefill"))
        return sum(int(w.load.get("running", 0)) + int(w.load.get("waiting", 0))
                   for w in self.live("decode"))

    def update(self, now: float) -> None:
        """This tick's `measurements`, and `step`: a (mean batch, mean inter-token latency)
        observation of the requests finished since the last tick (None without any)."""
        dt = max(now - self._last, 1e-9)
        self._last = now
        bs = self.c.profile.block_size
        uncached = prompts = 0
        while self._next < len(self.requests) and self.requests[self._next].plan:
            r = self.requests[self._next]
            uncached += r.num_prompt_tokens - r.planned_cached_blocks * bs
            prompts += 1
            self._open.append(r)
            self._next += 1
        # As the router counts them: the gaps between tokens streamed since the last tick (its
        # inter-token latency histogram's sum and count), a request's tokens once it is done.
        out_tokens, gaps_s, gaps, still = 0, 0.0, 0, []
        for r in self._open:
            times, k = r.token_times, max(self._seen.get(r.request_id, 0), 1)
            if len(times) > k:
                gaps_s += times[-1] - times[k - 1]
                gaps += len(times) - k
            if r.done_at is None:
                self._seen[r.request_id] = len(times)
                still.append(r)
                continue
            self._seen.pop(r.request_id, None)
            self.completed += 1
            out_tokens += len(times)
        self._open = still
        step = None
        batch = sum(self._batches) / len(self._batches) if self._batches else 0.0
        streams = sum(self._streams) / len(self._streams) if self._streams else 0.0
        self._batches, self._streams = [], []
        if gaps and batch > 0:
            step = (batch, gaps_s / gaps)
        prefill, decode = self.live("prefill"), self.live("decode")
        rates = [w.prefill_tokens_per_s for w in prefill if w.prefill_tokens_per_s]
        self.step = step
        self.measurements = Measurements(
            now, uncached / dt, prompts / dt,
            streamed_tokens_per_s(streams, gaps_s, gaps, out_tokens / dt),
            streams_decoding=streams,
            prefill_queued_tokens=sum(w.queued_tokens() for w in prefill),
            prefill_tokens_per_s=max(rates) if rates else None,
            num_prefill=len(prefill), num_decode=len(decode))


class ScalingPolicy(Protocol):
    name: str
    interval_s: float

    def decide(self, now: float, view: RouterView, sizes: dict[str, int]) -> dict[str, int]:
        """Each pool's desired replicas, given what the fleet has now (live and starting)."""
        ...


class Static:
    def __init__(self, name: str, sizes: dict[str, int]) -> None:
        self.name, self.sizes, self.interval_s = name, dict(sizes), 60.0

    def decide(self, now: float, view: RouterView, sizes: dict[str, int]) -> dict[str, int]:
        return dict(self.sizes)


class QueueDepth:
    """HPA on requests in flight per replica (`targets` per pool), bounded by `bounds`."""

    name = "queue_depth"

    def __init__(self, targets: dict[str, float], bounds: dict[str, tuple[int, int]],
                 interval_s: float = 15.0, tolerance: float = 0.1,
                 down_window_s: float = 300.0) -> None:
        self.targets, self.bounds = targets, bounds
        self.interval_s, self.tolerance, self.down_window_s = interval_s, tolerance, down_window_s
        self._history = {pool: deque() for pool in POOLS}  # (time, recommendation)

    def decide(self, now: float, view: RouterView, sizes: dict[str, int]) -> dict[str, int]:
        out = {}
        for pool in POOLS:
            current, live = sizes[pool], len(view.live(pool))
            total = view.queue(pool)
            ratio = total / (self.targets[pool] * max(live, 1))
            want = current if abs(ratio - 1) <= self.tolerance else math.ceil(
                total / self.targets[pool])
            want = min(want, current + max(current, 4))  # HPA's default scale-up policy
            history = self._history[pool]
            history.append((now, want))
            while history[0][0] < now - self.down_window_s:
                history.popleft()
            if want < current:  # down: to the highest recommendation in the window
                want = min(current, max(w for _, w in history))
            lo, hi = self.bounds[pool]
            out[pool] = min(max(want, lo), hi)
        return out


class PlannerPolicy:
    """The SLO planner on what the router measures."""

    name = "planner"

    def __init__(self, planner: Planner, interval_s: float = 10.0) -> None:
        self.planner, self.interval_s = planner, interval_s
        # (time, {pool: (needed at the forecast, needed at the load measured then)})
        self.history: list[tuple[float, dict[str, tuple[float, float]]]] = []

    def decide(self, now: float, view: RouterView, sizes: dict[str, int]) -> dict[str, int]:
        if view.step is not None:
            self.planner.observe_step(*view.step)
        d = self.planner.update(view.measurements)
        for w in view.live("decode"):  # as router/planner_loop.py: kv_aware prices on it
            w.decode_step = d.decode_step
        self.history.append((now, {pool: (d.pool(pool).needed, d.pool(pool).needed_now)
                                   for pool in POOLS}))
        return {"prefill": d.prefill.desired, "decode": d.decode.desired}
