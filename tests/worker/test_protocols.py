"""vLLM's P/D protocol on Tandem workers (direct, and through the real vllm-router), SSE, client
disconnects, load shedding, Redis outages, and SmolLM2 end to end."""

import json
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from common.registry import RedisKeys
from engine import LLM, SamplingParams
from testing.cluster import Worker, pd_generate
from testing.metrics import series_sum
from testing.processes import free_port

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
# Installed with the dev extra into the same environment as the test runner.
VLLM_ROUTER = (shutil.which("vllm-router")
               or shutil.which("vllm-router", path=str(Path(sys.executable).parent)))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("proto")


@pytest.fixture(scope="module")
def open_pd(tiny_folder, workdir):
    """P and D without an internal token, as a vLLM-style router would find them."""
    p = Worker("prefill", str(tiny_folder), cache_dir=workdir, token=None)
    d = Worker("decode", str(tiny_folder), cache_dir=workdir, token=None)
    yield p, d
    p.close()
    d.close()


def test_vllm_nixl_connector_semantics_direct(open_pd, reference, tiny_folder):
    p, d = open_pd
    body = {"model": "tiny-random", "prompt": "The quick brown fox", "max_tokens": 1,
            "temperature": 0, "kv_transfer_params": {"do_remote_decode": True,
                                                     "do_remote_prefill": False,
                                                     "remote_engine_id": None,
                                                     "remote_block_ids": None, "remote_host": None,
                                                     "remote_port": None}}
    pre = p.client.post("/v1/completions", json=body).json()
    kvp = pre["kv_transfer_params"]
    for field in ("do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host",
                  "remote_port", "remote_request_id", "tp_size"):
        assert field in kvp
    assert kvp["do_remote_prefill"] is True and kvp["remote_port"] == p.port
    dec = d.client.post("/v1/completions", json={**body, "max_tokens": 12, "ignore_eos": True,
                                                 "kv_transfer_params": kvp}).json()
    want = reference.generate("The quick brown fox", SamplingParams(**GREEDY))[0]
    assert dec["choices"][0]["token_ids"] == want.token_ids
    assert dec["choices"][0]["text"] == want.text
    assert any(k.startswith("tandem_kv_transfer_blocks_total") and v > 0
               for k, v in d.metrics().items())
    render = d.client.post("/v1/chat/completions/render",
                           json={"model": "x",
                                 "messages": [{"role": "user", "content": "hi"}]}).json()
    assert (render["prompt_token_ids"]
            == reference.tokenizer.encode_chat([{"role": "user", "content": "hi"}]))


@pytest.mark.skipif(VLLM_ROUTER is None, reason="vllm-router is not installed")
def test_vllm_router_pd_mode_in_front_of_tandem_workers(open_pd, reference, workdir):
    p, d = open_pd
    port = free_port()
    log = open(workdir / "vllm-router.log", "w")
    router = subprocess.Popen(
        [VLLM_ROUTER, "--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url,
         "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        leases_before = p.metrics().get('tandem_kv_leases_total{outcome="notified"}', 0)
        for prompt in ("hello world", "Paged attention moves blocks"):
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-random", "prompt": prompt,
                                                          **GREEDY}, timeout=60)
            assert r.status_code == 200, r.text
            want = reference.generate(prompt, SamplingParams(**GREEDY))[0]
            assert r.json()["choices"][0]["text"] == want.text
        msgs = [{"role": "user", "content": "Say something."}]
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny-random", "messages": msgs,
                                                           **GREEDY}, timeout=60)
        assert r.status_code == 200, r.text
        assert (r.json()["choices"][0]["message"]["content"]
                == reference.chat(msgs, SamplingParams(**GREEDY))[0].text)
        # Every request went P -> D with a KV pull that released P's lease.
        leases_after = p.metrics()['tandem_kv_leases_total{outcome="notified"}']
        assert leases_after - leases_before == 3
        assert "No kv_transfer_params" not in (workdir / "vllm-router.log").read_text()
    finally:
        router.terminate()
        router.wait(10)
        log.close()


