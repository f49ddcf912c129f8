"""A simulated worker: its prefill queue (prefill role), its continuous batch (decode role; a
local prefill folded into the next step), and, with KV tiers, the reload of the blocks it holds
on the host or on disk before the prefill of the rest (engine/kv_tiers.py does it at admission),
after which they are device blocks again."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from router.tiered_match import MatchByMedium
from router.worker_info import WorkerInfo
from sim.fleet_cache import FleetCache
from sim.host import Clock, Host, Thread
from sim.profile import CostProfile
from sim.request import SimRequest


def _nothing() -> None:
    pass


class Fleet(Protocol):
    """What a worker uses of the cluster it is part of (sim/simulator.py `Cluster`)."""

    profile: CostProfile
    clock: Clock
    host: Host | None
    index: FleetCache

    def compute(self, work_s: float, fn: Callable, *args, thread: Thread | None = None) -> None:
        ...

    def deliver(self, num_tokens: int, fn: Callable = _nothing, *args) -> None: ...

    def continue_hashes(self, hashes: list[int], token_ids: list[int]) -> list[int]: ...


class SimWorker:
    def __init__(self, cluster: Fleet, info: WorkerInfo) -> None:
        self.c, self.info = cluster, info
        self.p = cluster.profile
        self.queue: deque = deque()  # prefill jobs: (request, on_prefilled)
        self.prefilling = False
        self.running: list[SimRequest] = []
        self.joining: list[SimRequest] = []  # imported or locally prefilled, for the next step
        self.local: list[SimRequest] = []  # local prefills folded into the next step
        self.stepping = False
        # its process, on a shared host
        self.thread = Thread(cluster.host) if cluster.host else None
        # What a worker with tiers reports in its load, as a real one measures it (the profile's).
        self._reload_rates = {m: self.p.reload_tokens_per_s(m) for m, _ in cluster.index.lower}
        self._offload_debt_s = 0.0  # offload work not yet charged to a step (0 off the step)
        self._stored = 0  # record() calls so far
        # (running, queued, stored) when the last step published, and that report
        self._stepped_as: tuple | None = None
        self._stepped_load: dict | None = None

    # -- what the heartbeat would publish --------------------------------------------------
    def publish(self) -> None:
        self.info.load = {"running": len(self.running) + len(self.joining),
                          "waiting": len(self.queue) + len(self.local),
                          "waiting_tokens": sum(r.num_prompt_tokens for r, _ in self.queue)
                          + sum(r.num_prompt_tokens for r in self.local)}
        if self._reload_rates:
            self.info.load["reload_tokens_per_s"] = dict(self._reload_rates)
        # Its cache headroom: every block it holds is evictable here (a device without bound
        # reports 2^40 blocks: never full, and still the emptier of two ties).
        capacity = self.c.index.capacity if self.c.index.capacity is not None else 1 << 40
        held = min(self.c.index.num_blocks(self.info.worker_id), capacity)
        self.info.load.update(num_blocks=capacity, free_blocks=capacity, evictable_blocks=held)

    def cached(self, hashes: list[int]) -> MatchByMedium:
        """The prompt's leading blocks this worker holds, by tier."""
        return self.c.index.held(self.info.worker_id, hashes)

    def cached_blocks(self, hashes: list[int]) -> int:
        return self.cached(hashes).total

    def record(self, hashes: list[int]) -> None:
        """These blocks are on the device now (computed, reloaded or imported)."""
        self._stored += 1
        offloaded = self.c.index.record(self.info.worker_id, hashes)
        self._offload_debt_s += offloaded * self.p.offload_s_per_block

    def _offload_s(self) -> float:
        debt, self._offload_debt_s = self._offload_debt_s, 0.0
        return debt

    def _hit(self, req: SimRequest) -> int:
        """Looks up `req`'s prompt here: its held blocks by tier and their reload time go on
        `req`; returns its uncached prompt tokens."""
        held = self.cached(req.hashes)
        req.cached_media = held
        req.num_cached_tokens = held.total * self.p.block_size
        req.reload_s = self.p.reload_s(held.host, held.disk)
        return req.num_prompt_tokens - req.num_cached_tokens

    # -- prefill role ------------------------------------------------------------------------
    def submit_prefill(self, req: SimRequest,
                       on_prefilled: Callable[[SimRequest, int], None]) -> None:
        self.queue.append((req, on_prefilled))
        self.publish()
        if not self.prefilling:
            self._next_prefill()

    def _next_prefill(self) -> None:
        if not self.queue:
            self.prefilling = False
            self.publish()
            return
        self.prefilling = True
        req, on_prefilled = self.queue.popleft()
        uncached = self._hit(req)
        self.publish()
        # the reload of its lower tiers' blocks, then the prefill of the rest
        work_s = req.reload_s + self._offload_s() + self.p.prefill_s(uncached)
        self.c.compute(work_s, self._prefilled, req, on_prefilled, thread=self.thread)

    def _prefilled(self, req: SimRequest, on_prefilled) -> None:
        self.record(req.hashes)
        on_prefilled(req, req.num_cached_tokens)
        if self.thread is not None:  # its own work once it has answered (lease, pull, release)
            self.c.compute(self.p.prefill_io_cpu_s, _nothing, thread=self.thread)
        self._next_prefill()

    # -- decode role -------------------------------------------------------------------------
    def join(self, req: SimRequest) -> None:
        """An imported request (its first token already sent) joins at the next step."""
        self.joining.append(req)
        self._kick()

    def prefill_locally(self, req: SimRequest) -> None:
        self._hit(req)
        self.local.append(req)
        self._kick()

    def _kick(self) -> None:
        self.publish()
        if not self.stepping:
            self.stepping = True
            self.c.clock.after(0.0, self._step)

    def _step(self) -> None:
        self.running += self.joining
        self.joining = []
        local, self.local = self.local, []
        if not self.running and not local:
            self.stepping = False
            self.publish()
            return
        dt = self.p.decode_step_s(len(self.running)) if self.running else 0.0
        dt += sum(r.reload_s
                  + self.p.prefill_s(r.num_prompt_tokens - r.num_cached_tokens, local=True)
                  for r in local)
        dt += self._offload_s()
        # (a step like the last one, nothing stored since: the same report, not made again)
        state = (len(self.running), len(self.queue), self._stored)
        if local or state != self._stepped_as or self.info.load is not self._stepped_load:
            self.publish()
            self._stepped_as, self._stepped_load = state, self.info.load
        self.c.compute(dt, self._stepped, local, thread=self.thread)

    def _stepped(self, local: list[SimRequest]) -> None:
        now = self.c.clock.now
        still, finished = [], []
        for r in self.running:
            r.token_times.append(now)
            (finished if len(r.token_times) >= len(r.answer) else still).append(r)
        for r in local:  # the step that prefilled it also sampled its first token
            self.record(r.hashes)
            r.first_token_at = now + self.p.router_hop_s
            r.token_times.append(now)
            (finished if len(r.answer) <= 1 else still).append(r)
        self.running = still
        hop = self.p.router_hop_s
        for r in finished:
            # The decode side caches the whole sequence's full blocks: the next turn's prefix.
            r.sequence_hashes = self.c.continue_hashes(r.hashes, r.prompt + r.answer,
                                                       r.prompt_start)
            self.record(r.sequence_hashes)
            self.info.inflight -= 1
            self.c.clock.after(hop, self.c.deliver, 1, self._done, r)
            # its own work for the request besides the steps, before the next
            if self.thread is not None:
                self.c.compute(self.p.decode_io_cpu_s, _nothing, thread=self.thread)
        if still and self.c.host is not None:  # (without a shared host, relaying costs nothing)
            self.c.clock.after(hop, self.c.deliver, len(still))
        self._step()

    def _done(self, r: SimRequest) -> None:
        r.done_at = self.c.clock.now
        if r.on_done:
            r.on_done(r)
