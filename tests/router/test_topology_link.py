"""Peer pulls priced per locality pair over a real rate-limited link (issue 42, "Topology"): a
prefill worker and a near decode worker on this host (one rack), a far decode worker in a
network namespace behind a veth pair shaped to 80 Mbit/s with `tc` (another rack), SmolLM2 on
all three (real KV sizes: 184 KB a 4-token block, so a ~160-token prefix is ~7 MB, most of a
second on the link), every request disaggregated.

- With a near and a far holder of the same prefix, the prefill worker pulls from the near one.
- With only the far holder, the first pull crosses the slow link; the router learns that pair's
  bandwidth from it, within 2x of the link's rate.
- The next prompt only the far holder has is recomputed: pulling it is now priced slower.
Every answer is the greedy answer computed on one worker alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import httpx
import pytest
from transformers import AutoTokenizer

from testing.cluster import Router, Worker
from testing.netns import Link
from testing.processes import free_port

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None
    or shutil.which("redis-server") is None,
    reason="needs root, iproute2 (ip netns, tc) and redis-server")]

ROOT_IP, P_IP, NS_IP = "10.235.0.1", "10.235.0.3", "10.235.0.2"  # only on the pair made here
LINK_BYTES_PER_S = 10e6  # 80 Mbit/s
P_LOC, NEAR_LOC, FAR_LOC = "z/r1/p", "z/r1/dn", "z/r2/df"
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


def words(seed: int, n: int) -> str:
    return " ".join(f"item{(seed * 7919 + 13 * i) % 997} is filed under topic {i % 17}."
                    for i in range(n))


def test_pulls_follow_the_fabric(smollm2_folder, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    link = Link([ROOT_IP, P_IP], NS_IP)
    link.shape("80mbit", "64kb")
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", f"127.0.0.1 {ROOT_IP}",
                              "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir",
                              str(tmp_path)], stdout=subprocess.DEVNULL)
    url = f"redis://{ROOT_IP}:{port}/0"
    ns = f"topo-{uuid.uuid4().hex[:6]}"
    args = ["--redis-url", url, "--namespace", ns, "--transport", "tcp", "--lease-seconds", "30"]
    procs = []
    try:
        time.sleep(0.3)
        model = str(smollm2_folder)
        p = Worker("prefill", model, cache_dir=tmp_path, host=P_IP, num_blocks=1024,
                   extra=[*args, "--locality", P_LOC])
        procs.append(p)
        near = Worker("decode", model, cache_dir=tmp_path, num_blocks=1024,
                      extra=[*args, "--locality", NEAR_LOC])
        procs.append(near)
        far = Worker("decode", model, cache_dir=tmp_path, host=NS_IP, netns=link.ns,
                     num_blocks=1024, extra=[*args, "--locality", FAR_LOC])
        procs.append(far)
        r = Router(smollm2_folder, ns, cache_dir=tmp_path, redis_url=url,
                   extra=["--expose-worker-ids", "--link-same-rack-bytes-per-s", "1e11"],
                   env={"TANDEM_ROUTER_CONDITIONAL_DISAGG": "false"})
        procs.append(r)
        r.wait_workers(3)
        client = httpx.Client(base_url=r.url, timeout=120)

        def hold(workers, ids) -> None:
            """Each worker computes `ids` on its own; wait until the router's index has them."""
            for w in workers:
                w.generate(f"hold-{uuid.uuid4().hex[:6]}", ids, GREEDY)
            time.sleep(1.5)  # block events reach the router's index through Redis

        def ask(ids) -> dict:
            got = client.post("/v1/completions", json={
                "model": smollm2_folder.name, "prompt": ids, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True})
            assert got.status_code == 200, got.text
            body = got.json()
            # The greedy answer, as one worker alone computes it.
            alone = [t for ev in near.generate(f"ref-{uuid.uuid4().hex[:6]}", ids, GREEDY)
                     for t in ev["token_ids"]]
            assert body["choices"][0]["text"] == tok.decode(alone)
            return body["tandem"]

        def metric(name: str, **labels) -> float:
            want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            return r.metrics().get(f"{name}{{{want}}}" if labels else name, 0.0)

        # 1. Both decode workers hold A; the prefill worker pulls it from the near one.
        a = tok(words(1, 14))["input_ids"]
        hold([near, far], a)
        t = ask(a + tok(" Now summarise item seven.")["input_ids"])
        assert t["kv_source"] == near.worker_id and t["num_pulled_tokens"] >= len(a) - 8, t

        # 2. Only the far worker holds B: the pull crosses the 80 Mbit/s link, and is learned.
        b = tok(words(2, 14))["input_ids"]
        hold([far], b)
        t = ask(b + tok(" Now summarise item three.")["input_ids"])
        assert t["kv_source"] == far.worker_id and t["num_pulled_tokens"] >= len(b) - 8, t
        learned = metric("tandem_router_link_bytes_per_second", src_locality=FAR_LOC,
                         dst_locality=P_LOC)
        assert LINK_BYTES_PER_S / 2 <= learned <= LINK_BYTES_PER_S * 2, (
            learned, {k: v for k, v in r.metrics().items() if "peer_pulled" in k or "link_" in k})

        # 3. Only the far worker holds C: pulling it is now priced at the learned rate, slower
        # than recomputing, so the prefill worker computes it all.
        recomputed = metric("tandem_router_peer_held_recomputed_tokens_total",
                            model=smollm2_folder.name)
        c = tok(words(3, 14))["input_ids"]
        hold([far], c)
        t = ask(c + tok(" Now summarise item five.")["input_ids"])
        assert t["kv_source"] is None and t["num_pulled_tokens"] == 0, t
        assert metric("tandem_router_peer_held_recomputed_tokens_total",
                      model=smollm2_folder.name) >= recomputed + len(c) - 8
        # Every leased prefix was pulled and released: nothing held on any worker.
        for w in (p, near, far):
            assert w.metrics().get("tandem_kv_leased_blocks", 0) == 0
    finally:
        for proc in reversed(procs):
            proc.close()
        redis.kill()
        link.close()
