"""Localities and the fabric (common/locality.py, router/fabric.py), and peer pulls priced per
locality pair through the real `plan_for` and `kv_aware` (one layer: no processes; the pulls
over a real rate-limited link are tests/router/test_topology_link.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from common.locality import link_class
from common.registry import WorkerRegistration
from router.fabric import MIN_BANDWIDTH_BYTES, Fabric, endpoint
from router.peer_pull import MAX_SOURCES, sources
from router.plan import RouteContext
from router.policy import make_policy, plan_for
from router.pull_metrics import MAX_PAIR_SERIES, PullMetrics
from router.settings import RouterSettings
from router.worker_info import WorkerInfo

BS = 16
BLOCK = 1 << 20  # 1 MiB blocks: a 100-block pull is 100 MiB


def worker(wid, locality="", role="decode", **kw):
    w = WorkerInfo(wid, role, f"http://{wid}", block_size=BS, prefill_tokens_per_s=1000.0,
                   digest="0123456789abcdef", block_bytes=BLOCK, locality=locality)
    for k, v in kw.items():
        setattr(w, k, v)
    return w


@pytest.mark.parametrize("src,dst,cls", [
    ("z/r/n1", "z/r/n1", "same_node"),
    ("z/r/n1", "z/r/n2", "same_rack"),
    ("z/r1/n1", "z/r2/n1", "same_zone"),
    ("z1/r/n", "z2/r/n", "cross_zone"),
    ("n1", "n2", "cross_zone"),  # one level: nothing shared that the paths say
    ("z/r/n", "z/r", "cross_zone"),  # different depths
    ("", "z/r/n", "unknown"),
])
def test_link_classes(src, dst, cls):
    assert link_class(src, dst) == cls


@pytest.mark.parametrize("bad", ["a b", "/a", "a//b", "a/b/c/d/e", "-a", "a" * 254, "a\nb"])
def test_a_malformed_locality_is_refused_in_a_registration(bad):
    with pytest.raises(ValidationError):
        WorkerRegistration(role="decode", url="http://w:1", locality=bad)
    assert WorkerRegistration(role="decode", url="http://w:1", locality="z-1/r.2/node_3")


def test_the_fabric_learns_fixed_cost_and_bandwidth_per_pair():
    f = Fabric(fixed_s=0.005)
    assert f.pull_s("a/x", "a/y", 10e6, fallback_bytes_per_s=1e9) == pytest.approx(0.015)
    f.learn("a/x", "a/y", 64 << 10, 0.002)  # small: fixed cost
    assert f.link("a/x", "a/y").fixed_s == pytest.approx(0.002)
    big = 100 * MIN_BANDWIDTH_BYTES
    f.learn("a/x", "a/y", big, big / 50e6)  # as fast as the link goes
    link = f.link("a/x", "a/y")
    assert link.bytes_per_s == pytest.approx(50e6) and link.num_pulls == 2
    # Pulls slowed by something else (the holder's engine step, a queue): the pair is priced at
    # what such a pull takes, with part of it learned as fixed cost, so a small pull is not
    # priced as free.
    for _ in range(10):
        f.learn("a/x", "a/y", big, big / 50e6 + 3.0)
    link = f.link("a/x", "a/y")
    assert f.pull_s("a/x", "a/y", big, 1e9) == pytest.approx(big / 50e6 + 3.0, rel=0.15)
    assert f.pull_s("a/x", "a/y", 1 << 20, 1e9) > 1.0
    # The reverse direction is not learned.
    assert f.pull_s("a/y", "a/x", 50e6, 1e9) == pytest.approx(0.055)
    # A link that got slower for good: its pulls are priced at what they take again.
    for _ in range(20):
        f.learn("a/x", "a/y", big, big / 10e6)
    assert f.pull_s("a/x", "a/y", big, 1e9) == pytest.approx(big / 10e6, rel=0.15)
    assert f.link("a/x", "a/y").bytes_per_s < 30e6


def test_unknown_localities_and_nonsense_are_not_learned_and_pairs_are_bounded():
    f = Fabric(max_pairs=3)
    assert f.learn("", "a/b", 10 << 20, 1.0) is None
    assert f.learn("a/b", "a/c", 0, 1.0) is None and f.learn("a/b", "a/c", 10 << 20, 0) is None
    assert f.learn("a/b", "a/c", 10 << 20, float("inf")) is None
    for i in range(5):
        f.learn(f"z/n{i}", "z/d", 10 << 20, 1.0)
    assert [src for src, _, _ in f.links()] == ["z/n2", "z/n3", "z/n4"]


def test_seeds_per_link_class_price_pairs_until_measured():
    s = RouterSettings(link_same_rack_bytes_per_s=40e9, link_cross_zone_bytes_per_s=1e9)
    f = Fabric.from_settings(s)
    assert f.pull_s("z/r/a", "z/r/b", 40e9, 2e9) == pytest.approx(s.transfer_fixed_s + 1)
    assert f.pull_s("z1/r/a", "z2/r/b", 1e9, 2e9) == pytest.approx(s.transfer_fixed_s + 1)
    # No seed for the class, or no locality: the destination's rate, as before localities.
    assert f.pull_s("z/r1/a", "z/r2/b", 2e9, 2e9) == pytest.approx(s.transfer_fixed_s + 1)
    assert f.pull_s("", "z/r/b", 2e9, 2e9) == pytest.approx(s.transfer_fixed_s + 1)
    with pytest.raises(ValueError, match="unknown link classes"):
        Fabric({"same_planet": 1.0})


def plan(num_tokens, matches, live, policy):
    return plan_for(policy, num_tokens, matches, live, num_tokens // BS, BS)


def test_the_near_holder_is_pulled_from_and_over_a_slow_link_the_prompt_is_recomputed():
    busy = {"waiting_tokens": 100_000}
    c = worker("c", "z/r1/n1")
    near = worker("near", "z/r1/n2", load=busy)  # same rack, a shorter match
    far = worker("far", "z/r9/n9", load=busy)  # another rack, a longer match
    policy = make_policy("kv_aware", RouterSettings(link_same_rack_bytes_per_s=40e9,
                                                    link_same_zone_bytes_per_s=0.5e9))
    # 3,200-token prompt, blocks of 1 MiB: far's 150 blocks take 0.31 s over 0.5 GB/s, near's
    # 140 blocks 4 ms over 40 GB/s; recomputing the 10 blocks near lacks costs 0.16 s.
    p = plan(3200, {"near": 140, "far": 150}, [c, near, far], policy)
    assert p.decode is c and p.kv_source is near and p.pull_blocks == 140
    # Learned: the same-rack link is slow after all (1 MB/s): far's is now cheaper.
    for _ in range(20):
        policy.fabric.learn("z/r1/n2", "z/r1/n1", 100 << 20, 100.0)
    p = plan(3200, {"near": 140, "far": 150}, [c, near, far], policy)
    assert p.kv_source is far
    # Every link slow: recomputing 3,200 tokens (3.2 s) beats pulling 150 MiB at 1 MB/s.
    for _ in range(20):
        policy.fabric.learn("z/r9/n9", "z/r1/n1", 100 << 20, 100.0)
    p = plan(3200, {"near": 140, "far": 150}, [c, near, far], policy)
    assert p.decode is c and p.kv_source is None and p.peer_held_blocks == 150


def test_sources_keep_the_longest_two_and_the_longest_of_each_other_locality():
    ws = [worker(f"w{i}", f"z/r/n{i % 40}") for i in range(80)]
    matches = {w.worker_id: 1000 - i for i, w in enumerate(ws)}
    ctx = RouteContext(3200, 200, matches, [], ws, [], BS)
    got = sources(ctx)
    assert got[:2] == ws[:2] and len(got) == MAX_SOURCES
    assert len({w.locality for w in got}) == MAX_SOURCES  # w40, w41 share w0's and w1's
    assert got[2:] == ws[2:MAX_SOURCES]


def test_pull_metrics_count_by_pair_and_bound_their_series():
    reg = CollectorRegistry()
    m = PullMetrics(reg, Fabric())
    src, dst = worker("a", "z/r/a"), worker("b", "z/r/b")
    m.record(src, dst, 160, 10 << 20, 0.5)
    labels = {"src_locality": "z/r/a", "dst_locality": "z/r/b"}
    assert reg.get_sample_value("tandem_router_peer_pulled_tokens_total", labels) == 160
    assert reg.get_sample_value("tandem_router_peer_pulled_bytes_total", labels) == 10 << 20
    assert reg.get_sample_value("tandem_router_link_bytes_per_second", labels) > 0
    for i in range(MAX_PAIR_SERIES + 5):
        m.record(worker(f"s{i}", f"z/r/s{i}"), dst, 16, 1 << 10, 0.01)
    other = {"src_locality": "other", "dst_locality": "other"}
    assert reg.get_sample_value("tandem_router_peer_pulled_tokens_total", other) == 16 * 6


def test_a_pd_transfer_is_priced_per_locality_pair_and_learned():
    # A 3,200-token prompt moves 200 MiB to the decode worker (blocks of 1 MiB).
    d = worker("d", "z/r1/n1")
    near = worker("p-near", "z/r1/n2", role="prefill", load={"waiting_tokens": 200})
    far = worker("p-far", "z/r9/n9", role="prefill")  # idle, but another rack
    settings = RouterSettings(link_same_rack_bytes_per_s=40e9, link_same_zone_bytes_per_s=0.5e9)
    policy = make_policy("kv_aware", settings)
    # far: 3.2 s of prefill + 0.42 s over 0.5 GB/s; near: 0.2 s more queue + 5 ms.
    p = plan(3200, {}, [d, near, far], policy)
    assert p.kind == "disagg" and p.prefill is near and p.decode is d
    # Without localities the link is the decode worker's own rate: the idle one wins.
    flat = [worker("d", role="decode"), worker("p-near", role="prefill",
                                               load={"waiting_tokens": 200}),
            worker("p-far", role="prefill")]
    assert plan(3200, {}, flat, make_policy("kv_aware", settings)).prefill is flat[2]
    # The P/D transfers the decode worker reports teach the pair: the same-rack link turns
    # out slow (10 MB/s), so the far prefill worker wins; the counters of peer pulls stay 0.
    reg = CollectorRegistry()
    metrics = PullMetrics(reg, policy.fabric)
    for _ in range(3):
        metrics.transfer(near, d, 100 << 20, 10.0)
    assert policy.fabric.link("z/r1/n2", "z/r1/n1").bytes_per_s == pytest.approx(
        (100 << 20) / 10.0)
    assert plan(3200, {}, [d, near, far], policy).prefill is far
    labels = {"src_locality": "z/r1/n2", "dst_locality": "z/r1/n1"}
    assert reg.get_sample_value("tandem_router_link_bytes_per_second", labels) > 0
    assert reg.get_sample_value("tandem_router_peer_pulled_tokens_total", labels) is None


def test_prefill_localities_are_bounded_per_decision():
    from router.policy import MAX_PREFILL_LOCALITIES

    d = worker("d", "z/r0/n0")
    prefill = [worker(f"p{i}", f"z/r{i}/n{i}", role="prefill",
                      load={"waiting_tokens": 100 * i}) for i in range(1, 12)]
    policy = make_policy("kv_aware", RouterSettings(link_same_zone_bytes_per_s=1e9))
    priced = [policy._priced_prefill(p, RouteContext(3200, 200, {}, prefill, [d], [], BS))
              for p in prefill]
    kept = policy._nearest_localities(priced)
    assert [e[2] for e in kept] == prefill[:MAX_PREFILL_LOCALITIES]  # the least queued
    assert plan(3200, {}, [d, *prefill], policy).prefill is prefill[0]


def test_without_localities_each_worker_pair_learns_its_pulls():
    # A CPU cluster started without --locality: a pull waits on both workers' engine steps.
    c, holder = worker("c"), worker("h", load={"waiting_tokens": 100_000})
    assert endpoint(c) == "#c" and endpoint(worker("x", "z/r/n")) == "z/r/n"
    policy = make_policy("kv_aware", RouterSettings(link_cross_zone_bytes_per_s=1e12))
    assert policy.fabric.pull_s("#h", "#c", 1e9, 1e9) == pytest.approx(
        policy.s.transfer_fixed_s + 1.0)  # no link class, so no seed
    p = plan(3200, {"h": 150}, [c, holder], policy)
    assert p.decode is c and p.kv_source is holder
    reg = CollectorRegistry()
    metrics = PullMetrics(reg, policy.fabric)
    for _ in range(10):  # 150 MiB pulls that each took 30 s as the request felt them
        metrics.record(holder, c, 2400, 150 << 20, 30.0)
    assert policy.fabric.link("#h", "#c").bytes_per_s == pytest.approx((150 << 20) / 30.0)
    assert policy.fabric.link("#h", "#o") is None  # another pair learned nothing
    p = plan(3200, {"h": 150}, [c, holder], policy)
    assert p.decode is c and p.kv_source is None and p.peer_held_blocks == 150
    labels = {"src_locality": "unknown", "dst_locality": "unknown"}
    assert reg.get_sample_value("tandem_router_peer_pulled_tokens_total", labels) == 24000
    assert reg.get_sample_value("tandem_router_link_bytes_per_second", labels) is None
