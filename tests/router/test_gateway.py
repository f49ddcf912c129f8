"""The router as users touch it: the official `openai` client against real processes (router,
prefill and decode workers, Redis)."""

import time
import uuid

import httpx
import openai
import pytest
import redis

from common.block_events import StreamEntry
from common.hashing import hash_blocks, hash_member
from common.registry import RedisKeys
from engine import SamplingParams
from testing.cluster import Router, Worker
from testing.metrics import series_sum
from testing.redis_server import REDIS_URL

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("router")


@pytest.fixture(scope="module")
def cluster(tiny_folder, workdir):
    ns = f"gw-{uuid.uuid4().hex[:6]}"
    p = Worker("prefill", str(tiny_folder), cache_dir=workdir, namespace=ns)
    d = Worker("decode", str(tiny_folder), cache_dir=workdir, namespace=ns)
    r = Router(tiny_folder, ns, cache_dir=workdir)
    r.wait_workers(2)
    yield r, p, d
    r.close()
    p.close()
    d.close()


@pytest.fixture(scope="module")
def client(cluster):
    r, _, _ = cluster
    return openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)


MSGS = [{"role": "user", "content": "Tell me about paged attention."}]


def test_chat_matches_the_engine_and_reports_usage(client, reference):
    r = client.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=12,
                                       temperature=0)
    want = reference.chat(MSGS, SamplingParams(temperature=0, max_tokens=12))[0]
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    timing = r.model_extra["tandem"]
    assert timing["plan"] in ("disagg", "decode_local")
    assert 0 < timing["first_token_s"] <= timing["total_s"]


def test_streaming_completion_equals_non_streaming(client):
    args = dict(model="tiny-random", prompt="Once upon a time", max_tokens=10, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat = list(client.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=5,
                                               temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"


def test_stop_strings_and_seeds(client, reference):
    base = client.completions.create(model="tiny-random", prompt="abcdef", max_tokens=20,
                                     temperature=0).choices[0].text
    stop = next(base[i:i + 2] for i in range(4, len(base) - 2) if base[i:i + 2].isprintable())
    for stream in (False, True):
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny-random", prompt="abcdef", max_tokens=20, temperature=0, stop=[stop],
                stream=True) if c.choices)
        else:
            text = client.completions.create(model="tiny-random", prompt="abcdef", max_tokens=20,
                                             temperature=0, stop=[stop]).choices[0].text
        assert text == base[: base.index(stop)]
    a, b = (client.completions.create(model="tiny-random", prompt="seed me", max_tokens=12,
                                      temperature=1.0, seed=123).choices[0].text for _ in range(2))
    c = client.completions.create(model="tiny-random", prompt="seed me", max_tokens=12,
                                  temperature=1.0, seed=124).choices[0].text
    assert a == b != c
    want = reference.generate("seed me", SamplingParams(temperature=1.0, seed=123,
                                                        max_tokens=12))[0]
    assert a == want.text
    n = client.completions.create(model="tiny-random", prompt="x", max_tokens=3, n=3, temperature=0)
    assert len(n.choices) == 3 and len({ch.text for ch in n.choices}) == 1


