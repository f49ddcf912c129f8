"""The KV-tier workloads (agentic, no-reuse) and the runner's round-robin visits: turn t of every
session before turn t+1 of any, against a real router and worker."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from loadgen import workload
from loadgen.runner import RunConfig, Runner
from testing.cluster import Router, Worker


def test_agentic_sessions_share_long_contexts_and_no_reuse_prompts_share_nothing():
    agents = workload.agentic(12, seed=3, num_contexts=3, context_words=100, steps=4)
    assert len({s.system for s in agents}) == 3
    assert [len(s.turns) for s in agents] == [4] * 12
    assert all(t.user.startswith("Tool output: ") for s in agents for t in s.turns)
    assert len({t.user for s in agents for t in s.turns}) == 48
    assert workload.build("agentic", 2, seed=3)[0].system != workload.build("agentic", 2)[0].system
    fresh = workload.no_reuse(20, seed=1)
    assert len({s.system.split()[0] + s.system.split()[1] for s in fresh}) > 15
    assert [len(s.turns) for s in fresh] == [1] * 20


def test_round_robin_needs_a_concurrency():
    with pytest.raises(ValueError, match="closed loop"):
        asyncio.run(Runner(RunConfig("http://127.0.0.1:9/v1", "m", rate=1.0))
                    .run_round_robin(workload.multi_turn(1)))


@pytest.mark.redis
def test_round_robin_visits_every_session_before_the_next_turn(tiny_folder, tmp_path):
    ns = f"rr-{uuid.uuid4().hex[:6]}"
    w = Worker("colocated", str(tiny_folder), cache_dir=tmp_path, namespace=ns, num_blocks=1024)
    r = Router(tiny_folder, ns, cache_dir=tmp_path)
    try:
        r.wait_workers(1)
        sessions = workload.multi_turn(4, turns=3, system_words=12, user_words=6, max_tokens=4)
        recs = asyncio.run(Runner(RunConfig(f"{r.url}/v1", "tiny-random", concurrency=2))
                           .run_round_robin(sessions, shuffle_seed=5))
        assert [rec.turn for rec in recs] == [0] * 4 + [1] * 4 + [2] * 4
        assert all(sorted(rec.session_id for rec in recs if rec.turn == t) == [0, 1, 2, 3]
                   for t in range(3))
        assert all(rec.error is None and rec.prompt_tokens > 0 for rec in recs)
        # a later turn's prompt is the session's history: its blocks were cached
        later = [rec for rec in recs if rec.turn > 0]
        assert all(rec.timing["num_cached_tokens"] > 0 for rec in later)
        assert all(sum(rec.timing["num_cached_tokens_by_medium"].values())
                   == rec.timing["num_cached_tokens"] for rec in recs)
    finally:
        r.close()
        w.close()
