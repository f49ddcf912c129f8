"""A peer prefix pull whose holder dies in the middle of it (issue 42): the holder lives in a
network namespace behind a veth pair shaped with `tc` to 8 Mbit/s, so SmolLM2's KV for a
400-token prefix (25 blocks, 18 MB: more than the sockets' buffers hold, which a dead process's
kernel would still deliver) takes seconds to cross, and it is SIGKILLed while the puller is
reading it. The puller computes the prompt instead: the holder's own greedy tokens, nothing
pulled or cached from the dead holder, the failure counted, every reserved block free again."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from common.hashing import BlockHasher
from testing.cluster import Worker
from testing.netns import Link
from tests.polling import wait_for
from tests.worker.test_peer_pull import counters, export, generate

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root and iproute2 (ip netns, tc)")]

ROOT_IP, NS_IP = "10.236.0.1", "10.236.0.2"  # only on the veth pair made here
NUM_BLOCKS = 64
BLOCK = 16


def test_a_holder_killed_mid_pull_means_the_prompt_is_computed(smollm2_folder, tmp_path):
    link = Link([ROOT_IP], NS_IP)
    holder = puller = None
    extra = ["--transport", "tcp", "--lease-seconds", "60"]
    try:
        model = str(smollm2_folder)
        holder = Worker("colocated", model, cache_dir=tmp_path, host=NS_IP, netns=link.ns,
                        num_blocks=NUM_BLOCKS, block_size=BLOCK, extra=extra)
        puller = Worker("colocated", model, cache_dir=tmp_path, host=ROOT_IP,
                        num_blocks=NUM_BLOCKS, block_size=BLOCK,
                        extra=[*extra, "--pull-timeout-s", "60", "--handshake-timeout-s", "20"])
        prompt = [(7 * j) % 5000 + 100 for j in range(404)]  # 25 full blocks of 16 tokens
        expected, _ = generate(holder, "mid-0", prompt, None)
        hashes = BlockHasher(holder.client.get("/ready").json()["model_digest"], BLOCK)(prompt)
        got = export(holder, "mid-1.prefix", hashes, puller.worker_id)
        assert got["num_blocks"] == 25
        link.shape("8mbit", "16kb")  # ~1 MB/s: the 18 MB pull would take ~18 s
        out: dict = {}

        def run() -> None:
            out["t0"] = time.monotonic()
            out["tokens"], out["last"] = generate(puller, "mid-1", prompt,
                                                  got["kv_transfer_params"])
            out["t1"] = time.monotonic()

        thread = threading.Thread(target=run)
        thread.start()
        # The pull is under way once the puller has reserved blocks for it.
        wait_for(lambda: puller.metrics()["tandem_worker_free_blocks"] <= NUM_BLOCKS - 25, 20,
                 "the puller reserving blocks for the pull")
        time.sleep(2)
        moved = sum(v for k, v in puller.metrics().items()
                    if k.startswith("tandem_kv_transfer_bytes_total"))
        assert moved == 0  # still reading
        holder.kill()
        thread.join(60)
        assert not thread.is_alive()
        assert out["tokens"] == expected
        assert out["last"]["timing"]["num_pulled_tokens"] == 0
        assert out["last"]["num_cached_tokens"] == 0  # nothing from the dead holder was cached
        assert counters(puller)["fallbacks"] >= 1 and counters(puller)["pulled"] == 0
        assert out["t1"] - out["t0"] < 30  # the kill, not the 60 s pull timeout, ended it

        def settled() -> bool:
            m = puller.metrics()
            return (m["tandem_worker_free_blocks"] == NUM_BLOCKS
                    and m.get("tandem_worker_pinned_blocks", 0) == 0)

        wait_for(settled, 10, "the puller's reserved blocks freed")
    finally:
        for w in (puller, holder):
            if w is not None:
                w.close()
        link.close()
