"""Peer prefix pull planning (router/peer_pull.py) through the real `plan_for` and `kv_aware`
on hand-built worker sets (one layer: no processes)."""

from __future__ import annotations

from router.policy import make_policy, plan_for
from router.settings import RouterSettings
from tests.router.hand_built import BS, worker


def plan(num_tokens, matches, live, **settings):
    return plan_for(make_policy("kv_aware", RouterSettings(**settings)), num_tokens, matches,
                    live, num_tokens // BS, BS)


def test_a_busy_holder_s_prefix_is_pulled_by_the_idle_worker_that_computes():
    holder = worker("a", load={"waiting_tokens": 20_000})  # the fork's holder, backed up
    idle = worker("b")
    p = plan(1600, {"a": 75}, [holder, idle])
    assert p.decode is idle and p.kv_source is holder and p.pull_blocks == 75
    # Off: the same plan, recomputing the prefix.
    p = plan(1600, {"a": 75}, [holder, idle], peer_pulls=False)
    assert p.decode is idle and p.kv_source is None


def test_no_pull_where_recomputing_is_faster_or_nothing_longer_is_held():
    holder, idle = worker("a", load={"waiting_tokens": 20_000}), worker("b")
    # 1 kB/s: moving 75 blocks of 100 kB takes hours, recomputing 1,200 tokens about a second.
    p = plan(1600, {"a": 75}, [holder, idle], default_transfer_bytes_per_s=1e3)
    assert p.decode is idle and p.kv_source is None
    # The computing worker holds as much as anyone: nothing to pull.
    p = plan(1600, {"a": 75, "b": 75}, [holder, idle])
    assert p.kv_source is None


def test_the_longest_holder_of_the_same_identity_and_backend_is_the_source():
    c = worker("c", load={"waiting_tokens": 0})
    busy = {"waiting_tokens": 50_000}
    short, long_ = worker("s", load=busy), worker("l", load=busy)
    other_model = worker("x", load=busy, digest="fedcba9876543210")
    vllm = worker("v", load=busy, backend="vllm")
    p = plan(2000, {"s": 40, "l": 90, "x": 120, "v": 120}, [c, short, long_, other_model, vllm])
    assert p.decode is c and p.kv_source is long_ and p.pull_blocks == 90


def test_the_last_prompt_token_is_never_pulled():
    holder, idle = worker("a", load={"waiting_tokens": 20_000}), worker("b")
    p = plan(1600, {"a": 100}, [holder, idle])  # the whole prompt is held
    assert p.kv_source is holder and p.pull_blocks == (1600 - 1) // BS


def test_a_disaggregated_prefill_pulls_turn_n_from_the_decode_worker():
    pw, d = worker("p", "prefill"), worker("d")
    p = plan(1600, {"d": 90}, [pw, d], conditional_disagg=False)
    assert p.kind == "disagg" and p.prefill is pw
    assert p.kv_source is d and p.pull_blocks == 90


def _fork(**settings) -> tuple[list[str], list[str | None]]:
    """12 requests extending one 1,200-token context by 400 tokens each, routed one after the
    other before any worker reports (the router's own queue count only, as the dispatcher
    keeps it: router/local_prefill.py): where each one computes, and whom it pulls from."""
    from router.local_prefill import uncached_tokens

    holder, *rest = [worker(w, role="colocated") for w in "abc"]
    pol = make_policy("kv_aware", RouterSettings(**settings))
    homes, sources = [], []
    for _ in range(12):
        p = plan_for(pol, 1600, {"a": 75}, [holder, *rest], 100, BS)
        p.decode.inflight += 1
        p.decode.inflight_tokens += uncached_tokens(p, p.decode, 1600)
        homes.append(p.decode.worker_id)
        sources.append(p.kv_source.worker_id if p.kv_source else None)
    return homes, sources


def test_a_fork_spreads_over_idle_workers_that_pull_the_context_and_off_it_piles_up():
    homes, sources = _fork()
    # Every worker computes some; each one away from the holder pulls the context from it.
    assert {homes.count(w) for w in "abc"} <= {3, 4, 5} and sum(map(homes.count, "abc")) == 12
    assert all(s == "a" for h, s in zip(homes, sources, strict=True) if h != "a")
    assert all(s is None for h, s in zip(homes, sources, strict=True) if h == "a")
    # Off: moving costs the whole context, so more stay on the holder, and the rest recompute.
    homes_off, sources_off = _fork(peer_pulls=False)
    assert homes_off.count("a") > homes.count("a") and set(sources_off) == {None}
