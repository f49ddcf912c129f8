"""Routing policies behind one Protocol and a name table (`POLICIES`).

Every policy sees the same `RouteContext` and returns a `Plan`:
- `disagg`: prefill on a prefill worker, then decode on a decode worker (KV pulled);
- `decode_local`: the decode worker prefills itself (conditional disaggregation: it already
  holds most of the prompt, so few uncached tokens are cheaper to compute than to fetch);
- `colocated`: one colocated worker does both (fallback when a pool is empty).

`kv_aware` predicts the time to first token of each candidate plan and picks the minimum; near
ties go to the less loaded worker. A worker's hits in its lower KV tiers (host, disk) are priced
at its reload rates, and count only where reloading beats recomputing (router/reload_cost.py).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Protocol

from router.reload_cost import PricedHit, price_hit
from router.settings import RouterSettings
from router.tiered_match import MatchByMedium
from router.worker_info import WorkerInfo


@dataclass
class RouteContext:
    num_tokens: int
    num_blocks: int  # full blocks of the prompt
    # Leading matched blocks per worker id, in its own block size, held in any KV tier.
    matches: dict[str, int]
    prefill: list[WorkerInfo]
    decode: list[WorkerInfo]
    colocated: list[WorkerInfo]
    block_size: int  # the model's first workers'; a worker's own is `WorkerInfo.block_size`
    # How each worker's match splits by tier (router/tiered_match.py); a worker left out holds
    # its whole match on the device.
    media: dict[str, MatchByMedium] = field(default_factory=dict)


@dataclass
class Plan:
    kind: str  # disagg | decode_local | colocated
    decode: WorkerInfo
    prefill: WorkerInfo | None = None
    predicted_s: float | None = None
    cached_blocks: int = 0  # on the worker that prefills
    cached_media: MatchByMedium | None = None  # those blocks by tier (None: all on the device)


class NoWorkers(RuntimeError):
    pass


class Policy(Protocol):
    def __init__(self, settings: RouterSettings) -> None: ...

    def choose(self, ctx: RouteContext) -> Plan: ...


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
        return _default_plan(ctx, lambda pool, tag: min(pool, key=_load_key))


def _load_key(w: WorkerInfo) -> tuple:
    return (w.inflight + w.running() + int(w.load.get("waiting", 0)), w.queued_tokens(),
            w.worker_id)


class KVAwarePolicy:
    def __init__(self, settings: RouterSettings) -> None:
        self.s = settings
        self._fleet_rate: float | None = None
        self._fleet_bw: float | None = None

    def _rate(self, w: WorkerInfo) -> float:
        # Unmeasured workers are assumed as fast as the measured ones (same model everywhere).
        return w.prefill_tokens_per_s or self._fleet_rate or self.s.default_prefill_tokens_per_s

    def _hit(self, w: WorkerInfo, ctx: RouteContext) -> PricedHit:
        """`w`'s match (in blocks of its own size) as priced: lower tiers at its reload rates."""
        return price_hit(w, ctx.matches.get(w.worker_id, 0), ctx.media.get(w.worker_id),
                         self._rate(w), self.s)

    def _prefill_s(self, w: WorkerInfo, ctx: RouteContext) -> tuple[float, PricedHit]:
        hit = self._hit(w, ctx)
        uncached = max(ctx.num_tokens - hit.blocks * w.block_size, 1)
        return (w.queued_tokens() + uncached) / self._rate(w) + hit.reload_s, hit

    def _around_backlog(self, ctx: RouteContext,
                        decode: list[WorkerInfo]) -> list[tuple[float, tuple, Plan]]:
        """Local prefill for any prompt while the prefill pool is backed up: when even the least
        loaded prefill worker has at least this prompt's own uncached tokens queued, a decode
        worker may prefill it (as Dynamo's conditional disaggregation does with queue depth).
        Such a plan is priced honestly: its time to first token plus the stall it imposes on
        every stream running there (each waits the whole prefill), weighted by
        `local_prefill_stall_weight`, so it wins only where the queue costs more."""
        s = self.s
        queued = min(p.queued_tokens() for p in ctx.prefill)
        out = []
        for d in decode:
            t_local, hit = self._prefill_s(d, ctx)
            uncached = ctx.num_tokens - hit.blocks * d.block_size
            if queued < uncached:
                continue
            t_local *= 1 + s.local_prefill_interference * d.running()
            stall = d.running() * uncached / self._rate(d)
            price = t_local + s.local_prefill_stall_weight * stall
            out.append((price, _load_key(d), _plan("decode_local", d, None, t_local, hit)))
        return out

    def choose(self, ctx: RouteContext) -> Plan:
        s = self.s
        rates = [w.prefill_tokens_per_s for w in ctx.prefill + ctx.decode + ctx.colocated
                 if w.prefill_tokens_per_s]
        self._fleet_rate = sum(rates) / len(rates) if rates else None
        bws = [w.transfer_bytes_per_s for w in ctx.decode if w.transfer_bytes_per_s]
        self._fleet_bw = sum(bws) / len(bws) if bws else None
        local: list[tuple[float, tuple, Plan]] = []  # decode_local and colocated plans
        transfer: list[tuple[float, WorkerInfo]] = []  # (weighted transfer seconds, decode worker)
        others: list[WorkerInfo] = []  # decode workers the conditional rule leaves out
        for d in ctx.decode:
            hit, size = self._hit(d, ctx), d.block_size
            held = hit.blocks
            uncached = ctx.num_tokens - held * size
            if not ctx.prefill or (
                    s.conditional_disagg and uncached <= s.local_prefill_max_uncached_tokens
                    and held * size >= s.local_prefill_min_cached_fraction * ctx.num_tokens):
                # Local prefill on D slows its running decodes: charge for that interference.
                t_local, hit = self._prefill_s(d, ctx)
                t_local *= 1 + s.local_prefill_interference * d.running()
                local.append((t_local, _load_key(d), _plan("decode_local", d, None, t_local, hit)))
            else:
                others.append(d)
            # Missing full blocks plus the partial tail block always move, at the bandwidth this
            # decode worker's pulls have measured (the fleet's, or the setting, until then); the
            # blocks it holds in a lower tier are reloaded there.
            missing = max(ctx.num_tokens // size - held, 0) + (ctx.num_tokens % size > 0)
            bandwidth = d.transfer_bytes_per_s or self._fleet_bw or s.default_transfer_bytes_per_s
            transfer_s = (s.transfer_fixed_s + hit.reload_s
                          + missing * (d.block_bytes or s.bytes_per_block) / bandwidth)
            transfer.append((s.transfer_weight * transfer_s, d))
        for c in ctx.colocated:
            t, hit = self._prefill_s(c, ctx)
            t *= 1 + s.local_prefill_interference * c.running()
            local.append((t, _load_key(c), _plan("colocated", c, None, t, hit)))
        prefill = [(*self._prefill_s(p, ctx), p) for p in ctx.prefill] if transfer else []
        if s.conditional_disagg and s.local_prefill_when_backed_up and prefill:
            local += self._around_backlog(ctx, others)
        # A disaggregated plan costs prefill(p) + transfer(d): the two terms are independent, so
        # the search is over P + D workers, not P x D pairs (128 workers: 128 terms, not 4096).
        min_td = min((t for t, _ in transfer), default=math.inf)
        best = min([t for t, _, _ in prefill] or [math.inf]) + min_td
        best = min([best] + [t for t, _, _ in local])
        if best == math.inf:
            raise NoWorkers("no live decode or colocated worker")
        bound = best + s.near_tie_s
        # Among near ties prefer disaggregation (keeps prefill off decode workers), then the less
        # loaded prefill worker, then the less loaded decode worker: the same order as sorting
        # every near-tie pair by (kind, load(p) + load(d), t), found in two passes.
        near_p = [e for e in prefill if e[0] + min_td <= bound]
        if near_p:
            t_p, hit_p, p = min(near_p, key=lambda e: _load_key(e[2]))
            t_d, d = min(((t, d) for t, d in transfer if t_p + t <= bound),
                         key=lambda e: (_load_key(e[1]), e[0]))
            return _plan("disagg", d, p, t_p + t_d, hit_p)
        near = [c for c in local if c[0] <= bound]
        near.sort(key=lambda c: (c[1], c[0]))
        return near[0][2]


def _plan(kind: str, decode: WorkerInfo, prefill: WorkerInfo | None, predicted_s: float,
          hit: PricedHit) -> Plan:
    return Plan(kind, decode, prefill, predicted_s, hit.blocks, hit.counted)


POLICIES: dict[str, type] = {
    "kv_aware": KVAwarePolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "random": RandomPolicy,
}


def make_policy(name: str, settings: RouterSettings) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name](settings)


