"""Peer prefix pulls between real colocated workers (issue 42): a holder leases its cached leading
blocks (`POST /kv/prefix-export`), the worker that computes pulls them and computes only the
rest. Every failure (a tampered, replayed or misdirected handle, the holder killed, blocks
evicted before the export) computes the prompt instead: the same greedy tokens, and no lease or
block left held on either side."""

import json
import time

import pytest

from common.hashing import BlockHasher
from testing.cluster import Worker, expected_tokens
from tests.polling import wait_for

pytestmark = pytest.mark.redis

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
BLOCK = 4
NUM_BLOCKS = 96


def context(seed: int, n: int = 60) -> list[int]:
    return [(seed * 31 + 7 * j) % 250 + 1 for j in range(n)]


@pytest.fixture(scope="module")
def pair(tiny_folder, workdir, namespace):
    """Two colocated workers (2 s leases): the holder and the puller."""
    extra = ["--lease-seconds", "2", "--pull-timeout-s", "3", "--handshake-timeout-s", "2"]
    a = Worker("colocated", str(tiny_folder), cache_dir=workdir, namespace=namespace,
               num_blocks=NUM_BLOCKS, extra=extra)
    try:
        b = Worker("colocated", str(tiny_folder), cache_dir=workdir, namespace=namespace,
                   num_blocks=NUM_BLOCKS, extra=extra)
        try:
            yield a, b
        finally:
            b.close()
    finally:
        a.close()


def hasher(w: Worker) -> BlockHasher:
    return BlockHasher(w.client.get("/ready").json()["model_digest"], BLOCK)


def export(holder: Worker, rid: str, hashes: list[int], requester: str) -> dict:
    r = holder.client.post("/kv/prefix-export", json={"request_id": rid, "block_hashes": hashes,
                                                      "requester": requester})
    assert r.status_code == 200, r.text
    return r.json()


def generate(w: Worker, rid: str, prompt: list[int], prefix: dict | None) -> tuple[list, dict]:
    body = {"request_id": rid, "prompt_token_ids": prompt, "sampling": GREEDY}
    if prefix is not None:
        body["prefix_kv_params"] = prefix
    with w.client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line) for line in r.iter_lines() if line]
    return [t for ev in events for t in ev["token_ids"]], events[-1]


def counters(w: Worker) -> dict[str, float]:
    m = w.metrics()

    def total(prefix):
        return sum(v for k, v in m.items() if k.startswith(prefix) and "_created" not in k)

    return {"prompt": total("tandem_prompt_tokens_total"),
            "hits": total("tandem_prefix_cache_hit_tokens_total"),
            "pulled": total("tandem_worker_peer_pulled_tokens_total"),
            "fallbacks": total("tandem_worker_peer_pull_fallbacks_total")}


def flush(w: Worker, seed: int) -> None:
    """Other prompts take every block of `w`'s small cache in turn (LRU evicts the rest)."""
    for i in range(5):
        generate(w, f"flush-{seed}-{i}", context(seed + i, 80), None)


def settled(*workers: Worker) -> None:
    """Nothing left held anywhere: no lease, no pinned block, every block free."""
    def clean():
        for w in workers:
            m = w.metrics()
            if (m.get("tandem_kv_leased_blocks", 0) or m.get("tandem_worker_pinned_blocks", 0)
                    or m.get("tandem_worker_free_blocks") != NUM_BLOCKS):
                return False
        return True

    wait_for(clean, 10, "leases and pinned blocks released")


def test_pull_computes_only_the_rest_with_the_same_tokens(pair, reference):
    a, b = pair
    turn1 = context(1)
    out1, _ = generate(a, "pp-1", turn1, None)
    fork = turn1 + out1 + [11, 12, 13, 14, 15, 16, 17, 18, 19]
    hashes = hasher(a)(fork)
    got = export(a, "pp-2.prefix", hashes, b.worker_id)
    held = (len(turn1) + len(out1) - 1) // BLOCK  # the last sampled token is never computed
    assert got["num_blocks"] == held
    before = counters(b)
    tokens, last = generate(b, "pp-2", fork, got["kv_transfer_params"])
    after = counters(b)
    assert tokens == expected_tokens(reference, fork, GREEDY)
    pulled = after["pulled"] - before["pulled"]
    assert pulled == held * BLOCK and last["timing"]["num_pulled_tokens"] == pulled
    assert last["num_cached_tokens"] == 0  # nothing of it was on B before
    prefilled = (after["prompt"] - before["prompt"]) - (after["hits"] - before["hits"])
    assert prefilled == len(fork) - pulled  # only the rest was computed
    settled(a, b)


