"""A peer pull priced at what exports take (router/export_time.py), whatever the holder's load,
and the fabric taught the link apart from the holder's export (router/fabric.py,
router/pull_metrics.py): through the real `plan_for` and `kv_aware` on hand-built worker sets
(one layer: no processes)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from router.export_time import MAX_EXPORT_S, ExportTime
from router.fabric import Fabric
from router.plan import Plan
from router.policy import make_policy, plan_for
from router.pull_metrics import PullMetrics
from router.settings import RouterSettings
from tests.router.hand_built import BS, worker


def plan(num_tokens, matches, live, policy=None):
    policy = policy or make_policy("kv_aware", RouterSettings())
    return plan_for(policy, num_tokens, matches, live, num_tokens // BS, BS)


def test_a_holder_in_a_long_prefill_step_is_pulled_from():
    """The spread arm's case (docs/benchmarks.md): a conversation moved off its busy home pulls
    its ~700-token history, since the home answers the export in the middle of its prefill step
    (engine/llm_engine.py `MID_STEP_METHODS`): recomputing 720 tokens (0.72 s) loses to the link's
    5 ms and the blocks' bytes."""
    home = worker("a", load={"waiting_tokens": 20_000})
    idle = worker("b")
    p = plan(800, {"a": 45}, [home, idle])
    assert p.decode is idle and p.kv_source is home and p.pull_blocks == 45


def test_what_exports_take_is_learned_and_priced():
    policy = make_policy("kv_aware", RouterSettings())
    holder, idle = worker("a", load={"waiting_tokens": 20_000}), worker("b")
    assert plan(2400, {"a": 140}, [holder, idle], policy).kv_source is holder
    # Exports that took 2.5 s: a 2,240-token prefix (2.24 s) is recomputed.
    for _ in range(10):
        policy.fabric.export.learn(2.5)
    assert policy.fabric.export.seconds == pytest.approx(2.5)
    p = plan(2400, {"a": 140}, [holder, idle], policy)
    assert p.decode is idle and p.kv_source is None and p.peer_held_blocks == 140
    # A long prefix is still worth it: 3,840 tokens recomputed take 3.8 s.
    p = plan(4000, {"a": 240}, [holder, idle], policy)
    assert p.kv_source is holder and p.pull_blocks == 240
    # Nonsense teaches nothing; one stuck export teaches at most MAX_EXPORT_S.
    t = ExportTime()
    t.learn(float("inf"))
    t.learn(-1.0)
    assert t.num_exports == 0
    t.learn(1e3)
    assert t.seconds == MAX_EXPORT_S and t.num_exports == 1


def test_the_link_is_learned_from_the_puller_s_side_and_the_export_apart():
    """A pull whose holder took 4 s to answer its export, then moved its blocks in 20 ms: the pair
    learns 20 ms (the next pull over that link is not priced at 4 s), the exports learn 4 s."""
    fabric = Fabric()
    metrics = PullMetrics(CollectorRegistry(), fabric)
    holder, puller = worker("a"), worker("b")
    p = Plan("decode_local", puller, kv_source=holder, pull_blocks=4)
    metrics.leg(p, puller, "m", 64, 400_000, 0.02, export_s=4.0)
    assert fabric.link("#a", "#b").fixed_s == pytest.approx(0.02)
    assert fabric.export.seconds == pytest.approx(4.0)


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
