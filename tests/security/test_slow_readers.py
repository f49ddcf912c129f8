"""Issue 28, slow readers: a client that stops reading its stream stops costing the workers
compute. Its worker streams' writes wait (the router stops reading them when its own client does
not read), their tokens pile up unread, and the engine parks the generations: out of the batch,
resumed when the client reads again, aborted with every block freed when parked too long.

Real processes: Redis, a prefill and a decode worker, a router whose write deadline is long
enough that only the workers act (its own deadline is tested in test_round_two.py)."""

from __future__ import annotations

import uuid

import pytest

from testing.cluster import Router, Worker
from tests.polling import wait_for
from tests.security.slow_client import UnreadStream

pytestmark = pytest.mark.redis

PARKED_TIMEOUT_S = 10.0
NUM_BLOCKS = 2048
TOP20 = {"logprobs": True, "top_logprobs": 20, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def cluster(tiny_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp("slow-readers")
    ns = f"sr-{uuid.uuid4().hex[:6]}"
    procs: list = []
    try:
        procs.append(Worker("prefill", str(tiny_folder), cache_dir=work, namespace=ns,
                            num_blocks=NUM_BLOCKS))
        procs.append(Worker("decode", str(tiny_folder), cache_dir=work, namespace=ns,
                            num_blocks=NUM_BLOCKS,
                            extra=["--parked-timeout-s", str(PARKED_TIMEOUT_S)]))
        r = Router(tiny_folder, ns, cache_dir=work, extra=["--stream-write-timeout-s", "600"])
        procs.append(r)
        r.wait_workers(2)
        yield r, procs[0], procs[1]
    finally:
        for p in reversed(procs):
            p.close()


def engine(w: Worker) -> dict[str, float]:
    m = w.metrics()
    return {k: m[f"tandem_worker_{k}"] for k in ("running_requests", "waiting_requests",
                                                  "parked_requests", "free_blocks")}


def idle(*workers: Worker) -> None:
    """Until nothing runs, waits or is parked, and every block is free (cached ones count)."""
    for w in workers:
        wait_for(lambda w=w: engine(w) == {"running_requests": 0, "waiting_requests": 0,
                                           "parked_requests": 0, "free_blocks": NUM_BLOCKS},
                 60, f"{w.role} worker idle")


def test_a_client_that_stops_reading_leaves_the_batch(cluster):
    """8 choices of 1,500 tokens with 20 top logprobs each whose client reads nothing: before,
    they decoded to the end (or to the router's write deadline), taking batch slots and compute
    from everyone else. Now every one is parked once the buffers on its way are full, and the
    decode engine is idle while they wait."""
    r, p, d = cluster
    idle(p, d)
    s = UnreadStream(r.port, {"n": 8, "max_tokens": 1500, "ignore_eos": True, **TOP20})
    try:
        wait_for(lambda: engine(d)["parked_requests"] == 8, 120, "8 parked generations")
        state = engine(d)
        assert state["running_requests"] == 0 and state["waiting_requests"] == 0, state
        assert state["free_blocks"] < NUM_BLOCKS  # they keep their blocks while none are short
        assert r.metrics()["tandem_router_inflight_requests"] == 8  # the stream is alive
    finally:
        s.close()
    idle(p, d)  # the client left: the router closes the streams, the workers abort them


def _text(events: list[dict]) -> tuple[str, list[str]]:
    text, tokens = "", []
    for ev in events:
        choice = ev["choices"][0]
        text += choice["delta"].get("content") or ""
        tokens += [t["token"] for t in (choice.get("logprobs") or {}).get("content") or []]
    return text, tokens


def test_a_parked_generation_resumes_to_the_same_tokens_when_its_client_reads(cluster):
    """Greedy: the stream that was parked mid-way and read to its end afterwards carries the
    same text and tokens as the same request answered in one piece."""
    r, p, d = cluster
    idle(p, d)
    body = {"max_tokens": 1200, "ignore_eos": True, "temperature": 0, **TOP20}
    want = r.client.post("/v1/chat/completions", json={"model": "tiny-random", **body}).json()
    want_tokens = [t["token"] for t in want["choices"][0]["logprobs"]["content"]]
    s = UnreadStream(r.port, body)
    try:
        wait_for(lambda: engine(d)["parked_requests"] == 1, 120, "a parked generation")
        events = s.read_to_end()
    finally:
        s.close()
    text, tokens = _text(events)
    assert len(tokens) == 1200 and tokens == want_tokens
    assert text == want["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    idle(p, d)


def test_a_generation_parked_too_long_is_aborted_and_frees_everything(cluster):
    """A client that never reads again: its generations are aborted `--parked-timeout-s` after
    they were parked, and every KV block on both workers is free again (the prefill worker's
    export leases ended with the pulls), while the router (whose write deadline is longer)
    still holds the client's connection."""
    r, p, d = cluster
    idle(p, d)
    s = UnreadStream(r.port, {"n": 2, "max_tokens": 1500, "ignore_eos": True, **TOP20})
    try:
        wait_for(lambda: engine(d)["parked_requests"] == 2, 120, "2 parked generations")
        wait_for(lambda: engine(d)["parked_requests"] == 0, PARKED_TIMEOUT_S + 30,
                 "the parked generations aborted")
        assert engine(d) == {"running_requests": 0, "waiting_requests": 0,
                             "parked_requests": 0, "free_blocks": NUM_BLOCKS}
        assert engine(p)["free_blocks"] == NUM_BLOCKS
        assert r.metrics()["tandem_router_inflight_requests"] == 2
    finally:
        s.close()
    idle(p, d)
    wait_for(lambda: r.metrics()["tandem_router_inflight_requests"] == 0, 30, "the router freed")