def test_sse_stream_and_client_disconnect_frees_blocks(open_pd, reference):
    p, d = open_pd
    prompt = [5, 6, 7, 8, 9, 10, 11]
    pre = p.prefill("sse-1", prompt, GREEDY)
    body = {"request_id": "sse-1", "prompt_token_ids": prompt,
            "output_token_ids": [pre["first_token_id"]], "sampling": GREEDY,
            "kv_transfer_params": pre["kv_transfer_params"]}
    with d.client.stream("POST", "/generate", json=body,
                         headers={"accept": "text/event-stream"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    tokens = [pre["first_token_id"]] + [t for e in events for t in e["token_ids"]]
    assert tokens == reference.generate(prompt, SamplingParams(**GREEDY))[0].token_ids
    assert events[-1]["finish_reason"] == "length" and "timing" in events[-1]
    # A client that leaves mid-stream: the decode worker aborts and frees at once.
    long = {"temperature": 0, "max_tokens": 1500, "ignore_eos": True}
    with d.client.stream("POST", "/generate", json={"request_id": "gone",
                                                    "prompt_token_ids": prompt,
                                                    "sampling": long}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 2:
                break
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and d.metrics()["tandem_worker_running_requests"]:
        time.sleep(0.05)
    m = d.metrics()
    assert m["tandem_worker_running_requests"] == 0 and m["tandem_worker_free_blocks"] == 256


def test_prefill_sheds_load_with_503_and_retry_after(tiny_folder, workdir):
    w = Worker("prefill", str(tiny_folder), cache_dir=workdir, extra=["--max-queue", "0"])
    try:
        r = w.client.post("/prefill", json={"request_id": "shed", "prompt_token_ids": [1, 2, 3]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        assert series_sum(w.metrics(), "tandem_load_shed_total") == 1
        assert w.client.get("/health").status_code == 200
    finally:
        w.close()


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_redis_outage_drops_no_request_and_index_heals(tiny_folder, workdir, tmp_path):
    port = free_port()

    def start_redis():
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                                stdout=subprocess.DEVNULL)
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                return proc, client
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    server, client = start_redis()
    ns = f"outage-{uuid.uuid4().hex[:6]}"
    w = Worker("colocated", str(tiny_folder), cache_dir=workdir, token=None,
               extra=["--redis-url", f"redis://127.0.0.1:{port}/0", "--namespace", ns])
    bkey = RedisKeys(ns).blocks(w.worker_id)
    try:
        w.generate("before", list(range(10, 30)), GREEDY)
        time.sleep(0.3)
        assert client.scard(bkey) > 0
        server.kill()
        server.wait()
        # Requests keep succeeding while Redis is gone; their blocks are cached locally.
        for i in range(3):
            events = w.generate(f"during-{i}", list(range(40 + i, 70 + i)), GREEDY)
            assert events[-1]["finish_reason"] == "length"
        assert w.client.get("/ready").json()["redis"] is False
        server, client = start_redis()  # an empty Redis at the same address
        deadline = time.monotonic() + 10
        # The blocks' rewrite and the registration's next heartbeat are separate writes: wait
        # for both (under load the heartbeat can land after the blocks).
        while time.monotonic() < deadline and (
                client.scard(bkey) < 4 * 7
                or not client.exists(RedisKeys(ns).worker(w.worker_id))):
            time.sleep(0.1)
        # The full rewrite restored every cached block, including those made during the outage.
        assert client.scard(bkey) >= 4 * 7
        assert client.exists(RedisKeys(ns).worker(w.worker_id))
    finally:
        w.close()
        server.kill()
        server.wait()


@pytest.mark.slow
@pytest.mark.redis
def test_smollm2_prefill_decode_golden(smollm2_folder, workdir):
    ref = LLM(str(smollm2_folder), num_blocks=256)
    p = Worker("prefill", str(smollm2_folder), cache_dir=workdir, block_size=16, num_blocks=256)
    d = Worker("decode", str(smollm2_folder), cache_dir=workdir, block_size=16, num_blocks=256)
    try:
        tok = ref.tokenizer
        convs = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "user", "content": "Write a haiku about autumn."}]]
        for i, conv in enumerate(convs):
            ids = tok.encode_chat(conv)
            for sampling in ({"temperature": 0, "max_tokens": 24, "ignore_eos": True},
                             {"temperature": 0.8, "seed": 5, "max_tokens": 24, "ignore_eos": True}):
                tokens, _ = pd_generate(p, d, f"smol-{i}-{sampling['temperature']}", ids, sampling)
                assert tokens == ref.generate(ids, SamplingParams(**sampling))[0].token_ids
    finally:
        p.close()
        d.close()


def test_the_workers_openai_endpoint_answers_tool_calls_and_schemas(open_pd):
    """The decode worker's own OpenAI endpoint (what a vLLM-style router sends to): a named tool
    choice and a required one give valid calls, streamed or not, and response_format holds."""
    _, d = open_pd
    params = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": params}}]
    base = {"model": "tiny-random", "messages": [{"role": "user", "content": "pick one"}],
            "tools": tools, "temperature": 0, "max_tokens": 64}
    for choice in ({"type": "function", "function": {"name": "pick"}}, "required"):
        out = httpx.post(f"{d.url}/v1/chat/completions", json={**base, "tool_choice": choice},
                         timeout=60).json()
        c = out["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        call = c["message"]["tool_calls"][0]
        assert (call["function"]["name"] == "pick"
                and 0 <= json.loads(call["function"]["arguments"])["n"] <= 99)
        streamed, finish = {"name": "", "arguments": ""}, None
        with httpx.stream("POST", f"{d.url}/v1/chat/completions", timeout=60,
                          json={**base, "tool_choice": choice, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                ch = json.loads(line[6:])["choices"][0]
                finish = ch.get("finish_reason") or finish
                for delta in ch.get("delta", {}).get("tool_calls", []):
                    streamed["name"] += delta.get("function", {}).get("name", "")
                    streamed["arguments"] += delta.get("function", {}).get("arguments", "")
        assert finish == "tool_calls"
        assert (streamed["name"], json.loads(streamed["arguments"])) == (
            "pick", json.loads(call["function"]["arguments"]))
    out = httpx.post(f"{d.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "max_tokens": 24,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": params}}})
    assert 0 <= json.loads(out.json()["choices"][0]["message"]["content"])["n"] <= 99
