"""Peer prefix pulls, the router's part (issue 42; docs/architecture.md "Peer prefix pulls").

Planning (`plan_peer_pull`, called on `kv_aware`'s plan): when another Tandem worker of the same
identity holds a longer leading match of the prompt than the worker that will compute it (in any
KV tier), price pulling the difference (the holder's reload of its lower-tier blocks, its export
at what exports have taken: router/export_time.py, then the pull on the link between the two
workers' localities, at what that pair's pulls have cost: router/fabric.py) against recomputing
those tokens at its prefill rate; the plan records the holder as `kv_source` only when pulling
from that holder is predicted faster. So a near holder with a shorter match can beat a far one
with a longer match, and over a slow enough link the prompt is recomputed. A holder answers an
export at once, even in the middle of a long engine step (engine/llm_engine.py
`MID_STEP_METHODS`), so how busy it is does not enter the price.

Performing (`export_prefix`, called by the dispatcher): ask the holder to lease those blocks to
the computing worker (`POST /kv/prefix-export`); its signed prefix handle travels with the compute
leg. Anything short of a handle (the holder gone, draining, holding none any more) means the
prompt is simply computed: the pull is an optimisation, never a dependency.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable

import aiohttp

from common.prefix_export import PrefixExportRequest, PrefixExportResponse
from common.protocol import KVTransferParams
from router.backend import RequestRejected, WorkerFailure
from router.fabric import Fabric, endpoint
from router.reload_cost import price_hit
from router.settings import RouterSettings
from router.worker_http import parse, post_json
from router.worker_info import WorkerInfo

log = logging.getLogger(__name__)


def computing_worker(plan) -> WorkerInfo:
    """The worker that computes the plan's prompt: the prefill worker, or the decode side's."""
    return plan.prefill if plan.prefill is not None else plan.decode


MAX_SOURCES = 16  # holders priced for each candidate worker


def sources(ctx) -> list[WorkerInfo]:
    """The holders worth pricing a pull from, for any candidate: the two Tandem workers with the
    longest leading matches of the prompt (the best far source for any worker is among them:
    the second, for the first itself), then the longest of each other locality (the best near
    source), `MAX_SOURCES` at most. Pricing a pull for every candidate stays O(workers): the
    search is over localities, not over every pair."""
    held = [w for w in (*ctx.prefill, *ctx.decode, *ctx.colocated)
            if w.backend == "tandem" and ctx.matches.get(w.worker_id, 0) > 0]
    ranked = heapq.nlargest(MAX_SOURCES * 4, held, key=lambda w: ctx.matches[w.worker_id])
    out, localities = ranked[:2], {w.locality for w in ranked[:2]}
    for w in ranked[2:]:
        if len(out) >= MAX_SOURCES:
            break
        if w.locality and w.locality not in localities:
            out.append(w)
            localities.add(w.locality)
    return out


def best_pull(c: WorkerInfo, ctx, s: RouterSettings, rate: Callable[[WorkerInfo], float],
              fleet_bw: float | None, holders, fabric: Fabric
              ) -> tuple[float, WorkerInfo | None, int]:
    """(the seconds that pulling saves `c` against recomputing, the holder, the blocks of its
    priced match) for the best of `holders`; (0.0, None, 0) where no pull pays. `rate(w)`: the
    prefill tokens/s the policy assumes for `w`; each pull priced at what exports take
    (`fabric.export`) and on `fabric` for its pair."""
    if c.backend != "tandem":
        return 0.0, None, 0
    held = ctx.matches.get(c.worker_id, 0)
    limit = (ctx.num_tokens - 1) // c.block_size  # the last prompt token is always computed
    bandwidth = c.transfer_bytes_per_s or fleet_bw or s.default_transfer_bytes_per_s
    block_bytes = c.block_bytes or s.bytes_per_block
    best: tuple[float, WorkerInfo | None, int] = (0.0, None, 0)
    for w in holders:
        if (w is c or w.backend != "tandem" or w.identity != c.identity
                or ctx.matches.get(w.worker_id, 0) <= held):
            continue
        hit = price_hit(w, min(ctx.matches[w.worker_id], limit), ctx.media.get(w.worker_id),
                        rate(c), s)
        num_blocks = hit.blocks - held
        if num_blocks <= 0:
            continue
        pull_s = (hit.reload_s + fabric.export.seconds
                  + fabric.pull_s(endpoint(w), endpoint(c), num_blocks * block_bytes, bandwidth))
        gain = num_blocks * c.block_size / rate(c) - pull_s
        if gain > best[0]:
            best = (gain, w, hit.blocks)
    return best


def plan_peer_pull(plan, ctx, s: RouterSettings, rate: Callable[[WorkerInfo], float],
                   fleet_bw: float | None, fabric: Fabric) -> None:
    """Set `plan.kv_source` / `plan.pull_blocks` where pulling beats recomputing (see above).
    `kv_aware` already priced every candidate with its best pull (`best_pull` over `sources`);
    this records the pull for the worker it chose, searching every holder."""
    c = computing_worker(plan)
    gain, holder, num_blocks = best_pull(c, ctx, s, rate, fleet_bw,
                                         (*ctx.prefill, *ctx.decode, *ctx.colocated), fabric)
    if holder is not None:
        plan.kv_source, plan.pull_blocks = holder, num_blocks


def peer_held_blocks(plan, ctx) -> int:
    """Leading blocks of the prompt that some other Tandem worker of the computing worker's
    identity holds beyond the computing worker's own match (what a pull could have saved)."""
    c = computing_worker(plan)
    if c.backend != "tandem":
        return 0
    held = ctx.matches.get(c.worker_id, 0)
    limit = (ctx.num_tokens - 1) // c.block_size
    best = max((ctx.matches.get(w.worker_id, 0) for w in (*ctx.prefill, *ctx.decode,
                                                             *ctx.colocated)
                if w is not c and w.backend == "tandem" and w.identity == c.identity),
               default=0)
    return max(min(best, limit) - held, 0)