def test_tampered_replayed_and_misdirected_handles_compute_instead(pair, reference):
    a, b = pair
    prompt = context(2) + [5, 6, 7]
    generate(a, "tr-0", prompt, None)
    hashes = hasher(a)(prompt)
    want = expected_tokens(reference, prompt, GREEDY)
    handle = export(a, "tr-1.prefix", hashes, b.worker_id)["kv_transfer_params"]
    tampered = [dict(handle, remote_block_ids=list(reversed(handle["remote_block_ids"]))),
                dict(handle, requester=a.worker_id),
                dict(handle, expires_at=handle["expires_at"] + 60),
                dict(handle, signature="0" * 64)]
    for i, bad in enumerate(tampered):
        before = counters(b)
        tokens, last = generate(b, f"tr-bad-{i}", prompt, bad)
        assert tokens == want
        assert last["timing"]["num_pulled_tokens"] == 0
        assert counters(b)["fallbacks"] == before["fallbacks"] + 1
    # Issued to B, used by A: refused too.
    tokens, last = generate(a, "tr-other", prompt, handle)
    assert tokens == want and last["timing"]["num_pulled_tokens"] == 0
    settled(a, b)  # A's lease ran out (2 s): the blocks it pinned are free again
    # A genuine handle pulls once. Replayed once B has lost those blocks again (whether or not
    # the holder's lease has ended yet), B refuses a handle it used: it computes, same tokens.
    flush(b, 20)  # B computed the prompt above: make it lack those blocks again
    handle = export(a, "tr-2.prefix", hashes, b.worker_id)["kv_transfer_params"]
    tokens, last = generate(b, "tr-ok", prompt, handle)
    assert tokens == want and last["timing"]["num_pulled_tokens"] > 0
    flush(b, 30)
    before = counters(b)
    tokens, last = generate(b, "tr-replay", prompt, handle)
    assert tokens == want and last["timing"]["num_pulled_tokens"] == 0
    assert counters(b)["fallbacks"] == before["fallbacks"] + 1
    settled(a, b)


def test_blocks_evicted_before_the_export_shorten_it(pair, reference):
    a, b = pair
    prompt = context(4, 80)
    generate(a, "ev-0", prompt, None)
    hashes = hasher(a)(prompt)
    flush(a, 10)
    got = export(a, "ev-1.prefix", hashes, b.worker_id)
    assert got["num_blocks"] < len(hashes) - 1  # evicted since "planned": a shorter answer
    tokens, last = generate(b, "ev-1", prompt, got["kv_transfer_params"])
    assert tokens == expected_tokens(reference, prompt, GREEDY)
    assert last["timing"]["num_pulled_tokens"] == got["num_blocks"] * BLOCK
    settled(a, b)


def test_holder_killed_before_the_pull_computes(tiny_folder, workdir, namespace, reference):
    holder = Worker("colocated", str(tiny_folder), cache_dir=workdir, namespace=namespace,
                    num_blocks=NUM_BLOCKS)
    puller = Worker("colocated", str(tiny_folder), cache_dir=workdir, namespace=namespace,
                    num_blocks=NUM_BLOCKS, extra=["--handshake-timeout-s", "2",
                                                  "--pull-timeout-s", "3"])
    try:
        prompt = context(5)
        generate(holder, "hk-0", prompt, None)
        handle = export(holder, "hk-1.prefix", hasher(holder)(prompt),
                        puller.worker_id)["kv_transfer_params"]
        holder.kill()
        t0 = time.monotonic()
        tokens, last = generate(puller, "hk-1", prompt, handle)
        assert tokens == expected_tokens(reference, prompt, GREEDY)
        assert last["timing"]["num_pulled_tokens"] == 0
        assert time.monotonic() - t0 < 10
        assert counters(puller)["fallbacks"] >= 1
        settled(puller)
    finally:
        puller.close()
        holder.close()