def test_errors_have_openai_types_and_the_router_stays_up(cluster, client):
    r, _, _ = cluster
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-random", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny-random", prompt="word " * 3000, max_tokens=5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-random", prompt="x", temperature=-1)
    # vLLM's fields that Tandem does not serve are named as such, not as a typo would be.
    for field, value in (("repetition_penalty", 1.1), ("best_of", 2)):
        refused = httpx.post(f"{r.url}/v1/completions", json={
            "model": "tiny-random", "prompt": "x", field: value}).json()["error"]
        assert refused["param"] == field and refused["code"] == "unsupported_field"
        assert refused["message"].startswith(f"{field} is not supported: ")
    typo = httpx.post(f"{r.url}/v1/completions", json={
        "model": "tiny-random", "prompt": "x", "temperatur": 0}).json()["error"]
    assert typo["param"] == "temperatur" and typo["code"] != "unsupported_field"
    bad = httpx.post(f"{r.url}/v1/chat/completions", content=b"{nope",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    wrong_type = httpx.post(f"{r.url}/v1/completions", json={"model": "tiny-random", "prompt": 5})
    assert wrong_type.status_code == 400
    huge = httpx.post(f"{r.url}/v1/completions", content=b"x" * (5 << 20),
                      headers={"content-type": "application/json"})
    assert huge.status_code == 413

    def chunked_body():  # no content-length: the limit must hold while the body is read
        yield b'{"model": "tiny-random", "prompt": "'
        for _ in range(5):
            yield b"x" * (1 << 20)

    chunked = httpx.post(f"{r.url}/v1/completions", content=chunked_body(),
                         headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert chunked.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{r.url}/health").status_code == 200
    models = client.models.list().data
    assert models[0].id == "tiny-random"
    assert models[0].model_extra["root"] == "tiny-random"  # not the model folder's local path
    m = r.metrics()
    # Retries are counted from zero once a model has been asked for, so the documented
    # `grep tandem_retries_total` finds the series before the first retry.
    for kind in ("prefill", "resume"):
        assert f'tandem_retries_total{{kind="{kind}",model="tiny-random"}}' in m


def test_conditional_disaggregation_when_decode_holds_the_conversation(cluster, client):
    r, _, d = cluster
    history = [{"role": "user", "content": "Here is a long shared context about caches. " * 8}]
    first = client.chat.completions.create(model="tiny-random", messages=history, max_tokens=8,
                                           temperature=0)
    assert first.model_extra["tandem"]["plan"] == "disagg"
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "and?"}]
    time.sleep(0.3)  # the decode worker's block events reach Redis within its flush interval
    second = client.chat.completions.create(model="tiny-random", messages=history, max_tokens=8,
                                            temperature=0)
    t = second.model_extra["tandem"]
    # D already holds the conversation: a few uncached tokens are cheaper to compute there.
    assert t["plan"] == "decode_local" and t["num_cached_tokens"] > 0
    assert series_sum(r.metrics(), "tandem_route_decisions_total", plan="decode_local") >= 1


def test_api_keys_and_rate_limits_shared_by_two_router_replicas(tiny_folder, workdir):
    ns = f"rl-{uuid.uuid4().hex[:6]}"
    d = Worker("colocated", str(tiny_folder), cache_dir=workdir, namespace=ns)
    limits = ["--api-key", "sk-alpha", "--api-key", "sk-beta", "--rate-limit-rpm", "3"]
    r1 = Router(tiny_folder, ns, cache_dir=workdir, extra=limits)
    r2 = Router(tiny_folder, ns, cache_dir=workdir, extra=limits)
    try:
        r1.wait_workers(1)
        r2.wait_workers(1)
        # Stay inside one minute window: the limit is per key per minute.
        if time.time() % 60 > 50:
            time.sleep(61 - time.time() % 60)
        args = dict(model="tiny-random", prompt="hi", max_tokens=2, temperature=0)
        anon = openai.OpenAI(base_url=f"{r1.url}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anon.completions.create(**args)
        with pytest.raises(openai.AuthenticationError):
            anon.models.list()
        a1 = openai.OpenAI(base_url=f"{r1.url}/v1", api_key="sk-alpha", max_retries=0)
        a2 = openai.OpenAI(base_url=f"{r2.url}/v1", api_key="sk-alpha", max_retries=0)
        b1 = openai.OpenAI(base_url=f"{r1.url}/v1", api_key="sk-beta", max_retries=0)
        a1.completions.create(**args)
        a2.completions.create(**args)
        a1.completions.create(**args)
        with pytest.raises(openai.RateLimitError) as e:
            a2.completions.create(**args)  # 4th for this key, counted across both replicas
        assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
        assert b1.completions.create(**args).choices[0].finish_reason  # other keys unaffected
    finally:
        r1.close()
        r2.close()
        d.close()


def test_full_admission_queue_answers_503(tiny_folder, workdir, cluster):
    r = Router(tiny_folder, _namespace_of(cluster), cache_dir=workdir,
               extra=["--max-running", "1", "--max-queued", "0"])
    try:
        r.wait_workers(2)
        c = openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0)
        long = dict(model="tiny-random", prompt="go", max_tokens=400, temperature=0,
                    extra_body={"ignore_eos": True})
        stream = c.completions.create(**long, stream=True)
        next(iter(stream))  # the one running slot is taken
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny-random", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        stream.close()
        deadline = time.monotonic() + 10
        while True:  # the slot comes back once the stream is closed
            try:
                c.completions.create(model="tiny-random", prompt="hi", max_tokens=2)
                break
            except openai.InternalServerError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        r.close()


