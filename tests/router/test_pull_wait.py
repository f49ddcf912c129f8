"""A peer pull priced from the holder's load now (router/pull_wait.py), and the fabric taught the
link apart from the holder's wait (router/fabric.py, router/pull_metrics.py): through the real
`plan_for` and `kv_aware` on hand-built worker sets (one layer: no processes)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from router.fabric import Fabric
from router.plan import Plan
from router.policy import make_policy, plan_for
from router.pull_metrics import PullMetrics
from router.pull_wait import STEP_TOKENS, ExportWait, step_s
from router.settings import RouterSettings
from tests.router.hand_built import BS, worker

LINE = (0.066, 0.0064)


def plan(num_tokens, matches, live, policy=None):
    policy = policy or make_policy("kv_aware", RouterSettings())
    return plan_for(policy, num_tokens, matches, live, num_tokens // BS, BS)


def test_the_step_a_worker_is_in_follows_its_load():
    assert step_s(worker("idle"), 1000.0, LINE) == 0.0
    decoding = worker("d", load={"running": 10})
    assert step_s(decoding, 1000.0, LINE) == pytest.approx(0.066 + 0.064)
    # Its own fitted line where the planner has one.
    decoding.decode_step = (0.01, 0.001)
    assert step_s(decoding, 1000.0, LINE) == pytest.approx(0.02)
    # Prompts queued: one step prefills at most STEP_TOKENS of them, beside the decodes.
    backed_up = worker("p", load={"waiting_tokens": 50_000, "running": 1})
    assert step_s(backed_up, 1000.0, LINE) == pytest.approx(STEP_TOKENS / 1000 + 0.0724)
    # The router's own count where no report shows the queue yet.
    routed = worker("r", inflight=2, inflight_tokens=500)
    assert step_s(routed, 1000.0, LINE) == pytest.approx(0.5 + 0.066 + 2 * 0.0064)


def test_a_holder_in_a_long_prefill_step_is_not_pulled_from_for_a_short_prefix():
    """The spread arm's case (docs/benchmarks.md): a conversation moved off its busy home used to
    pull its ~700-token history at 5 ms plus its bytes, and waited a second for the home's
    prefill step instead. Recomputing 720 tokens (0.72 s) beats waiting half of a 2,048-token
    step (about 1.06 s): no pull."""
    home = worker("a", load={"waiting_tokens": 20_000})
    idle = worker("b")
    p = plan(800, {"a": 45}, [home, idle])
    assert p.decode is idle and p.kv_source is None and p.peer_held_blocks == 45
    # A long prefix is still worth the wait: 3,840 tokens recomputed take 3.8 s.
    p = plan(4000, {"a": 240}, [home, idle])
    assert p.decode is idle and p.kv_source is home and p.pull_blocks == 240
    assert p.export_wait_s == pytest.approx(step_s(home, 1000.0, LINE) / 2)


def test_an_idle_holder_is_pulled_from_where_a_busy_one_is_not():
    """Two holders of the same prefix; the computing worker pulls from the one that answers now."""
    c = worker("c")
    prefilling = worker("h1", load={"waiting_tokens": 20_000})  # a 2 s step
    decoding = worker("h2", load={"running": 30, "waiting_tokens": 200_000},
                      prefill_tokens_per_s=100_000.0)  # fast: a 0.3 s step
    p = plan(1600, {"h1": 90, "h2": 80}, [c, prefilling, decoding])
    assert p.decode is c and p.kv_source is decoding and p.pull_blocks == 80


def test_what_exports_take_beyond_their_predicted_wait_is_learned_and_priced():
    policy = make_policy("kv_aware", RouterSettings())
    holder, idle = worker("a", load={"waiting_tokens": 20_000}), worker("b")
    assert plan(2400, {"a": 140}, [holder, idle], policy).kv_source is holder
    # Exports that took 2 s more than predicted: a 2,240-token prefix (2.2 s) is recomputed.
    for _ in range(10):
        policy.fabric.export.learn(3.0, 1.0)
    assert policy.fabric.export.excess_s == pytest.approx(2.0)
    p = plan(2400, {"a": 140}, [holder, idle], policy)
    assert p.decode is idle and p.kv_source is None
    # Faster than predicted counts as no excess; nonsense teaches nothing.
    w = ExportWait()
    w.learn(0.1, 1.0)
    w.learn(float("inf"), 0.0)
    assert w.excess_s == 0.0 and w.num_exports == 1


def test_the_link_is_learned_from_the_puller_s_side_and_the_export_apart():
    """A pull whose holder's export waited 4 s for a step, then moved its blocks in 20 ms: the
    pair learns 20 ms (the next pull from it, idle by then, is not priced at 4 s), and the
    exports learn the 3.5 s they took beyond the 0.5 s predicted."""
    fabric = Fabric()
    metrics = PullMetrics(CollectorRegistry(), fabric)
    holder, puller = worker("a"), worker("b")
    p = Plan("decode_local", puller, kv_source=holder, pull_blocks=4, export_wait_s=0.5)
    metrics.leg(p, puller, "m", 64, 400_000, 0.02, export_s=4.0)
    assert fabric.link("#a", "#b").fixed_s == pytest.approx(0.02)
    assert fabric.export.excess_s == pytest.approx(3.5)


def test_pairs_of_workers_without_localities_share_what_they_have_measured():
    """Workers without a locality are keyed per worker: a pair not measured yet is priced at what
    the others have measured (nothing else is known of its link), not at the 5 ms seed, so each
    new pair does not pay for its first pulls."""
    f = Fabric(fixed_s=0.005)
    assert f.pull_s("#a", "#c", 0, 1e9) == pytest.approx(0.005)
    f.learn("#a", "#b", 64 << 10, 0.8)
    assert f.pull_s("#a", "#c", 0, 1e9) == pytest.approx(0.8)
    assert f.pull_s("#c", "#b", 0, 1e9) == pytest.approx(0.8)
    # Its own measurements win once it has them.
    f.learn("#a", "#c", 64 << 10, 0.1)
    assert f.pull_s("#a", "#c", 0, 1e9) == pytest.approx(0.1)
    # Localised pairs and P/D transfers between workers without localities keep their seeds.
    assert f.pull_s("z/r/a", "z/r/b", 0, 1e9) == pytest.approx(0.005)
    assert f.pull_s("", "", 0, 1e9) == pytest.approx(0.005)
