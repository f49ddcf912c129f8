"""Issue 28, items 5 and 9: start-up fails loudly (a service that cannot bind exits non-zero at
once; `tandem up` refuses a busy port and knows its own router), and a Redis stall longer than
the heartbeat TTL drops no worker. Real processes throughout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from testing.cluster import TOKEN, Router, Worker
from testing.processes import ROOT, free_port
from testing.redis_server import REDIS_URL, RedisServer

pytestmark = pytest.mark.redis


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_router_that_cannot_bind_exits_non_zero_at_once(tiny_folder, tmp_path):
    """Item 5: a router whose bind failed (port in use, or a --host not of this machine) never
    exited when Redis was configured: its background loops were cancelled but kept looping."""
    busy = _listener()
    try:
        for host, port in (("127.0.0.1", busy.getsockname()[1]), ("203.0.113.7", free_port())):
            t0 = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "tandem.cli", "router", "--model", tiny_folder.name,
                 "--tokenizer", str(tiny_folder), "--host", host, "--port", str(port),
                 "--redis-url", REDIS_URL, "--namespace", f"bind-{uuid.uuid4().hex[:6]}",
                 "--cache-dir", str(tmp_path)],
                cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert proc.returncode != 0, proc.stderr[-2000:]
            assert "cannot listen" in proc.stderr, proc.stderr[-2000:]
            assert time.monotonic() - t0 < 30
    finally:
        busy.close()


def test_tandem_up_refuses_a_busy_port_and_checks_its_router_is_its_own(tiny_folder, tmp_path):
    """Item 5: a second `tandem up` on a busy port printed "router ready" for the other cluster
    (its readiness poll hit the other router) and registered its workers there."""
    busy = _listener()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_folder), "--port",
             str(busy.getsockname()[1]), "--redis-url", REDIS_URL, "--cache-dir", str(tmp_path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=60,
            env={**os.environ, "TANDEM_INTERNAL_TOKEN": TOKEN})
        assert proc.returncode != 0
        out = proc.stdout + proc.stderr
        assert "in use" in out and "router ready" not in out, out[-2000:]
        assert not list((tmp_path / ".tandem-logs").glob("*.log"))  # nothing was started
    finally:
        busy.close()
    # The nonce `tandem up` waits for: a router says who it is on /ready.
    r = Router(tiny_folder, f"nonce-{uuid.uuid4().hex[:6]}", cache_dir=tmp_path,
               env={"TANDEM_ROUTER_INSTANCE_NONCE": "cafe0123"})
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                resp = r.client.get("/ready")
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert resp.headers.get("x-tandem-instance") == "cafe0123"
    finally:
        r.close()


def _publisher_failures(log_path) -> int:
    return log_path.read_text(errors="replace").count("redis_publisher: skipped after")


def test_a_redis_stall_longer_than_the_ttl_drops_no_worker(tiny_folder, tmp_path):
    """Item 9: Redis stalled for longer than the heartbeat TTL dropped the only decode worker
    once it resumed (2 of 180 requests got 503). What a stall leaves behind: the commands both
    clients queued before their 1 s socket timeouts run when Redis resumes, the router's
    sentinel write among them (so "Redis lost its data" never fires: the sentinel is there), while
    the worker, backing off between reconnects (up to 5 s), re-registers only when its sleep
    ends: its key had expired, the router's first refresh dropped it. The stall here is held
    until the worker has failed five reconnects (a backoff of 3.2 s then), with requests
    flowing all the while."""
    server = RedisServer(tmp_path)
    ns = f"stall-{uuid.uuid4().hex[:6]}"
    env = {"TANDEM_TEST_REDIS_URL": server.url}
    d = r = None
    stop = threading.Event()
    statuses: list[int] = []
    try:
        d = Worker("decode", str(tiny_folder), cache_dir=tmp_path, namespace=None, ttl=2.0,
                   extra=["--redis-url", server.url, "--namespace", ns])
        r = Router(tiny_folder, ns, cache_dir=tmp_path, redis_url=server.url, env=env)
        r.wait_workers(1)
        log_path = Path(d.log.name)

        def traffic() -> None:
            with httpx.Client(base_url=r.url, timeout=30) as c:
                while not stop.is_set():
                    statuses.append(c.post("/v1/completions", json={
                        "model": tiny_folder.name, "prompt": "hi", "max_tokens": 2}).status_code)
                    time.sleep(0.05)

        flow = threading.Thread(target=traffic)
        flow.start()
        missing = 0
        for _ in range(2):
            failures = _publisher_failures(log_path)
            server.proc.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + 40
            while _publisher_failures(log_path) < failures + 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _publisher_failures(log_path) >= failures + 5, "the worker never lost Redis"
            server.proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                if d.worker_id not in r.client.get("/ready").json()["workers"]:
                    missing += 1
                time.sleep(0.05)
        stop.set()
        flow.join()
        assert missing == 0, f"the decode worker was dropped in {missing} polls"
        assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    finally:
        stop.set()
        server.proc.send_signal(signal.SIGCONT)
        for p in (r, d):
            if p is not None:
                p.close()
        server.stop()
