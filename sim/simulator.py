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
- with KV tiers (`tiers`, sim/fleet_cache.py), a worker's device evictions go to its host tier
  and on to its disk tier; the router's policy sees each worker's match split by tier and prices
  it with its real code (router/reload_cost.py) at the reload rates each worker reports in its
  load; a worker reloads what it holds in a lower tier (at the profile's rates) before it
  prefills the rest;
- with `host_cores` set (one small machine), every process is a `Thread` on one
  processor-sharing `Host` (n jobs on c cores each run at min(1, c / n) of full speed): each
  worker (its prefills or decode steps and its own I/O, in order: one Python process), the
  router (routing, hops, relaying tokens) and the load generator (reading tokens; a session's
  next turn waits for it to read the last one).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from common.hashing import BlockHasher
from common.protocol import RequestTiming
from router.dispatch import learn_bandwidth, learn_prefill_rate
from router.policy import make_policy, plan_for
from router.settings import RouterSettings
from router.worker_info import WorkerInfo
from sim.coarsening import CandidateSample, coarsen
from sim.fleet_cache import FleetCache
from sim.host import Clock, Host, Thread
from sim.peer_pulls import SimPulls
from sim.profile import CostProfile
from sim.request import SimRequest
from sim.worker import SimWorker

__all__ = ["Cluster", "SimRequest", "SimWorker"]


def _nothing() -> None:
    pass


class Cluster:
    """`num_prefill` + `num_decode` (+ `num_colocated`) simulated workers behind the real policy;
    `tiers` (sim/fleet_cache.py `TIERS`) says which KV tiers below the device each one has."""

    def __init__(self, profile: CostProfile, num_prefill: int, num_decode: int,
                 policy: str = "kv_aware", num_colocated: int = 0,
                 settings: RouterSettings | None = None, tiers: str = "off",
                 block_tokens: int | None = None, route_candidates: int | None = None,
                 peer_pulls: bool = False) -> None:
        """`block_tokens`, `route_candidates`: the explicit coarsenings of sim/coarsening.py
        (None: exact). `peer_pulls`: the policy plans peer prefix pulls and the workers make
        them (sim/peer_pulls.py), each worker at its profile locality."""
        # The router's hashing and lookup are priced at the profile's own block size, whatever
        # size the cache is simulated at.
        self._lookup_profile = profile
        if block_tokens is not None:
            profile = coarsen(profile, block_tokens)
        self._sample = CandidateSample(route_candidates) if route_candidates else None
        self._fleet: tuple = ()  # the workers `_live` last listed
        self.profile = profile
        self.clock = Clock()
        # (the router configured for the profile's hardware: its block, and its decode step line
        # that kv_aware prices a decode batch's growth on, router/decode_growth.py)
        self.settings = settings or RouterSettings(
            block_size=profile.block_size, bytes_per_block=profile.block_bytes, policy_seed=0,
            peer_pulls=peer_pulls, planner_decode_step_base_s=profile.decode_step_base_s,
            planner_decode_step_per_seq_s=profile.decode_step_per_seq_s)
        self.policy = make_policy(policy, self.settings)
        self.hasher = BlockHasher("sim", profile.block_size, None)
        self.index = FleetCache.for_tiers(tiers, profile.num_blocks, profile.host_blocks,
                                          profile.disk_blocks)
        self.host = Host(self.clock, profile.host_cores) if profile.host_cores else None
        self.workers: list[SimWorker] = []
        for role, n in (("prefill", num_prefill), ("decode", num_decode),
                        ("colocated", num_colocated)):
            for i in range(n):
                info = WorkerInfo(f"{role}-{i}", role, f"sim://{role}-{i}",
                                  block_size=profile.block_size, capacity=profile.num_blocks,
                                  block_bytes=profile.block_bytes,
                                  locality=profile.locality(len(self.workers)))
                self.workers.append(SimWorker(self, info))
        self.by_id = {w.info.worker_id: w for w in self.workers}
        self.pulls = SimPulls(self.clock, profile, self.by_id, getattr(self.policy, "fabric",
                                                                       None))
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

    def continue_hashes(self, hashes: list[int], token_ids: list[int],
                        start: int = 0) -> list[int]:
        """The chain of a sequence's full blocks, given `hashes`, those of its leading full
        blocks (already computed: the same numbers as hashing it all, for a fraction of the
        work), and `token_ids`, the sequence from token `start` on (at most where `hashes`
        end: a driver need not keep what they cover)."""
        if not hashes:
            return self.hasher(token_ids)
        rest = token_ids[len(hashes) * self.profile.block_size - start:]
        return hashes + self.hasher(rest, parent_hash=hashes[-1])

    def submit(self, req: SimRequest) -> None:
        self.clock.at(req.arrival, self._route, req)

    def _route(self, req: SimRequest) -> None:
        p = self._lookup_profile
        num_blocks = req.num_prompt_tokens // p.block_size
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

    def _live(self) -> tuple[list[WorkerInfo], list[str]]:
        """The live workers' infos and ids, in order (again only when the fleet changed)."""
        fleet = tuple(self.workers)
        if fleet != self._fleet:
            infos = [w.info for w in fleet]
            self._fleet, self._fleet_live = fleet, (infos, [w.worker_id for w in infos])
        return list(self._fleet_live[0]), self._fleet_live[1]

    def _routed(self, req: SimRequest) -> None:
        req.hashes = self.continue_hashes(req.prefix_hashes, req.prompt, req.prompt_start)
        req.prefix_hashes = []
        live, ids = self._live()
        # Only the workers with a match: the policy reads a worker left out as holding nothing
        # (a thousand-worker fleet's zeros cost a dictionary entry each, a request).
        media = None
        if self.index.tiered:  # the policy prices each tier's hits (router/reload_cost.py)
            media = self.index.match_by_medium(req.hashes, ids, only_matched=True)
            matches = {w: m.total for w, m in media.items()}
        else:
            matches = self.index.match(req.hashes, ids, only_matched=True)
        if self._sample is not None:
            live = self._sample(live, matches)
        plan = plan_for(self.policy, req.num_prompt_tokens, matches, live, len(req.hashes),
                        self.profile.block_size, media)
        req.plan, req.planned_media = plan.kind, plan.cached_media
        req.planned_cached_blocks = plan.cached_blocks
        self.plans[plan.kind] = self.plans.get(plan.kind, 0) + 1
        d = self.by_id[plan.decode.worker_id]
        d.info.inflight += 1
        hop = self.profile.router_hop_s
        if plan.kind != "disagg":
            self.pulls.before(plan, req, lambda: self.compute(hop, d.prefill_locally, req,
                                                              thread=self.router_thread))
            return
        p = self.by_id[plan.prefill.worker_id]
        uncached = req.num_prompt_tokens - plan.cached_blocks * self.profile.block_size
        p.info.inflight += 1
        p.info.inflight_tokens += uncached
        sent = self.clock.now

        def prefilled(r: SimRequest, cached_tokens: int) -> None:
            p.info.inflight -= 1
            p.info.inflight_tokens -= uncached
            learn_prefill_rate(p.info, r.num_prompt_tokens - cached_tokens,
                               self.clock.now + hop - sent)
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
            held = d.cached(r.hashes)
            bs = self.profile.block_size
            missing = len(r.hashes) - held.total + (r.num_prompt_tokens % bs > 0)
            t = self.profile.transfer_s(missing)
            learn_bandwidth(d.info, RequestTiming(transfer_bytes=missing * self.profile.block_bytes,
                                                  transfer_s=t))
            # The decode call, then the pull (waiting on the link, not the CPU) and the reload
            # of what the decode worker holds in its lower tiers.
            t += self.profile.reload_s(held.host, held.disk)
            self.compute(hop, self.clock.after, t, d.join, r, thread=self.router_thread)

        self.pulls.before(plan, req, lambda: self.compute(hop, p.submit_prefill, req, prefilled,
                                                          thread=self.router_thread))
