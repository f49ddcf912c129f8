"""The routing policies on hand-built worker sets (one layer: no processes)."""

from __future__ import annotations

import pytest

from common.protocol import RequestTiming
from router.dispatch import learn_bandwidth
from router.plan import NoWorkers, RouteContext
from router.policy import make_policy
from router.settings import RouterSettings
from router.worker_info import WorkerInfo

BS = 16


def ctx(num_tokens, matches, prefill=(), decode=(), colocated=()):
    return RouteContext(num_tokens, num_tokens // BS, matches, list(prefill), list(decode),
                        list(colocated), BS)


def worker(wid, role, **kw):
    w = WorkerInfo(wid, role, f"http://{wid}", block_size=BS, prefill_tokens_per_s=1000.0)
    for k, v in kw.items():
        setattr(w, k, v)
    return w


def policy(**settings):
    return make_policy("kv_aware", RouterSettings(**settings))


def test_kv_aware_prefills_where_the_prompt_is_cached():
    p1, p2, d = worker("p1", "prefill"), worker("p2", "prefill"), worker("d", "decode")
    plan = policy().choose(ctx(1024, {"p2": 56}, [p1, p2], [d]))
    assert (plan.kind, plan.prefill.worker_id, plan.cached_blocks) == ("disagg", "p2", 56)
    # The same prompt cached nowhere: the less loaded prefill worker.
    p2.load = {"waiting_tokens": 4000}
    assert policy().choose(ctx(1024, {}, [p1, p2], [d])).prefill.worker_id == "p1"


def test_conditional_disaggregation_and_its_switch():
    p, d = worker("p", "prefill"), worker("d", "decode")
    held = {"d": 60, "p": 60}  # the decode worker holds 960 of 1000 tokens (the conversation)
    assert policy().choose(ctx(1000, held, [p], [d])).kind == "decode_local"
    assert policy(conditional_disagg=False).choose(ctx(1000, held, [p], [d])).kind == "disagg"
    # Holding too little of the prompt: prefill belongs on the prefill pool.
    assert policy().choose(ctx(1000, {"d": 10}, [p], [d])).kind == "disagg"


def test_a_backed_up_prefill_pool_is_routed_around():
    """Local prefill for any prompt once the prefill queue is longer than the prompt itself, as
    long as the stall it costs the decode worker's streams is cheaper than the wait."""
    p, d = worker("p", "prefill"), worker("d", "decode")
    assert policy().choose(ctx(800, {}, [p], [d])).kind == "disagg"  # idle pool: disaggregate
    p.load = {"waiting_tokens": 4000}  # 4 s of queue at 1000 tok/s
    assert policy().choose(ctx(800, {}, [p], [d])).kind == "decode_local"
    assert (policy(local_prefill_when_backed_up=False).choose(ctx(800, {}, [p], [d])).kind
            == "disagg")
    assert policy(conditional_disagg=False).choose(ctx(800, {}, [p], [d])).kind == "disagg"
    # Many streams running on D: 0.8 s of stall for each of 8 is dearer than the 4 s queue.
    d.load = {"running": 8}
    assert policy().choose(ctx(800, {}, [p], [d])).kind == "disagg"
    # A queue shorter than the prompt is not a backlog: the prompt belongs on the prefill pool.
    d.load, p.load = {}, {"waiting_tokens": 700}
    assert policy().choose(ctx(800, {}, [p], [d])).kind == "disagg"


def test_transfer_is_charged_at_the_measured_bandwidth():
    p = worker("p", "prefill")
    slow = worker("d-slow", "decode", transfer_bytes_per_s=5e6, block_bytes=400_000)
    fast = worker("d-fast", "decode", transfer_bytes_per_s=5e9, block_bytes=400_000)
    plan = policy().choose(ctx(2048, {}, [p], [slow, fast]))
    assert plan.decode.worker_id == "d-fast"
    # 128 blocks x 400 kB at 5 MB/s is ~10 s: on that link alone, local prefill of the whole
    # prompt (~2 s at 1000 tok/s) beats fetching it, even though D holds nothing.
    only_slow = policy(local_prefill_min_cached_fraction=0.0,
                       local_prefill_max_uncached_tokens=10_000)
    assert only_slow.choose(ctx(2048, {}, [p], [slow])).kind == "decode_local"
    # An unmeasured worker gets the fleet's measured figure, not the optimistic default.
    new = worker("d-new", "decode", block_bytes=400_000)
    plan = policy(conditional_disagg=False).choose(ctx(2048, {}, [p], [slow, new]))
    # ~2 s prefill + ~10 s pull; at the 2 GB/s default it would be ~2 s
    assert plan.predicted_s > 10


def test_measured_bandwidth_is_an_ewma_of_real_pulls():
    d = worker("d", "decode")
    learn_bandwidth(d, RequestTiming(transfer_bytes=10 << 20, transfer_s=0.01))
    assert d.transfer_bytes_per_s == pytest.approx((10 << 20) / 0.01)
    learn_bandwidth(d, RequestTiming(transfer_bytes=10 << 20, transfer_s=0.02))
    assert (d.transfer_bytes_per_s
            == pytest.approx(0.8 * (10 << 20) / 0.01 + 0.2 * (10 << 20) / 0.02))
    before = d.transfer_bytes_per_s
    # tiny pull: all fixed cost
    learn_bandwidth(d, RequestTiming(transfer_bytes=4096, transfer_s=0.5))
    learn_bandwidth(d, RequestTiming())
    assert d.transfer_bytes_per_s == before


