"""Prefill worker -> NIXL -> decode worker, as real processes with real Redis."""

import concurrent.futures as cf
import time
import uuid

import pytest
import redis

from common.registry import RedisKeys
from engine import SamplingParams
from testing.cluster import Worker, expected_tokens, pd_generate, pd_pair
from testing.redis_server import REDIS_URL

pytestmark = pytest.mark.redis

GREEDY = {"temperature": 0, "max_tokens": 20, "ignore_eos": True}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_tokens": 20, "ignore_eos": True}


def prompts(n, vocab=256):
    return [[(13 * (i + 1) * (j + 5)) % vocab for j in range(6 + 9 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def pd(tiny_folder, workdir, namespace):
    # The engine on a thread here (the default for prefill and decode, and what CUDA workers
    # do); tests/worker/test_engine_process.py runs this pair with engine-core processes.
    with pd_pair(str(tiny_folder), workdir, namespace, ["--no-engine-process"]) as pair:
        yield pair


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_golden_tokens_equal_one_process_engine(pd, reference, sampling):
    p, d = pd
    for i, prompt in enumerate(prompts(4)):
        tokens, last = pd_generate(p, d, f"golden-{sampling['temperature']}-{i}", prompt, sampling)
        assert tokens == expected_tokens(reference, prompt, sampling)
        assert last["finish_reason"] == "length" and last["timing"]["transfer_s"] > 0


def test_multi_turn_pulls_only_missing_blocks(pd, reference):
    p, d = pd
    turn1 = prompts(5)[4]  # 42 tokens
    out1, _ = pd_generate(p, d, "mt-1", turn1, GREEDY)
    before = d.metrics()
    turn2 = turn1 + out1 + [7, 8, 9, 10, 11, 12, 13]
    out2, _ = pd_generate(p, d, "mt-2", turn2, GREEDY)
    after = d.metrics()
    assert out2 == expected_tokens(reference, turn2, GREEDY)
    # D already holds turn 1 (prompt and decoded tokens); only the rest of turn 2 moves.
    kv_tokens = len(turn2)
    total_blocks = -(-kv_tokens // 4)
    local = (len(turn1) + len(out1) - 1) // 4
    pulled = sum(v for k, v in after.items() if k.startswith("tandem_kv_transfer_blocks_total")) - \
        sum(v for k, v in before.items() if k.startswith("tandem_kv_transfer_blocks_total"))
    assert pulled == total_blocks - local
    assert 0 < pulled < total_blocks


def test_32_concurrent_requests_and_resources_return(pd, reference):
    p, d = pd
    ps = [[(7 * i + 3 * j) % 256 for j in range(5 + (i % 9) * 3)] for i in range(32)]
    start_p = p.metrics()
    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda a: pd_generate(p, d, f"conc-{a[0]}", a[1], GREEDY)[0],
                                enumerate(ps)))
    want = reference.generate(ps, SamplingParams(**GREEDY))
    assert results == [w.token_ids for w in want]
    time.sleep(0.3)
    end_p, end_d = p.metrics(), d.metrics()
    assert end_p["tandem_worker_held_requests"] == 0 and end_p["tandem_kv_leased_blocks"] == 0
    assert end_p["tandem_worker_free_blocks"] == start_p["tandem_worker_free_blocks"] == 256
    assert end_d["tandem_worker_free_blocks"] == 256
    assert end_d["tandem_worker_running_requests"] == 0


@pytest.mark.parametrize("mode", [[], ["--no-engine-process"]], ids=["default", "thread"])
def test_colocated_serves_generate_without_transfer(tiny_folder, workdir, reference, mode):
    c = Worker("colocated", str(tiny_folder), cache_dir=workdir, extra=mode)
    try:
        prompt = prompts(3)[2]
        events = c.generate("co-1", prompt, GREEDY)
        assert ([t for e in events for t in e["token_ids"]]
                == expected_tokens(reference, prompt, GREEDY))
        assert events[-1]["timing"]["transfer_s"] == 0
    finally:
        c.close()


def test_bad_requests_get_clear_errors_and_worker_stays_up(pd):
    p, d = pd
    r = p.client.post("/prefill", json={"request_id": "x", "prompt_token_ids": []})
    assert r.status_code == 400 and "prompt_token_ids" in r.json()["error"]["message"]
    r = p.client.post("/prefill", json={"request_id": "x", "prompt_token_ids": [1, 999999]})
    assert r.status_code == 400 and "token ids must be in" in r.json()["error"]["message"]
    r = d.client.post("/generate", json={"request_id": "y", "prompt_token_ids": [1],
                                         "sampling": {"temperature": -1}})
    assert r.status_code == 400
    r = p.client.post("/prefill", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert r.status_code == 400
    import httpx

    assert httpx.post(f"{p.url}/prefill",
                      json={"request_id": "z", "prompt_token_ids": [1]}).status_code == 401
    assert p.client.get("/health").status_code == 200


def test_abort_frees_blocks(pd):
    p, d = pd
    pre = p.prefill("ab-1", prompts(3)[2], GREEDY)
    assert p.metrics()["tandem_worker_held_requests"] == 1
    assert p.client.post("/abort/ab-1").json()["aborted"]
    m = p.metrics()
    assert m["tandem_worker_held_requests"] == 0 and m["tandem_kv_leased_blocks"] == 0
    assert pre["kv_transfer_params"]["remote_block_ids"]


def test_killed_decode_mid_stream_frees_prefill_blocks_by_lease_deadline(
        tiny_folder, workdir, namespace):
    p = Worker("prefill", str(tiny_folder), cache_dir=workdir, extra=["--lease-seconds", "2"])
    # A slow decode (long output) that is killed while streaming.
    d = Worker("decode", str(tiny_folder), cache_dir=workdir)
    try:
        prompt = prompts(5)[4]
        sampling = {"temperature": 0, "max_tokens": 1000, "ignore_eos": True}
        pre = p.prefill("kill-1", prompt, sampling)
        # Keep a second export unclaimed: nobody will ever pull it.
        p.prefill("kill-2", prompt[:-1], sampling)
        assert p.metrics()["tandem_worker_held_requests"] == 2
        body = {"request_id": "kill-1", "prompt_token_ids": prompt,
                "output_token_ids": [pre["first_token_id"]], "sampling": sampling,
                "kv_transfer_params": pre["kv_transfer_params"]}
        with d.client.stream("POST", "/generate", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 3:
                    d.kill()
                    break
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.metrics()["tandem_worker_held_requests"] > 0:
            time.sleep(0.2)
        m = p.metrics()
        assert m["tandem_worker_held_requests"] == 0 and m["tandem_worker_free_blocks"] == 256
        assert m['tandem_kv_leases_total{outcome="expired"}'] >= 1
    finally:
        p.close()
        d.close()


def test_killed_worker_vanishes_from_redis_within_ttl(tiny_folder, workdir):
    ns = f"kill-{uuid.uuid4().hex[:6]}"
    r = redis.Redis.from_url(REDIS_URL)
    w = Worker("prefill", str(tiny_folder), cache_dir=workdir, namespace=ns, ttl=2)
    try:
        w.prefill("reg-1", prompts(3)[2], {"temperature": 0, "max_tokens": 1})
        wkey, bkey = RedisKeys(ns).worker(w.worker_id), RedisKeys(ns).blocks(w.worker_id)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not r.scard(bkey):
            time.sleep(0.05)
        info = r.hgetall(wkey)
        assert info[b"role"] == b"prefill" and int(info[b"block_size"]) == 4
        assert r.scard(bkey) == len(prompts(3)[2]) // 4
        w.kill()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5 and (r.exists(wkey) or r.exists(bkey)):
            time.sleep(0.1)
        assert not r.exists(wkey) and not r.exists(bkey)
        assert time.monotonic() - t0 <= 2.5
    finally:
        w.close()
