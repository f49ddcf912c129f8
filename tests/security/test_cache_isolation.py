"""The prefix cache tells one tenant nothing of another's prompts (docs/contract.md "Cache
isolation"): with API keys the router salts each key's block chain apart, and a request's own
`cache_salt` does the same within a key. A real router with two keys over a real colocated
worker that prefills 8 tokens a step (so a cache hit saves visible time), and Redis."""

from __future__ import annotations

import statistics
import time
import uuid

import pytest

from testing.cluster import Router, Worker

pytestmark = pytest.mark.redis

MODEL = "tiny-random"
KEYS = {"alice": "key-alice", "bob": "key-bob"}
# ~1,000 prompt tokens: at 8 tokens a step a miss takes ~140 steps, a hit a handful.
DOCUMENT = "Quarterly revenue memo, confidential. " * 28


@pytest.fixture(scope="module")
def router(tiny_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp("isolation")
    ns = f"iso-{uuid.uuid4().hex[:6]}"
    worker = Worker("colocated", str(tiny_folder), cache_dir=work, namespace=ns, num_blocks=4096,
                    extra=["--max-num-batched-tokens", "8"])
    try:
        r = Router(tiny_folder, ns, cache_dir=work, extra=[
            "--api-key", KEYS["alice"], "--api-key", KEYS["bob"]])
        try:
            r.wait_workers(1)
            yield r
        finally:
            r.close()
    finally:
        worker.close()


def ask(r: Router, who: str, prompt: str, **extra) -> tuple[int, float]:
    """(cached prompt tokens, seconds) of one completion as `who`."""
    t0 = time.perf_counter()
    resp = r.client.post("/v1/completions", headers={"Authorization": f"Bearer {KEYS[who]}"},
                         json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra})
    seconds = time.perf_counter() - t0
    assert resp.status_code == 200, resp.text
    body = resp.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == body["tandem"]["num_cached_tokens"]
    return cached, seconds


def test_another_keys_prompt_gives_no_hit_and_no_faster_answer(router):
    secret = f"{DOCUMENT} The vault PIN is 4821."
    assert ask(router, "alice", secret)[0] == 0
    time.sleep(0.5)  # the worker's block events reach the index
    cached, _ = ask(router, "alice", secret)
    assert cached > 800  # the owner hits its own cache
    # Bob's right guess is Alice's prompt itself: before, it came back from her cache (cached
    # tokens, and several times faster). Now it is computed like any prompt of its length.
    cached, right = ask(router, "bob", secret)
    assert cached == 0
    wrong = []
    for pin in ("1234", "9999", "0000", "5555", "7310"):
        cached, seconds = ask(router, "bob", f"{uuid.uuid4().hex[:8]} {DOCUMENT} PIN {pin}.")
        assert cached == 0
        wrong.append(seconds)
    assert right > 0.6 * statistics.median(wrong), (right, wrong)


def test_a_requests_cache_salt_separates_prompts_within_a_key(router):
    doc = f"Project {uuid.uuid4().hex}. {DOCUMENT}"  # shares nothing with the other test
    assert ask(router, "alice", doc, cache_salt="team-a")[0] == 0
    time.sleep(0.5)
    assert ask(router, "alice", doc, cache_salt="team-a")[0] > 800  # same salt: a hit
    assert ask(router, "alice", doc, cache_salt="team-b")[0] == 0  # another salt: none
    assert ask(router, "alice", doc)[0] == 0  # no salt is a chain of its own
    bad = router.client.post("/v1/completions", headers={"Authorization": f"Bearer {KEYS['bob']}"},
                             json={"model": MODEL, "prompt": "x", "cache_salt": "s" * 257})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
