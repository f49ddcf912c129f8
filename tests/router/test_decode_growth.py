"""kv_aware prices a decode worker's batch growth (router/decode_growth.py): a placement that
takes its decode worker's predicted step past the ITL SLO is charged for it, so that a session's
next turn and a new session's cached system prompt stop piling onto a decode worker running far
more streams than fit the SLO, and go to one with room (an added worker gets its share)."""

from __future__ import annotations

import pytest

from router.decode_growth import batch_after, fleet_step_line, growth_s
from router.plan import RouteContext
from router.policy import make_policy
from router.settings import RouterSettings
from router.worker_info import WorkerInfo

BS = 16
# The H200 profile's SLO and decode step line (sim/profiles/h200-llama3-8b.json): a step of
# 8 ms + 2.7 ms per stream, within 60 ms up to a batch of 19; no peer pulls (as the simulator).
H200 = {"slo_itl": 0.06, "planner_decode_step_base_s": 0.008,
        "planner_decode_step_per_seq_s": 0.0027, "default_prefill_tokens_per_s": 15000.0,
        "bytes_per_block": 2 << 20, "default_transfer_bytes_per_s": 50e9, "peer_pulls": False}


def worker(wid: str, role: str, running: int = 0, **kw) -> WorkerInfo:
    w = WorkerInfo(wid, role, f"http://{wid}", block_size=BS, prefill_tokens_per_s=15000.0,
                   load={"running": running} if running else {})
    for k, v in kw.items():
        setattr(w, k, v)
    return w


def choose(num_tokens: int, matches: dict[str, int], prefill, decode, **settings):
    s = RouterSettings(**{**H200, **settings})
    return make_policy("kv_aware", s).choose(
        RouteContext(num_tokens, num_tokens // BS, matches, list(prefill), list(decode), [], BS))


def test_the_growth_past_the_itl_slo_is_charged_and_within_it_is_free():
    s = RouterSettings(**H200)
    line = fleet_step_line([], s)
    assert line == (0.008, 0.0027)
    assert growth_s(worker("d", "decode", running=18), line, s) == 0.0  # 8 + 2.7 * 19 < 60 ms
    # 30 running: 8 + 2.7 * 31 = 91.7 ms a step, 31.7 ms past the SLO for each of 256 tokens.
    assert growth_s(worker("d", "decode", running=30), line, s) == pytest.approx(0.0317 * 256)
    assert growth_s(worker("d", "decode", running=30), line,
                    RouterSettings(**H200, decode_growth_tokens=0)) == 0.0
    # The batch counts what this router sent there and no report shows yet.
    assert batch_after(worker("d", "decode", running=2, inflight=25)) == 26
    assert batch_after(worker("d", "decode", running=20, inflight=3)) == 21
    # The planner's fitted line, where it has set one, over the configured one; a worker
    # without one gets its fleet's.
    fitted = worker("d1", "decode", running=4, decode_step=(0.03, 0.01))
    assert growth_s(fitted, line, s) == pytest.approx((0.03 + 0.05 - 0.06) * 256)
    assert fleet_step_line([fitted, worker("d2", "decode")], s) == (0.03, 0.01)


def test_a_sessions_next_turn_leaves_a_decode_worker_past_the_slo():
    """Its history (~2,200 tokens) on the busy worker: there the fewest KV blocks move (or it
    prefills the new turn itself), but a 31st stream there runs every step past the SLO; on the
    idle worker, its KV moves in a few milliseconds more."""
    p = worker("p", "prefill")
    busy, idle = worker("busy", "decode", running=30), worker("idle", "decode")
    held = {"busy": 140, "p": 125}
    before = choose(2400, held, [p], [busy, idle], decode_growth_tokens=0)
    assert before.decode.worker_id == "busy"
    # Fewer streams there, and it prefills the turn itself.
    busy.load = {"running": 10}
    before = choose(2400, held, [p], [busy, idle], decode_growth_tokens=0, near_tie_s=0.0)
    assert (before.kind, before.decode.worker_id) == ("decode_local", "busy")
    busy.load = {"running": 30}
    plan = choose(2400, held, [p], [busy, idle])
    assert (plan.kind, plan.decode.worker_id) == ("disagg", "idle")
    # The prediction is still a time to first token: the charge is not in it.
    assert plan.predicted_s < 0.2
    # Within the SLO, the history decides.
    busy.load = {"running": 12}
    assert choose(2400, held, [p], [busy, idle]).decode.worker_id == "busy"


def test_a_new_session_leaves_a_busy_holder_of_its_system_prompt():
    """A new session's system prompt (2,000 tokens) cached on the busy decode worker only: its
    KV transfer there is the shortest (beyond the near-tie band), but the worker runs past the
    SLO; the streams this router routed there count before any report shows them."""
    p, busy, idle = worker("p", "prefill"), worker("busy", "decode"), worker("idle", "decode")
    held = {"busy": 125, "p": 125}
    busy.inflight = 25  # routed there, still prefilling or not yet reported
    settings = {"near_tie_s": 0.002, "default_transfer_bytes_per_s": 2e9}
    before = choose(2150, held, [p], [busy, idle], decode_growth_tokens=0, **settings)
    assert before.decode.worker_id == "busy"
    assert choose(2150, held, [p], [busy, idle], **settings).decode.worker_id == "idle"
    # With every decode worker past the SLO, the one whose step grows least.
    idle.load = {"running": 22}
    assert choose(2150, held, [p], [busy, idle], **settings).decode.worker_id == "idle"
    idle.load = {"running": 40}
    assert choose(2150, held, [p], [busy, idle], **settings).decode.worker_id == "busy"


def test_a_backlog_is_not_routed_around_onto_a_decode_worker_past_the_slo():
    """The prefill pool backed up: a local prefill goes to the decode worker with room, not to
    the one already past the SLO (whose stall price alone can be the lower one)."""
    p = worker("p", "prefill", load={"waiting_tokens": 200_000})
    busy, idle = worker("busy", "decode", running=25), worker("idle", "decode", running=3)
    held = {"busy": 400}  # 6,400 of its tokens, on the busy worker
    before = choose(8000, held, [p], [busy, idle], decode_growth_tokens=0,
                    local_prefill_stall_weight=0.0)
    assert (before.kind, before.decode.worker_id) == ("decode_local", "busy")
    plan = choose(8000, held, [p], [busy, idle], local_prefill_stall_weight=0.0)
    assert (plan.kind, plan.decode.worker_id) == ("decode_local", "idle")
