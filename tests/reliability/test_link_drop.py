"""The P<->D link drops while requests flow: the decode worker lives in its own network namespace
and reaches the prefill worker at an address of its own; a blackhole route to that address cuts
only the KV path (router and Redis still reach both). Every request must still answer exactly
(the decode worker falls back to local prefill), the prefill worker's leases expire and free
their blocks, and when the route comes back, KV moves again."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import openai
import pytest

from engine import SamplingParams
from testing.cluster import Router, Worker
from testing.netns import Link
from testing.processes import free_port

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("redis-server") is None,
    reason="needs root, iproute2 (ip netns) and redis-server")]

ROOT_IP, P_IP, NS_IP = "10.234.0.1", "10.234.0.3", "10.234.0.2"  # only on the veth pair made here


def test_dropping_the_p_to_d_link_loses_no_request(tiny_folder, tmp_path, reference):
    link = Link([ROOT_IP, P_IP], NS_IP)
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", f"127.0.0.1 {ROOT_IP}",
                              "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir",
                              str(tmp_path)],
                             stdout=subprocess.DEVNULL)
    url = f"redis://{ROOT_IP}:{port}/0"
    ns = f"link-{uuid.uuid4().hex[:6]}"
    args = ["--redis-url", url, "--namespace", ns, "--transport", "tcp"]
    p = d = r = None
    try:
        time.sleep(0.3)
        p = Worker("prefill", str(tiny_folder), cache_dir=tmp_path, host=P_IP,
                   extra=[*args, "--lease-seconds", "3"])
        d = Worker("decode", str(tiny_folder), cache_dir=tmp_path, host=NS_IP,
                   netns=link.ns, extra=args, env={"TANDEM_PULL_TIMEOUT_S": "2"})
        # Every request disaggregated: each one needs the link.
        r = Router(tiny_folder, ns, cache_dir=tmp_path, redis_url=url,
                   env={"TANDEM_ROUTER_CONDITIONAL_DISAGG": "false"})
        r.wait_workers(2)
        client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0, timeout=60)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

        def ask(i: int) -> None:
            prompt = f"link test {i}: a prompt long enough to fill several blocks of the cache"
            got = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=12,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert got.choices[0].text == reference.generate(prompt, params)[0].text, i
            assert got.tandem["plan"] == "disagg"

        def pulled() -> float:
            return sum(v for k, v in d.metrics().items()
                       if k.startswith("tandem_kv_transfer_bytes_total"))

        def fallbacks() -> float:
            return sum(v for k, v in d.metrics().items()
                       if k.startswith("tandem_kv_pull_fallbacks_total"))

        for i in range(3):
            ask(i)
        assert pulled() > 0 and fallbacks() == 0
        before = pulled()
        link.blackhole(P_IP)  # the KV path is gone; router and Redis still reach both workers
        for i in range(3, 7):
            ask(i)
        assert fallbacks() >= 4 and pulled() == before
        link.blackhole(P_IP, on=False)
        for i in range(7, 9):
            ask(i)
        assert pulled() > before  # KV moves again
        # The leases of the prefills whose pulls never came expired and freed their blocks.
        deadline = time.monotonic() + 10
        while True:
            m = p.metrics()
            if m.get("tandem_kv_leased_blocks", 0) == 0 and m["tandem_worker_held_requests"] == 0:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.2)
        assert m.get('tandem_kv_leases_total{outcome="expired"}', 0) >= 4
    finally:
        for proc in (r, d, p):
            if proc is not None:
                proc.close()
        redis.kill()
        link.close()
