"""Routing policies behind one Protocol and a name table (`POLICIES`).

Every policy sees the same `RouteContext` and returns a `Plan` (router/plan.py):
- `disagg`: prefill on a prefill worker, then decode on a decode worker (KV pulled);
- `decode_local`: the decode worker prefills itself (conditional disaggregation: it already
  holds most of the prompt, so few uncached tokens are cheaper to compute than to fetch);
- `colocated`: one colocated worker does both (fallback when a pool is empty).

`kv_aware` predicts the time to first token of each candidate plan, adds the cost of the cached
blocks it would evict where it lands (router/eviction_cost.py), and picks the minimum; near ties
go to the less loaded worker, then to the one with more empty KV blocks. A worker's hits in its
lower KV tiers (host, disk) are priced at its reload rates, and count only where reloading beats
recomputing (router/reload_cost.py). A placement whose decode worker's step, with one more stream,
is predicted past the ITL SLO is charged for it (router/decode_growth.py), so that load spreads
to the decode workers with room.
"""

from __future__ import annotations

import math

from router.baseline_policies import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from router.decode_growth import fleet_step_line, growth_s
from router.eviction_cost import eviction_s
from router.fabric import Fabric
from router.peer_pull import best_pull, peer_held_blocks, plan_peer_pull, sources
from router.plan import NoWorkers, Plan, Policy, RouteContext, load_key, plan_of
from router.reload_cost import PricedHit, price_hit
from router.settings import RouterSettings
from router.tiered_match import MatchByMedium
from router.worker_info import WorkerInfo

# Prefill localities a disaggregated plan is priced from: each costs a pass over the decode pool.
MAX_PREFILL_LOCALITIES = 4


