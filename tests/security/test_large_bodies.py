"""Large request bodies never hold the router's event loop (router/prompts.py): `tools` render
into the prompt as much as message contents do, so the cheap length check counts what the chat
template reads, and a large body is rendered and tokenized off the loop. A real router with
SmolLM2's tokenizer and the tool-aware template, no workers (a request that gets past
tokenizing ends in a 503), probed on /health while clients post megabytes of `tools`."""

from __future__ import annotations

import random
import statistics
import threading
import time

import httpx
import pytest

from testing.cluster import Router
from testing.processes import ROOT
from tests.polling import wait_for

pytestmark = pytest.mark.serial  # asserts wall-clock bounds: run alone (Makefile)

MODEL = "smollm2-135m-instruct"
TEMPLATE = ROOT / "templates" / "chatml_tools.jinja"


def _words(n_chars: int, rng: random.Random) -> str:
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 9)))
             for _ in range(500)]
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def tools_body(num_tools: int, seed: int = 0) -> dict:
    """~28 KiB of tool definition per tool (the bounds allow 128 of 16 KiB descriptions plus
    free-form parameters): 128 tools make a 3.6 MiB body."""
    rng = random.Random(seed)
    desc, param = _words(16000, rng), _words(2000, rng)
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": desc,
        "parameters": {"type": "object", "properties": {
            f"p{j}": {"type": "string", "description": param} for j in range(6)}}}}
        for i in range(num_tools)]
    return {"model": MODEL, "max_tokens": 4, "tools": tools,
            "messages": [{"role": "user", "content": "What is the weather?"}]}


@pytest.fixture(scope="module")
def router(smollm2_folder, tmp_path_factory):
    r = Router(smollm2_folder, None, cache_dir=tmp_path_factory.mktemp("large-bodies"),
               redis_url=None, block_size=16, extra=["--worker", "decode=http://127.0.0.1:1",
                                                     "--chat-template", str(TEMPLATE)])
    wait_for(lambda: _healthy(r), timeout=60, what="the router to answer /health")
    yield r
    r.close()


def _healthy(r: Router) -> bool:
    try:
        return r.client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def test_tools_count_toward_the_context_and_are_refused_before_rendering(router):
    big = router.client.post("/v1/chat/completions", json=tools_body(128))
    assert big.status_code == 400, big.text
    err = big.json()["error"]
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    # Under the cheap bound: rendered and tokenized, then refused on its token count.
    mid = router.client.post("/v1/chat/completions", json=tools_body(40))
    assert mid.status_code == 400, mid.text
    assert "prompt tokens" in mid.json()["error"]["message"]
    # A body that fits passes tokenizing (and finds no worker here).
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    small = router.client.post("/v1/chat/completions", json={**tools_body(0), "tools": [weather]})
    assert small.status_code == 503, small.text


def test_health_stays_fast_while_clients_post_megabytes_of_tools(router):
    bodies = [tools_body(128, seed=1), tools_body(40, seed=2)]
    stop = threading.Event()
    answered: list[int] = []

    def post(i: int) -> None:
        with httpx.Client(base_url=router.url, timeout=120) as c:
            while not stop.is_set():
                answered.append(c.post("/v1/chat/completions", json=bodies[i % 2]).status_code)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    ms: list[float] = []
    try:
        time.sleep(1.0)
        end = time.monotonic() + 8.0
        with httpx.Client(base_url=router.url, timeout=30) as c:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                ms.append((time.perf_counter() - t0) * 1000)
                time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert answered and set(answered) == {400}, set(answered)
    p99 = statistics.quantiles(ms, n=100, method="inclusive")[98]
    # The goal is a p99 under 50 ms (bench/abuse.py measures it on a quiet machine); the bound
    # here leaves room for a loaded CI machine. On the loop, each body held it 3-5 s.
    assert p99 < 500 and max(ms) < 1500, (round(p99), round(max(ms)))
