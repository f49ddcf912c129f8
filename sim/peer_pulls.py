"""Peer prefix pulls in the simulator (issue 42): where the router's real policy plans one
(`Plan.kv_source`, router/peer_pull.py), the worker that computes the prompt first pulls the
leading blocks it lacks from the holder, over the link between their localities at the profile's
rate for that link's class (sim/profile.py `pull_s`; the holder's lower-tier blocks reloaded
first), and the router's fabric learns that pull as a real router learns one it saw
(router/fabric.py). Then the request goes on as planned, finding those blocks cached."""

from __future__ import annotations

from collections.abc import Callable

from common.locality import link_class
from router.fabric import Fabric
from router.plan import Plan
from sim.host import Clock
from sim.profile import CostProfile
from sim.request import SimRequest


class SimPulls:
    def __init__(self, clock: Clock, profile: CostProfile, by_id: dict,
                 fabric: Fabric | None) -> None:
        self.clock, self.profile, self.by_id, self.fabric = clock, profile, by_id, fabric
        self.num_pulls = 0
        self.num_pulled_tokens = 0
        self.pulled_by_link: dict[str, int] = {}  # tokens, by link class

    def before(self, plan: Plan, req: SimRequest, start: Callable[[], None]) -> None:
        """`start()` once the plan's pull (if any) has landed on the computing worker."""
        if plan.kv_source is None:
            start()
            return
        c = self.by_id[(plan.prefill or plan.decode).worker_id]
        src = self.by_id[plan.kv_source.worker_id]
        hashes = req.hashes[:plan.pull_blocks]
        missing = len(hashes) - c.cached_blocks(hashes)
        if missing <= 0:
            start()
            return
        held = src.cached(hashes)
        link = link_class(src.info.locality, c.info.locality)
        p = self.profile
        seconds = p.pull_s(missing, link) + p.reload_s(held.host, held.disk)
        num_tokens = missing * p.block_size
        self.num_pulls += 1
        self.num_pulled_tokens += num_tokens
        self.pulled_by_link[link] = self.pulled_by_link.get(link, 0) + num_tokens

        def landed() -> None:
            c.record(hashes)
            if self.fabric is not None:
                self.fabric.learn(src.info.locality, c.info.locality, missing * p.block_bytes,
                                  seconds)
            start()

        # The router's export call to the holder, then the pull itself (what the puller
        # reports, and the fabric learns).
        self.clock.after(p.router_hop_s + seconds, landed)
