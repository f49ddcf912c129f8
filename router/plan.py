"""What a routing policy sees and what it decides: the `RouteContext` of one prompt (each live
worker's leading match, by role) and the `Plan` (which workers compute and decode it, and from
which peer a cached prefix is pulled). The policies themselves: router/policy.py (`kv_aware` and
the table of names) and router/baseline_policies.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from router.reload_cost import PricedHit
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
    # A peer holding a longer leading match, to pull `pull_blocks` leading blocks from before
    # computing (router/peer_pull.py); `pull_hashes`: the prompt's hashes (set by the gateway).
    kv_source: WorkerInfo | None = None
    pull_blocks: int = 0
    pull_hashes: list[int] = field(default_factory=list)
    # Blocks another worker held beyond the computing worker's match (router/pull_metrics.py).
    peer_held_blocks: int = 0


class NoWorkers(RuntimeError):
    pass


class Policy(Protocol):
    def __init__(self, settings: RouterSettings) -> None: ...

    def choose(self, ctx: RouteContext) -> Plan: ...


def plan_of(kind: str, decode: WorkerInfo, prefill: WorkerInfo | None, predicted_s: float,
            hit: PricedHit) -> Plan:
    return Plan(kind, decode, prefill, predicted_s, hit.blocks, hit.counted)


def load_key(w: WorkerInfo) -> tuple:
    # Equal load: the worker with more empty blocks (ties must not all end on one worker id).
    return (w.inflight + w.running() + int(w.load.get("waiting", 0)), w.queued_tokens(),
            -w.headroom()[0], w.worker_id)