def test_near_ties_go_to_the_less_loaded_decode_worker():
    p = worker("p", "prefill")
    d1 = worker("d1", "decode", load={"running": 6})
    d2 = worker("d2", "decode", load={"running": 1})
    assert policy().choose(ctx(256, {}, [p], [d1, d2])).decode.worker_id == "d2"


def test_pools_missing():
    d, c = worker("d", "decode"), worker("c", "colocated")
    assert policy().choose(ctx(64, {}, [], [d])).kind == "decode_local"
    assert policy().choose(ctx(64, {}, [], [], [c])).kind == "colocated"
    for name in ("kv_aware", "round_robin", "least_loaded", "random"):
        with pytest.raises(NoWorkers):
            make_policy(name, RouterSettings()).choose(ctx(64, {}, [worker("p", "prefill")], []))
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest", RouterSettings())


def test_round_robin_alternates_and_least_loaded_picks_the_idle():
    p1, p2, d = worker("p1", "prefill"), worker("p2", "prefill"), worker("d", "decode")
    rr = make_policy("round_robin", RouterSettings())
    assert [rr.choose(ctx(64, {}, [p1, p2], [d])).prefill.worker_id for _ in range(4)] == \
        ["p1", "p2", "p1", "p2"]
    p1.inflight = 3
    assert make_policy("least_loaded", RouterSettings()).choose(
        ctx(64, {}, [p1, p2], [d])).prefill.worker_id == "p2"


def _brute_force(pol, c: RouteContext):
    """kv_aware as every (prefill, decode) pair: the definition the two-pass search must match."""
    s = pol.s
    pol.choose(c)  # sets the fleet figures
    cands = []
    for d in c.decode:
        held = c.matches.get(d.worker_id, 0)
        if not c.prefill or (s.conditional_disagg
                             and c.num_tokens - held * BS <= s.local_prefill_max_uncached_tokens
                             and held * BS >= s.local_prefill_min_cached_fraction * c.num_tokens):
            t, hit = pol._prefill_s(d, c)
            cands.append((t * (1 + s.local_prefill_interference * d.running())
                          + pol._landing_s(d, c, hit), "decode_local", _key(d), d.worker_id,
                          None))
        elif (s.local_prefill_when_backed_up
                and min(p.queued_tokens() for p in c.prefill) >= c.num_tokens - held * BS):
            # The prefill pool is backed up: local prefill priced with the stall it imposes.
            t, hit = pol._prefill_s(d, c)
            stall = d.running() * (c.num_tokens - held * BS) / pol._rate(d)
            cands.append((t * (1 + s.local_prefill_interference * d.running())
                          + s.local_prefill_stall_weight * stall + pol._landing_s(d, c, hit),
                          "decode_local", _key(d), d.worker_id, None))
        missing = max(c.num_blocks - held, 0) + (c.num_tokens % BS > 0)
        bw = d.transfer_bytes_per_s or pol._fleet_bw or s.default_transfer_bytes_per_s
        td = (s.transfer_weight
              * (s.transfer_fixed_s + missing * (d.block_bytes or s.bytes_per_block) / bw))
        # the decode worker takes the prompt's blocks, and a stream more (its batch's growth)
        td += pol._landing_s(d, c, pol._hit(d, c))
        for p in c.prefill:
            t, hit = pol._prefill_s(p, c)
            cands.append((t + pol._evict_s(p, c, hit) + td, "disagg", _key(p) + _key(d),
                          d.worker_id, p.worker_id))
    best = min(x[0] for x in cands)
    near = sorted((x for x in cands if x[0] <= best + s.near_tie_s),
                  key=lambda x: (x[1] != "disagg", x[2], x[0]))
    return near[0][1], near[0][3], near[0][4]


def _key(w):
    from router.plan import load_key as _load_key
    return _load_key(w)


def _cache(rng) -> dict:
    """A random cache fill as a worker reports it (none, roomy, full of cached blocks)."""
    free = rng.choice([0, 40, 100])
    return {"free_blocks": free, "evictable_blocks": rng.randint(0, free)} if free else {}


def test_two_pass_search_equals_every_pair():
    import random

    rng = random.Random(7)
    pol = policy()
    for _ in range(400):
        ps = [worker(f"p{i}", "prefill", prefill_tokens_per_s=rng.choice([None, 800.0, 1200.0]),
                     load={"waiting_tokens": rng.choice([0, 0, 100, 900]),
                           "running": rng.randint(0, 3), **_cache(rng)})
              for i in range(rng.randint(0, 5))]
        ds = [worker(f"d{i}", "decode", transfer_bytes_per_s=rng.choice([None, 5e7, 2e9]),
                     load={"running": rng.randint(0, 8), **_cache(rng)},
                     inflight=rng.randint(0, 2))
              for i in range(rng.randint(1, 5))]
        n = rng.randint(1, 1200)
        matches = {w.worker_id: rng.randint(0, n // BS) for w in ps + ds if rng.random() < 0.6}
        c = ctx(n, matches, ps, ds)
        plan = pol.choose(c)
        assert ((plan.kind, plan.decode.worker_id, plan.prefill and plan.prefill.worker_id)
                == _brute_force(pol, c))
