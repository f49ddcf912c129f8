"""How the router prices a worker's hits in its lower KV tiers: through the real kv_aware policy
(a tier hit counts only where reloading it beats recomputing it, at the worker's measured reload
rate or the seeded multiple of its prefill rate), the reload rates as a registration carries
them (bounded), and the gateway routing on the replica's tiered matches and counting them."""

from __future__ import annotations

import asyncio
import json

import pytest

from common.hashing import BlockHasher
from common.registry import MAX_RELOAD_TOKENS_PER_S, WorkerRegistration
from router.gateway import Gateway
from router.index import ReplicaPrefixIndex
from router.policy import make_policy, plan_for
from router.settings import RouterSettings
from router.tiered_match import MatchByMedium
from router.worker_info import WorkerInfo

BS = 16
PROMPT_TOKENS = 1024  # 64 blocks


def worker(wid: str, role: str = "colocated", reload=None, **kw) -> WorkerInfo:
    return WorkerInfo(wid, role, f"http://{wid}", block_size=BS, prefill_tokens_per_s=1000.0,
                      load={"reload_tokens_per_s": reload or {}}, **kw)


def plan(ws, matches, media, **settings):
    # One worker's own tiers, priced without peer pulls: with them, an idle worker may pull
    # another's tier hit instead (tests/router/test_peer_pull_plan.py).
    settings.setdefault("peer_pulls", False)
    return plan_for(make_policy("kv_aware", RouterSettings(**settings)), PROMPT_TOKENS, matches,
                    ws, PROMPT_TOKENS // BS, BS, media)


def test_a_disk_hit_wins_only_where_reloading_beats_recomputing():
    # `warm` holds 60 of the 64 blocks, on disk; `cold` holds nothing and is less busy.
    matches, media = {"warm": 60}, {"warm": MatchByMedium(0, 0, 60)}
    cold = worker("cold")
    slow = worker("warm", reload={"disk": 500.0})  # slower than its 1000 tok/s prefill
    slow.load["running"] = 2
    p = plan([slow, cold], matches, media)
    # Priced as the recompute it is: no faster than `cold`, which is idle.
    assert p.decode.worker_id == "cold" and p.cached_blocks == 0
    slow_alone = plan([slow], matches, media)
    assert slow_alone.cached_media == MatchByMedium() and slow_alone.cached_blocks == 0
    assert slow_alone.predicted_s == pytest.approx(1.024 * 1.1)  # 1024 tokens, 2 running

    fast = worker("warm", reload={"disk": 20_000.0})
    fast.load["running"] = 2
    p = plan([fast, cold], matches, media)
    assert p.decode.worker_id == "warm" and p.cached_media == MatchByMedium(0, 0, 60)
    # 64 uncached tokens recomputed, 960 reloaded at 20,000 tok/s, x1.1 for the running two.
    assert p.predicted_s == pytest.approx((64 / 1000 + 960 / 20_000) * 1.1)


def test_an_unmeasured_tier_is_priced_at_the_seeded_multiple_of_the_prefill_rate():
    matches, media = {"warm": 60}, {"warm": MatchByMedium(0, 0, 60)}
    warm, cold = worker("warm"), worker("cold")
    warm.load["running"] = 2
    p = plan([warm, cold], matches, media)  # disk at 4x prefill: 4000 tok/s
    assert p.decode.worker_id == "warm"
    assert p.predicted_s == pytest.approx((64 / 1000 + 960 / 4000) * 1.1)
    # Seeded slower than recomputing: the hit does not count.
    p = plan([warm, cold], matches, media, disk_reload_vs_prefill=0.5)
    assert p.decode.worker_id == "cold"
    # The measured rate replaces the seed, whichever way it goes.
    warm.load["reload_tokens_per_s"] = {"disk": 50_000.0}
    assert plan([warm, cold], matches, media, disk_reload_vs_prefill=0.5).decode is warm


def test_a_mixed_run_counts_each_tier_on_its_own_rate():
    # 20 blocks on the device, 20 on the host (fast), 20 on disk (slower than prefill).
    w = worker("w", reload={"host": 40_000.0, "disk": 800.0})
    p = plan([w], {"w": 60}, {"w": MatchByMedium(20, 20, 20)})
    assert p.cached_media == MatchByMedium(20, 20, 0) and p.cached_blocks == 40
    assert p.predicted_s == pytest.approx((1024 - 640) / 1000 + 320 / 40_000)
    # No tiers given: the whole match is on the device, as before tiers.
    p = plan([w], {"w": 60}, None)
    assert p.cached_media == MatchByMedium(60) and p.predicted_s == pytest.approx(64 / 1000)


def test_a_decode_worker_reloads_its_own_tier_blocks_instead_of_pulling_them():
    prefill = worker("p", "prefill")
    d = worker("d", "decode", reload={"host": 40_000.0}, block_bytes=400_000,
               transfer_bytes_per_s=5e6)  # a slow link: 4 MB/s per 10 blocks
    media = {"d": MatchByMedium(0, 64, 0), "p": MatchByMedium(64)}
    p = plan([prefill, d], {"d": 64, "p": 64}, media, conditional_disagg=False)
    # Nothing to pull but the tail: the transfer term is its fixed cost plus the reload.
    assert p.kind == "disagg"
    assert p.predicted_s == pytest.approx(1 / 1000 + 0.005 + 1024 / 40_000)


def test_reload_rates_in_a_registration_are_bounded_not_fatal():
    def load_of(rates) -> WorkerInfo:
        raw = {b"role": b"decode", b"url": b"http://h:1",
               b"load": json.dumps({"running": 1, "reload_tokens_per_s": rates}).encode()}
        reg = WorkerRegistration.from_hash(raw, "h")
        return WorkerInfo("h", reg.role, reg.url, load=reg.load.model_dump())

    w = load_of({"host": 25_000.5, "disk": None, "tape": 9})
    assert (w.reload_tokens_per_s("host"), w.reload_tokens_per_s("disk")) == (25_000.5, None)
    w = load_of({"host": 1e300, "disk": -4})
    assert w.reload_tokens_per_s("host") == MAX_RELOAD_TOKENS_PER_S
    assert w.reload_tokens_per_s("disk") is None
    for bad in ("fast", [1], True, 0, "NaN"):
        assert load_of({"host": bad}).reload_tokens_per_s("host") is None
    assert load_of("everything").reload_tokens_per_s("host") is None
    assert load_of({"host": 1.0}).running() == 1
    assert WorkerInfo("x", "decode", "http://x").reload_tokens_per_s("host") is None


@pytest.fixture
def gateway(tiny_folder):
    gw = Gateway.from_settings(RouterSettings(model="tiny-random", tokenizer_path=tiny_folder,
                                              policy="kv_aware"))
    model = gw.catalog.models["tiny-random"]
    model.identity, model.hasher = ("d" * 16, 4), BlockHasher("d" * 16, 4)
    return gw, model


def test_the_gateway_routes_on_tiered_matches_and_counts_them_by_tier(gateway):
    gw, model = gateway
    prompt = list(range(1, 1 + 4 * 50))  # 50 blocks of 4
    hashes = model.hasher(prompt)
    ws = [WorkerInfo(wid, "colocated", f"http://{wid}", block_size=4,
                     accepted=frozenset({"tiny-random"}), prefill_tokens_per_s=1000.0)
          for wid in ("offloaded", "cold")]
    ws[0].load = {"reload_tokens_per_s": {"host": 50_000.0}, "running": 1}
    gw.directory.workers = {w.worker_id: w for w in ws}
    index = ReplicaPrefixIndex(None, gw.keys)  # the real replica, filled by hand (no feed)
    index.replica.add("offloaded", hashes[:10])
    index.replica.add("offloaded", hashes[10:40], "host")
    gw.index = index
    plan = asyncio.run(gw.route(model, prompt))
    assert plan.decode.worker_id == "offloaded"
    assert plan.cached_media == MatchByMedium(10, 30, 0) and plan.cached_blocks == 40

    def counted(medium: str) -> float:
        return gw.registry.get_sample_value("tandem_router_cached_tokens_total",
                                            {"medium": medium, "model": "tiny-random"})

    assert (counted("device"), counted("host")) == (40.0, 120.0) and not counted("disk")
