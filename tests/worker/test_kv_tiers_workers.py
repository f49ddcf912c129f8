"""KV tiers in real worker processes: a colocated worker killed with SIGKILL and restarted on its
disk folder serves the same prompt from disk with the same greedy text; a prefill worker whose
prompt was evicted to its host tier reloads it and the P/D answer is unchanged; the router's
answers report the cached tokens by tier, from the worker that computed the prompt."""

import json
import random

import pytest
import redis

from common.registry import RedisKeys
from testing.cluster import Router, Worker, expected_tokens, pd_generate, pd_pair
from testing.metrics import series_sum
from testing.redis_server import REDIS_URL
from tests.polling import wait_for

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def prompts(n, length=41, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def tier_total(worker: Worker, name: str, medium: str) -> float:
    return series_sum(worker.metrics(), f"tandem_worker_kv_tier_{name}_total", medium=medium)


def generate(worker: Worker, request_id: str, prompt: list[int]) -> tuple[list[int], dict]:
    events = worker.generate(request_id, prompt, GREEDY)
    return [t for ev in events for t in ev["token_ids"]], events[-1]


@pytest.mark.redis
def test_a_restarted_worker_serves_its_disk_tier(tiny_folder, reference, tmp_path):
    prompt = prompts(1)[0]
    want = expected_tokens(reference, prompt, GREEDY)
    namespace = f"tiers-{random.getrandbits(32):08x}"
    # colocated: the engine in its own process (the default), which holds the disk folder
    w = Worker("colocated", str(tiny_folder), cache_dir=tmp_path, num_blocks=32,
               namespace=namespace, extra=["--disk-kv-dir", str(tmp_path / "disk")])
    r, keys = redis.Redis.from_url(REDIS_URL), RedisKeys(namespace)
    try:
        tokens, last = generate(w, "first", prompt)
        assert tokens == want and last["num_cached_tokens"] == 0
        # the prompt's 10 full blocks reach the disk (write-through from the host tier)
        wait_for(lambda: tier_total(w, "offload_blocks", "disk") >= 10, 30, "disk writes")
        w.kill()  # SIGKILL: the device and host copies are gone
        (tmp_path / "disk" / "00000000000000ff.kvb").write_bytes(b"not a block")
        w.restart()
        # the blocks found on disk at start are published as the worker's disk set
        wait_for(lambda: r.scard(keys.blocks(w.worker_id, "disk")) >= 10, 30, "disk set")
        tokens, last = generate(w, "again", prompt)
        assert tokens == want
        assert last["num_cached_tokens"] == 40
        assert last["num_cached_tokens_by_medium"] == {"device": 0, "host": 0, "disk": 40}
        assert tier_total(w, "reload_blocks", "disk") == 10
        rejected = series_sum(w.metrics(), "tandem_worker_kv_tier_files_rejected_total",
                              reason="corrupt")
        assert rejected == 1 and not (tmp_path / "disk" / "00000000000000ff.kvb").exists()
    finally:
        r.close()
        w.close()


@pytest.mark.redis
def test_a_prefill_worker_reloads_from_its_host_tier(tiny_folder, reference, tmp_path):
    first, *others = prompts(4, seed=1)
    tiers = ["--no-engine-process", "--num-blocks", "24", "--host-kv-gb", "0.001"]
    namespace = f"tiers-{random.getrandbits(32):08x}"
    with pd_pair(str(tiny_folder), tmp_path, namespace, tiers) as (p, d):
        want = expected_tokens(reference, first, GREEDY)
        tokens, _ = pd_generate(p, d, "p-0", first, GREEDY)
        assert tokens == want
        wait_for(lambda: tier_total(p, "offload_blocks", "host") >= 10, 30, "host copies")
        for i, other in enumerate(others):  # push the first prompt out of P's device pool
            pd_generate(p, d, f"p-other-{i}", other, GREEDY)
        pre = p.prefill("p-1", first, GREEDY)
        assert pre["num_cached_tokens"] == 40
        assert pre["num_cached_tokens_by_medium"]["host"] > 0
        assert tier_total(p, "reload_blocks", "host") > 0
        events = d.generate("p-1", first, GREEDY, [pre["first_token_id"]],
                            pre["kv_transfer_params"])
        assert [pre["first_token_id"]] + [t for ev in events for t in ev["token_ids"]] == want
        # What the router reads: P's host-tier blocks, and its measured host reload rate.
        r, keys = redis.Redis.from_url(REDIS_URL), RedisKeys(namespace)
        try:
            wait_for(lambda: r.scard(keys.blocks(p.worker_id, "host")) > 0, 30, "host set")
            load = wait_for(lambda: json.loads(r.hget(keys.worker(p.worker_id), "load") or "{}")
                            .get("reload_tokens_per_s", {}).get("host"), 30, "reload rate")
            assert load > 0
        finally:
            r.close()


@pytest.mark.redis
@pytest.mark.parametrize("topology", ["pd", "colocated"])
def test_answers_report_cached_tokens_by_tier(topology, tiny_folder, tmp_path):
    first, *others = prompts(4, seed=2)
    tiers = ["--no-engine-process", "--num-blocks", "24", "--host-kv-gb", "0.001"]
    namespace = f"tiers-{random.getrandbits(32):08x}"
    roles = ["prefill", "decode"] if topology == "pd" else ["colocated"]
    workers, router = [], None
    try:
        for role in roles:
            workers.append(Worker(role, str(tiny_folder), cache_dir=tmp_path, namespace=namespace,
                                  extra=tiers))
        # No local prefill on the decode worker: the prefill worker computes every prompt.
        router = Router(tiny_folder, namespace, cache_dir=tmp_path,
                        env={"TANDEM_ROUTER_LOCAL_PREFILL_MAX_UNCACHED_TOKENS": "0"})
        router.wait_workers(len(roles))
        computing = workers[0]  # the prefill worker, or the colocated one

        def ask(prompt: list[int]) -> dict:
            r = router.client.post("/v1/completions", json={
                "model": tiny_folder.name, "prompt": prompt, **GREEDY})
            assert r.status_code == 200, r.text
            return r.json()

        cold = ask(first)
        assert cold["tandem"]["plan"] == ("disagg" if topology == "pd" else "colocated")
        assert cold["tandem"]["num_cached_tokens"] == 0
        assert cold["tandem"]["num_cached_tokens_by_medium"] == {"device": 0, "host": 0, "disk": 0}
        wait_for(lambda: tier_total(computing, "offload_blocks", "host") >= 10, 30, "host copies")
        for other in others:  # push the first prompt out of the device pool
            ask(other)
        again = ask(first)
        t = again["tandem"]
        by_medium = t["num_cached_tokens_by_medium"]
        assert by_medium["host"] > 0, t
        assert sum(by_medium.values()) == t["num_cached_tokens"] == 40
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        assert tier_total(computing, "reload_blocks", "host") * 4 >= by_medium["host"]
        # a prefix reloaded from the host tier gives the same greedy answer
        assert again["choices"][0]["text"] == cold["choices"][0]["text"]
    finally:
        for p in [router, *workers]:
            if p is not None:
                p.close()