async def export_prefix(backends: dict, plan, request_id: str, trace,
                        timeout: aiohttp.ClientTimeout) -> KVTransferParams | None:
    """The holder's signed prefix handle for the computing worker (recorded in `trace`), or None
    (no source planned, or none answered: compute it all)."""
    holder = plan.kv_source
    if holder is None:
        return None
    t0 = time.monotonic()
    got = await lease_prefix(backends, holder, computing_worker(plan), f"{request_id}.prefix",
                             plan.pull_hashes[:plan.pull_blocks], timeout)
    # Part of the pull's cost: the holder answers between two of its engine steps.
    trace.export_s = time.monotonic() - t0
    if got is not None:
        trace.kv_source = holder.worker_id
    return got


async def lease_prefix(backends: dict, holder: WorkerInfo, requester: WorkerInfo,
                       lease_id: str, block_hashes: list[int],
                       timeout: aiohttp.ClientTimeout) -> KVTransferParams | None:
    """`holder`'s signed handle for the longest prefix of `block_hashes` it still holds,
    leased to `requester` under `lease_id`; None where it holds none or does not answer."""
    if not block_hashes:
        return None
    backend = backends[holder.backend]
    body = PrefixExportRequest(request_id=lease_id, requester=requester.worker_id,
                               block_hashes=list(block_hashes))
    try:
        raw = await post_json(backend.http, holder, "/kv/prefix-export", backend.headers,
                              body.model_dump(mode="json", exclude_none=True), timeout,
                              raw_answer=True)
        resp = parse(holder, PrefixExportResponse, raw)
    except (WorkerFailure, RequestRejected) as e:
        log.info("no prefix export from %s (%s); computing the prompt", holder.worker_id, e,
                 extra={"request_id": lease_id})
        return None
    if resp.num_blocks == 0 or resp.kv_transfer_params is None:
        return None
    return resp.kv_transfer_params


def leg_pull(prefix: KVTransferParams | None, plan, w: WorkerInfo, sent: list[int] = ()) -> dict:
    """The backend keyword that hands a compute leg the prefix handle: only the leg to the worker
    it was issued to (`computing_worker(plan)`), before any token was sent (a resume prefills
    prompt and tokens elsewhere)."""
    if prefix is None or w is not computing_worker(plan) or sent:
        return {}
    return {"prefix_kv": prefix}