class KVAwarePolicy:
    def __init__(self, settings: RouterSettings, fabric: Fabric | None = None) -> None:
        self.s = settings
        self._fleet_rate: float | None = None
        self._fleet_bw: float | None = None
        self._sources: list[WorkerInfo] = []  # the prompt's best peer-pull holders
        self._step_line = (settings.planner_decode_step_base_s,
                           settings.planner_decode_step_per_seq_s)  # the fleet's, per decision
        # Pull costs per locality pair, learned from the pulls the dispatcher sees.
        self.fabric = fabric if fabric is not None else Fabric.from_settings(settings)

    def _rate(self, w: WorkerInfo) -> float:
        # Unmeasured workers are assumed as fast as the measured ones (same model everywhere).
        return w.prefill_tokens_per_s or self._fleet_rate or self.s.default_prefill_tokens_per_s

    def _hit(self, w: WorkerInfo, ctx: RouteContext) -> PricedHit:
        """`w`'s match (in blocks of its own size) as priced: lower tiers at its reload rates."""
        return price_hit(w, ctx.matches.get(w.worker_id, 0), ctx.media.get(w.worker_id),
                         self._rate(w), self.s)

    def _prefill_s(self, w: WorkerInfo, ctx: RouteContext) -> tuple[float, PricedHit]:
        """Seconds until `w` has computed the prompt: its queue, what it lacks (less what
        pulling a longer match from a peer saves, with peer pulls on), its tier reloads."""
        hit = self._hit(w, ctx)
        uncached = max(ctx.num_tokens - hit.blocks * w.block_size, 1)
        pulled_s = best_pull(w, ctx, self.s, self._rate, self._fleet_bw, self._sources,
                             self.fabric)[0]
        return (w.queued_tokens() + uncached) / self._rate(w) + hit.reload_s - pulled_s, hit

    def _evict_s(self, w: WorkerInfo, ctx: RouteContext, hit: PricedHit) -> float:
        return eviction_s(w, ctx.num_tokens, hit, self._rate(w), self.s)

    def _landing_s(self, d: WorkerInfo, ctx: RouteContext, hit: PricedHit) -> float:
        """What a placement costs on the worker that decodes it beyond its time to first token:
        the cached blocks it evicts there and its batch's growth past the ITL SLO."""
        return self._evict_s(d, ctx, hit) + growth_s(d, self._step_line, self.s)

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
            price = t_local + s.local_prefill_stall_weight * stall + self._landing_s(d, ctx, hit)
            out.append((price, load_key(d), plan_of("decode_local", d, None, t_local, hit)))
        return out

    def choose(self, ctx: RouteContext) -> Plan:
        s = self.s
        rates = [w.prefill_tokens_per_s for w in ctx.prefill + ctx.decode + ctx.colocated
                 if w.prefill_tokens_per_s]
        self._fleet_rate = sum(rates) / len(rates) if rates else None
        bws = [w.transfer_bytes_per_s for w in ctx.decode if w.transfer_bytes_per_s]
        self._fleet_bw = sum(bws) / len(bws) if bws else None
        self._sources = sources(ctx) if s.peer_pulls else []
        self._step_line = fleet_step_line(ctx.decode, s)
        local: list[tuple[float, tuple, Plan]] = []  # decode_local and colocated plans
        # (decode worker, KV bytes it would pull, its tier reloads, what landing there costs
        # beyond the time to first token, the bandwidth its pulls have measured: the fleet's,
        # or the setting, until then)
        moves: list[tuple[WorkerInfo, int, float, float, float]] = []
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
                local.append((t_local + self._landing_s(d, ctx, hit), load_key(d),
                              plan_of("decode_local", d, None, t_local, hit)))
            else:
                others.append(d)
            # Missing full blocks plus the partial tail block always move; the blocks it holds in
            # a lower tier are reloaded there.
            missing = max(ctx.num_tokens // size - held, 0) + (ctx.num_tokens % size > 0)
            moves.append((d, missing * (d.block_bytes or s.bytes_per_block), hit.reload_s,
                          self._landing_s(d, ctx, hit),
                          d.transfer_bytes_per_s or self._fleet_bw
                          or s.default_transfer_bytes_per_s))
        for c in ctx.colocated:
            t, hit = self._prefill_s(c, ctx)
            t *= 1 + s.local_prefill_interference * c.running()
            local.append((t + self._landing_s(c, ctx, hit), load_key(c),
                          plan_of("colocated", c, None, t, hit)))
        prefill = [self._priced_prefill(p, ctx) for p in ctx.prefill] if moves else []
        if s.conditional_disagg and s.local_prefill_when_backed_up and prefill:
            local += self._around_backlog(ctx, others)
        # A disaggregated plan costs prefill(p) + transfer(locality of p -> d): the search is
        # over P workers plus D workers per prefill locality, not P x D pairs.
        prefill = self._nearest_localities(prefill)
        transfer = {loc: self._transfers(loc, moves) for loc in {e[2].locality for e in prefill}}
        min_td = {loc: min((t for t, _, _ in ts), default=math.inf)
                  for loc, ts in transfer.items()}
        best = min([e[0] + min_td[e[2].locality] for e in prefill] or [math.inf])
        best = min([best] + [t for t, _, _ in local])
        if best == math.inf:
            raise NoWorkers("no live decode or colocated worker")
        bound = best + s.near_tie_s
        # Among near ties prefer disaggregation (keeps prefill off decode workers), then the less
        # loaded prefill worker, then the less loaded decode worker: the same order as sorting
        # every near-tie pair by (kind, load(p) + load(d), t), found in two passes.
        near_p = [e for e in prefill if e[0] + min_td[e[2].locality] <= bound]
        if near_p:
            t_p, hit_p, p, evict_p = min(near_p, key=lambda e: load_key(e[2]))
            t_d, d, land_d = min((e for e in transfer[p.locality] if t_p + e[0] <= bound),
                                 key=lambda e: (load_key(e[1]), e[0]))
            return plan_of("disagg", d, p, t_p + t_d - evict_p - land_d, hit_p)
        near = [c for c in local if c[0] <= bound]
        near.sort(key=lambda c: (c[1], c[0]))
        return near[0][2]

    def _nearest_localities(self, prefill: list) -> list:
        """The priced prefill workers of the `MAX_PREFILL_LOCALITIES` localities whose best
        worker is cheapest: the transfer is priced per (prefill locality, decode worker)."""
        best: dict[str, float] = {}
        for e in prefill:
            best[e[2].locality] = min(best.get(e[2].locality, math.inf), e[0])
        if len(best) <= MAX_PREFILL_LOCALITIES:
            return prefill
        keep = set(sorted(best, key=best.__getitem__)[:MAX_PREFILL_LOCALITIES])
        return [e for e in prefill if e[2].locality in keep]

    def _transfers(self, src: str, moves) -> list[tuple[float, WorkerInfo, float]]:
        """(weighted transfer seconds + landing on the decode worker, the decode worker, that
        landing cost: `_landing_s`) for a prefill at locality `src`: the pair's learned cost
        (router/fabric.py), else its link class's seed, else the decode worker's measured
        bandwidth (`moves`)."""
        weight = self.s.transfer_weight
        return [(weight * (reload_s + self.fabric.pull_s(src, d.locality, num_bytes, fallback))
                 + land_d, d, land_d)
                for d, num_bytes, reload_s, land_d, fallback in moves]

    def _priced_prefill(self, p: WorkerInfo, ctx: RouteContext
                        ) -> tuple[float, PricedHit, WorkerInfo, float]:
        """(prefill seconds + eviction on `p`, its hit, `p`, that eviction's cost)."""
        t, hit = self._prefill_s(p, ctx)
        evict = self._evict_s(p, ctx, hit)
        return t + evict, hit, p, evict


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
    plan = policy.choose(ctx)
    plan.peer_held_blocks = peer_held_blocks(plan, ctx)
    if isinstance(policy, KVAwarePolicy) and policy.s.peer_pulls:
        plan_peer_pull(plan, ctx, policy.s, policy._rate, policy._fleet_bw, policy.fabric)
    return plan