ROLES = ("prefill", "decode", "colocated")


def plan_for(policy: Policy, num_tokens: int, matches: dict[str, int],
             live: list[WorkerInfo], num_blocks: int, block_size: int,
             media: dict[str, MatchByMedium] | None = None) -> Plan:
    """The policy's plan for a prompt of `num_tokens` (`num_blocks` full blocks) given each live
    worker's leading match (in any tier; `media`: how it splits by tier, None or a worker left
    out: all on the device); raises `NoWorkers`. No I/O, no state: the simulator's router.

    A prefill and a decode worker pair only when they speak one KV protocol at one block size
    (backend, block size): where a model's live workers form several such groups (Tandem workers
    beside vLLM workers), each group gets the policy's plan and the one predicted fastest wins
    (a policy that predicts nothing: the one whose decode worker has the least in flight)."""
    groups: dict[tuple[str, int], list[WorkerInfo]] = {}
    for w in live:
        groups.setdefault((w.backend, w.block_size), []).append(w)
    media = media or {}
    if len(groups) <= 1:
        return _choose(policy, num_tokens, matches, live, num_blocks, block_size, media)
    plans = []
    for (_, size), group in sorted(groups.items()):
        try:
            plans.append(_choose(policy, num_tokens, matches, group, num_tokens // size, size,
                                 media))
        except NoWorkers:
            continue
    if not plans:
        raise NoWorkers("no live decode or colocated worker")
    return min(plans, key=lambda p: (math.inf if p.predicted_s is None else p.predicted_s,
                                     p.decode.inflight, p.decode.worker_id))


def _choose(policy: Policy, num_tokens: int, matches: dict[str, int], live: list[WorkerInfo],
            num_blocks: int, block_size: int, media: dict[str, MatchByMedium]) -> Plan:
    by_role = {r: [w for w in live if w.role == r] for r in ROLES}
    ctx = RouteContext(num_tokens, num_blocks, matches, by_role["prefill"], by_role["decode"],
                       by_role["colocated"], block_size, media)
    return policy.choose(ctx)
