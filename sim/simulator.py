"""A discrete-event simulation of a Tandem cluster that drives the router's real code: block
hashing (common/hashing.py), the prefix index (the router's replica, router/replica.py, with
each worker's capacity: sim/fleet_cache.py), the routing step (router/gateway.py's
`plan_for` over the same policies and `WorkerInfo`) and the dispatcher's rate and bandwidth learning
(router/dispatch.py). Only the workers and the link are simulated, at the costs of a
`CostProfile`:

- a prefill worker serves its queue one prefill at a time (uncached tokens at its rate);
- a decode worker runs continuous batching: one step (time grows with the batch) gives every
  running request a token; a local prefill (decode_local, colocated) is folded into the next
  step, stalling that step for every running stream, which is the interference disaggregation
  avoids;
- a disaggregated request's first token reaches the client when its prefill returns; its KV
  (the blocks the decode worker lacks) crosses the link; then it joins the decode batch;
- with `host_cores` set (one small machine), every process is a `Thread` on one
  processor-sharing `Host` (n jobs on c cores each run at min(1, c / n) of full speed): each
  worker (its prefills or decode steps and its own I/O, in order: one Python process), the
  router (routing, hops, relaying tokens) and the load generator (reading tokens; a session's
  next turn waits for it to read the last one).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.hashing import BlockHasher
from common.protocol import RequestTiming
from router.dispatch import learn_bandwidth, learn_prefill_rate
from router.policy import make_policy, plan_for
from router.settings import RouterSettings
from router.worker_info import WorkerInfo
from sim.fleet_cache import FleetCache
from sim.host import Clock, Host, Thread
from sim.profile import CostProfile


@dataclass
class SimRequest:
    request_id: int
    prompt: list[int]
    answer: list[int]  # the tokens it will generate (drawn up front: sampling is not simulated)
    arrival: float
    on_done: Callable[[SimRequest], None] | None = None
    plan: str = ""
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    done_at: float | None = None
    hashes: list[int] = field(default_factory=list)


def _nothing() -> None:
    pass


class SimWorker:
    def __init__(self, cluster: Cluster, info: WorkerInfo) -> None:
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

    # -- what the heartbeat would publish --------------------------------------------------
    def publish(self) -> None:
        self.info.load = {"running": len(self.running) + len(self.joining),
                          "waiting": len(self.queue) + len(self.local),
                          "waiting_tokens": sum(len(r.prompt) for r, _ in self.queue)
                          + sum(len(r.prompt) for r in self.local)}

    def cached_blocks(self, hashes: list[int]) -> int:
        return self.c.index.match(hashes, [self.info.worker_id], "exact")[self.info.worker_id]

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
        cached = self.cached_blocks(req.hashes)
        uncached = len(req.prompt) - cached * self.p.block_size
        self.publish()
        self.c.compute(self.p.prefill_s(uncached), self._prefilled, req, cached, on_prefilled,
                       thread=self.thread)

    def _prefilled(self, req: SimRequest, cached: int, on_prefilled) -> None:
        self.c.index.record(self.info.worker_id, req.hashes)
        on_prefilled(req, cached * self.p.block_size)
        if self.thread is not None:  # its own work once it has answered (lease, pull, release)
            self.c.compute(self.p.prefill_io_cpu_s, _nothing, thread=self.thread)
        self._next_prefill()

    # -- decode role -------------------------------------------------------------------------
    def join(self, req: SimRequest) -> None:
        """An imported request (its first token already sent) joins at the next step."""
        self.joining.append(req)
        self._kick()

    def prefill_locally(self, req: SimRequest) -> None:
        req.num_cached_tokens = self.cached_blocks(req.hashes) * self.p.block_size
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
        dt += sum(self.p.prefill_s(len(r.prompt) - r.num_cached_tokens, local=True) for r in local)
        self.publish()
        self.c.compute(dt, self._stepped, local, thread=self.thread)

    def _stepped(self, local: list[SimRequest]) -> None:
        now = self.c.clock.now
        still, finished = [], []
        for r in self.running:
            r.token_times.append(now)
            (finished if len(r.token_times) >= len(r.answer) else still).append(r)
        for r in local:  # the step that prefilled it also sampled its first token
            self.c.index.record(self.info.worker_id, r.hashes)
            r.first_token_at = now + self.p.router_hop_s
            r.token_times.append(now)
            (finished if len(r.answer) <= 1 else still).append(r)
        self.running = still
        hop = self.p.router_hop_s
        for r in finished:
            # The decode side caches the whole sequence's full blocks: the next turn's prefix.
            self.c.index.record(self.info.worker_id, self.c.hasher(r.prompt + r.answer))
            self.info.inflight -= 1
            self.c.clock.after(hop, self.c.deliver, 1, self._done, r)
            # its own work for the request besides the steps, before the next
            if self.thread is not None:
                self.c.compute(self.p.decode_io_cpu_s, _nothing, thread=self.thread)
        if still:
            self.c.clock.after(hop, self.c.deliver, len(still))
        self._step()

    def _done(self, r: SimRequest) -> None:
        r.done_at = self.c.clock.now
        if r.on_done:
            r.on_done(r)


class Cluster:
    """`num_prefill` + `num_decode` (+ `num_colocated`) simulated workers behind the real policy."""

    def __init__(self, profile: CostProfile, num_prefill: int, num_decode: int,
                 policy: str = "kv_aware", num_colocated: int = 0,
                 settings: RouterSettings | None = None) -> None:
        self.profile = profile
        self.clock = Clock()
        self.settings = settings or RouterSettings(block_size=profile.block_size,
                                                   bytes_per_block=profile.block_bytes,
                                                   policy_seed=0)
        self.policy = make_policy(policy, self.settings)
        self.hasher = BlockHasher("sim", profile.block_size, None)
        self.index = FleetCache(profile.num_blocks)
        self.host = Host(self.clock, profile.host_cores) if profile.host_cores else None
        self.workers: list[SimWorker] = []
        for role, n in (("prefill", num_prefill), ("decode", num_decode),
                        ("colocated", num_colocated)):
            for i in range(n):
                info = WorkerInfo(f"{role}-{i}", role, f"sim://{role}-{i}",
                                  block_size=profile.block_size, capacity=profile.num_blocks,
                                  block_bytes=profile.block_bytes)
                self.workers.append(SimWorker(self, info))
        self.by_id = {w.info.worker_id: w for w in self.workers}
        self.router_thread = Thread(self.host) if self.host else None
        self.client_thread = Thread(self.host) if self.host else None
        self._rng = random.Random(0)
        sigma = math.sqrt(math.log1p(profile.jitter ** 2))  # lognormal with mean 1 and this CV
        self._noise = ((lambda: self._rng.lognormvariate(-sigma * sigma / 2, sigma))
                       if profile.jitter else None)
        self.plans: dict[str, int] = {}

    def compute(self, work_s: float, fn: Callable, *args, thread: Thread | None = None) -> None:
        """`fn(*args)` once `work_s` of CPU work is done: on the shared host if there is one
        (in `thread`'s turn, if given)."""
        if self._noise is not None:
            work_s *= self._noise()
        if self.host is None:
            self.clock.after(work_s, fn, *args)
        elif thread is not None:  # in order, even with no work
            thread.run(work_s, fn, *args)
        elif work_s > 0:
            self.host.run(work_s, fn, *args)
        else:
            self.clock.after(0.0, fn, *args)

    def submit(self, req: SimRequest) -> None:
        self.clock.at(req.arrival, self._route, req)

    def _route(self, req: SimRequest) -> None:
        p = self.profile
        num_blocks = len(req.prompt) // p.block_size
        cost = p.router_cpu_s + p.lookup_s(num_blocks, len(self.workers))
        self.compute(cost, self._routed, req, thread=self.router_thread)

    def deliver(self, num_tokens: int, fn: Callable = _nothing, *args) -> None:
        """`num_tokens` tokens that reached the router go on to the client; `fn(*args)` once the
        client has read them (on a shared host: after the router's and the client's turns)."""
        if self.host is None:
            fn(*args)
            return
        p = self.profile

        def read() -> None:
            self.compute(num_tokens * p.client_cpu_per_token_s, fn, *args,
                         thread=self.client_thread)

        self.compute(num_tokens * p.router_relay_cpu_per_token_s, read, thread=self.router_thread)

    def threads(self) -> dict[str, Thread]:
        """Every process on the shared host, by name (empty without one)."""
        if self.host is None:
            return {}
        return {"router": self.router_thread, "client": self.client_thread,
                **{w.info.worker_id: w.thread for w in self.workers}}

    def _routed(self, req: SimRequest) -> None:
        req.hashes = self.hasher(req.prompt)
        live = [w.info for w in self.workers]
        matches = self.index.match(req.hashes, [w.worker_id for w in live])
        plan = plan_for(self.policy, len(req.prompt), matches, live, len(req.hashes),
                        self.profile.block_size)
        req.plan = plan.kind
        self.plans[plan.kind] = self.plans.get(plan.kind, 0) + 1
        d = self.by_id[plan.decode.worker_id]
        d.info.inflight += 1
        hop = self.profile.router_hop_s
        if plan.kind != "disagg":
            self.compute(hop, d.prefill_locally, req, thread=self.router_thread)
            return
        p = self.by_id[plan.prefill.worker_id]
        uncached = len(req.prompt) - plan.cached_blocks * self.profile.block_size
        p.info.inflight += 1
        p.info.inflight_tokens += uncached
        sent = self.clock.now

        def prefilled(r: SimRequest, cached_tokens: int) -> None:
            p.info.inflight -= 1
            p.info.inflight_tokens -= uncached
            learn_prefill_rate(p.info, len(r.prompt) - cached_tokens, self.clock.now + hop - sent)
            r.num_cached_tokens = cached_tokens
            r.token_times.append(self.clock.now)
            # the router reads the answer
            self.compute(hop, first_token, r, thread=self.router_thread)

        def first_token(r: SimRequest) -> None:
            r.first_token_at = self.clock.now
            if len(r.answer) <= 1:
                d.info.inflight -= 1
                self.deliver(1, d._done, r)
                return
            self.deliver(1)
            missing = (len(r.hashes) - d.cached_blocks(r.hashes)
                       + (len(r.prompt) % self.profile.block_size > 0))
            t = self.profile.transfer_s(missing)
            learn_bandwidth(d.info, RequestTiming(transfer_bytes=missing * self.profile.block_bytes,
                                                  transfer_s=t))
            # The decode call, then the pull (waiting on the link, not the CPU).
            self.compute(hop, self.clock.after, t, d.join, r, thread=self.router_thread)

        self.compute(hop, p.submit_prefill, req, prefilled, thread=self.router_thread)