def _namespace_of(cluster) -> str:
    router, _, _ = cluster
    args = router.proc.args
    return args[args.index("--namespace") + 1]


def test_logprobs_are_relayed_in_openai_format(client, reference):
    r = client.completions.create(model="tiny-random", prompt="log me", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    want = reference.generate("log me", SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0]
    assert len(lp.token_logprobs) == 6 == len(want.logprobs)
    for got, exp, top in zip(lp.token_logprobs, want.logprobs, lp.top_logprobs, strict=True):
        # (top_logprobs is keyed by token text, so byte tokens that print alike may merge.)
        assert abs(got - exp.logprob) < 1e-4 and 1 <= len(top) <= 2
        assert all(v <= 0 for v in top.values())
    assert lp.text_offset[0] == 0
    chat = client.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    # Greedy picks the most likely token: it heads its own top list.
    assert all(abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6 for c in content)


def test_streamed_logprobs_match_the_non_streamed_ones(client):
    kw = dict(model="tiny-random", prompt="log me", max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0].logprobs
    got, offsets, text = [], [], ""
    for c in client.completions.create(stream=True, **kw):
        ch = c.choices[0]
        text += ch.text
        if ch.logprobs is not None:
            got += ch.logprobs.token_logprobs
            offsets += ch.logprobs.text_offset
    assert len(got) == 6
    assert all(abs(a - b) < 1e-6 for a, b in zip(got, whole.token_logprobs, strict=True))
    assert offsets == whole.text_offset  # offsets run on across chunks
    chat_kw = dict(model="tiny-random", messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                   top_logprobs=3)
    want = client.chat.completions.create(**chat_kw).choices[0].logprobs.content
    streamed = [t for c in client.chat.completions.create(stream=True, **chat_kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in want]
    assert all(abs(a.logprob - b.logprob) < 1e-6 for a, b in zip(streamed, want, strict=True))


def test_prompt_larger_than_the_decode_kv_cache_is_refused_by_the_router(client):
    # The test workers hold 256 blocks x 4 tokens; the model's context (2048) would allow more.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="kv " * 400, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and "1024 tokens" in e.value.message
    ok = client.completions.create(model="tiny-random", prompt="kv " * 200, max_tokens=4)
    assert ok.usage.prompt_tokens == 600 and ok.choices[0].finish_reason in ("stop", "length")


def test_a_wrong_index_costs_a_cache_miss_never_a_wrong_answer(cluster, client, reference):
    """Whatever the router's replica believes (here: forged into Redis, the source of truth it
    re-reads on a `reset` entry), the worker computes what it lacks: the answer is the reference
    engine's, and the usage shows the miss."""
    r, _, d = cluster
    ns = d.cmd[d.cmd.index("--namespace") + 1]
    keys = RedisKeys(ns)
    rds = redis.Redis.from_url(REDIS_URL)
    seed = int(rds.hget(keys.worker(d.worker_id), "hash_seed"))
    prompt = [(7 * i + 3) % 250 for i in range(64)]  # 16 blocks nobody has seen
    forged = [hash_member(h) for h in hash_blocks(prompt, 4, seed)]
    stream = keys.events(keys.event_shard(d.worker_id))
    rds.sadd(keys.blocks(d.worker_id), *forged)
    rds.xadd(stream, StreamEntry(d.worker_id, "f" * 16, 0, "reset").fields())
    try:
        time.sleep(0.5)  # a few feed polls
        out = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=8,
                                        temperature=0)
        want = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0]
        assert out.choices[0].text == want.text
        assert out.model_extra["tandem"]["plan"] == "decode_local"  # routed on the forged hit
        assert out.usage.prompt_tokens_details.cached_tokens == 0  # which was a miss
    finally:
        rds.srem(keys.blocks(d.worker_id), *forged)
        rds.xadd(stream, StreamEntry(d.worker_id, "f" * 16, 1, "reset").fields())
        rds.close()
