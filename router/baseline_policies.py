"""The baseline routing policies, which predict nothing: `round_robin`, `random` and
`least_loaded` (the name table is router/policy.py's `POLICIES`)."""

from __future__ import annotations

import itertools
import random

from router.plan import NoWorkers, Plan, RouteContext, load_key
from router.settings import RouterSettings


def _default_plan(ctx: RouteContext, pick) -> Plan:
    if ctx.prefill and ctx.decode:
        p, d = pick(ctx.prefill, "p"), pick(ctx.decode, "d")
        return Plan("disagg", d, p, cached_blocks=ctx.matches.get(p.worker_id, 0),
                    cached_media=ctx.media.get(p.worker_id))
    pool = ctx.colocated or ctx.decode
    if pool:
        w = pick(pool, "c")
        return Plan("colocated" if w.role == "colocated" else "decode_local", w,
                    cached_blocks=ctx.matches.get(w.worker_id, 0),
                    cached_media=ctx.media.get(w.worker_id))
    raise NoWorkers("no live decode or colocated worker")


class RoundRobinPolicy:
    def __init__(self, settings: RouterSettings) -> None:
        self._counters: dict[str, itertools.count] = {}

    def choose(self, ctx: RouteContext) -> Plan:
        def pick(pool, tag):
            n = next(self._counters.setdefault(tag, itertools.count()))
            return sorted(pool, key=lambda w: w.worker_id)[n % len(pool)]

        return _default_plan(ctx, pick)


class RandomPolicy:
    def __init__(self, settings: RouterSettings) -> None:
        self._rng = random.Random(settings.policy_seed)

    def choose(self, ctx: RouteContext) -> Plan:
        return _default_plan(ctx, lambda pool, tag: self._rng.choice(pool))


class LeastLoadedPolicy:
    def __init__(self, settings: RouterSettings) -> None:
        pass

    def choose(self, ctx: RouteContext) -> Plan:
        return _default_plan(ctx, lambda pool, tag: min(pool, key=load_key))
