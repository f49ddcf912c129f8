"""Issue 28: one client cannot hold a worker's whole batch from another. The router tells
workers who sent each request (an opaque `client_tag`), and a full batch gives a slot to a
client running fewer sequences (engine/fair_share.py).

Before, the batch was first come, first served: a client with as many long streams as the
decode worker has sequence slots kept another client's 8-token request waiting until one of its
1,500-token streams ended (22 s at 64 streams of 1,500 tokens on this machine).

Real processes: Redis, a prefill and a decode worker (4 sequence slots), a router that tells
clients apart by API key."""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest

from testing.cluster import Router, Worker
from tests.polling import wait_for

pytestmark = pytest.mark.redis

SLOTS = 4


@pytest.fixture(scope="module", params=["fair", "fcfs"])
def cluster(request, tiny_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp("fair-batch")
    ns = f"fb-{uuid.uuid4().hex[:6]}"
    procs: list = []
    try:
        procs.append(Worker("prefill", str(tiny_folder), cache_dir=work, namespace=ns,
                            num_blocks=1024))
        # Blocks for every stream to its end: only the sequence slots are short.
        procs.append(Worker("decode", str(tiny_folder), cache_dir=work, namespace=ns,
                            num_blocks=4096, extra=["--max-num-seqs", str(SLOTS),
                                                    "--scheduling-policy", request.param]))
        r = Router(tiny_folder, ns, cache_dir=work,
                   extra=["--api-key", "key-a", "--api-key", "key-b"])
        procs.append(r)
        r.wait_workers(2)
        yield r, procs[1], request.param
    finally:
        for p in reversed(procs):
            p.close()


class LongStream(threading.Thread):
    """One of client A's streams, read to its end."""

    def __init__(self, url: str, i: int) -> None:
        super().__init__(daemon=True)
        self.url, self.i = url, i
        self.done = threading.Event()
        self.stop = threading.Event()
        self.status: int | None = None

    def run(self) -> None:
        body = {"model": "tiny-random", "prompt": f"long {self.i}", "max_tokens": 1500,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120, headers={"Authorization": "Bearer key-a"}) as c, \
                c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]" or self.stop.is_set():
                    break
        self.done.set()


def test_a_client_holding_every_slot_gives_one_to_another(cluster):
    """`fcfs` is the batch as it was (`--scheduling-policy fcfs`): B waits for one of A's
    streams to end."""
    r, decode, policy = cluster
    streams = [LongStream(r.url, i) for i in range(SLOTS)]
    for s in streams:
        s.start()
    try:
        wait_for(lambda: decode.metrics()["tandem_worker_running_requests"] == SLOTS, 60,
                 "client A's streams fill the batch")
        with httpx.Client(timeout=120, headers={"Authorization": "Bearer key-b"}) as c:
            got = c.post(f"{r.url}/v1/completions", json={
                "model": "tiny-random", "prompt": "short", "max_tokens": 8, "temperature": 0})
        running = [not s.done.is_set() for s in streams]
        assert got.status_code == 200, got.text
        assert got.json()["usage"]["completion_tokens"] == 8
        assert all(s.status == 200 for s in streams)
        preemptions = decode.metrics()["tandem_worker_preemptions_total"]
        if policy == "fair":
            # Answered while every one of A's streams still generates: B waited for none. The
            # stream that gave way was recomputed and carries on.
            assert all(running), running
            assert preemptions >= 1
        else:
            assert not all(running), "first come, first served: B waits for a slot"
            assert preemptions == 0
    finally:
        for s in streams:
            s.stop.set()
        for s in streams:
            s.join(60)
    wait_for(lambda: decode.metrics()["tandem_worker_running_requests"] == 0, 60, "idle")
