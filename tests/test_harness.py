"""The test harness (testing/, not installed) itself: a service whose port another process takes
between `free_port` and its bind starts again on another port (CI saw "address already in
use" at a worker's start), a start that fails otherwise is not retried, and the clusters'
internal token is a new random one in each process, written nowhere."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest

import testing.processes
from testing.cluster import TOKEN, Router, Worker
from testing.processes import ROOT


@pytest.fixture
def taken_port(request, monkeypatch):
    """A port some other socket holds (bound, as a client's port is; or, param "listening",
    accepting connections it never answers), handed out by the harness's first `free_port`
    call (the race, made certain); later calls get free ports. Yields (port, the ports handed
    out)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    if getattr(request, "param", "bound") == "listening":
        holder.listen(8)
    port = holder.getsockname()[1]
    real, handed = testing.processes.free_port, []

    def free_port() -> int:
        handed.append(port if not handed else real())
        return handed[-1]

    monkeypatch.setattr(testing.processes, "free_port", free_port)
    try:
        yield port, handed
    finally:
        holder.close()


def test_a_worker_whose_port_was_taken_starts_on_another(taken_port, tiny_folder, tmp_path):
    port, handed = taken_port
    w = Worker("decode", str(tiny_folder), cache_dir=tmp_path, num_blocks=64)
    try:
        assert len(handed) == 2 and w.port == handed[1] != port
        assert w.url.endswith(f":{w.port}") and w.worker_id == f"decode-127.0.0.1-{w.port}"
        assert w.client.get("/ready").status_code == 200
        assert w.client.get("/health").status_code == 200
        assert "address already in use" in open(w.log.name).read().lower()  # the first start
    finally:
        w.close()


@pytest.mark.parametrize("taken_port", ["bound", "listening"], indirect=True)
def test_a_router_whose_port_was_taken_starts_on_another(taken_port, tiny_folder, tmp_path):
    port, handed = taken_port
    r = Router(tiny_folder, None, cache_dir=tmp_path, redis_url=None)
    try:
        assert len(handed) == 2 and r.port == handed[1] != port
        assert r.proc.poll() is None
        # Serving already (no worker yet: not ready), on the port it was given.
        assert httpx.get(f"http://127.0.0.1:{r.port}/ready", timeout=10).status_code == 503
        assert "address already in use" in open(r.log.name).read().lower()
    finally:
        r.close()


def test_a_start_that_fails_otherwise_is_not_retried(monkeypatch, tmp_path):
    """argparse's usage error exits 2 as a failed bind does; only the bind error retries."""
    handed = []
    real = testing.processes.free_port
    monkeypatch.setattr(testing.processes, "free_port", lambda: handed.append(real()) or handed[-1])
    with pytest.raises(RuntimeError, match="unrecognized arguments"):
        Router(None, None, cache_dir=tmp_path, redis_url=None, extra=["--no-such-flag"])
    assert len(handed) == 1


def test_the_internal_token_is_random_in_each_process():
    code = "from testing.cluster import TOKEN; print(TOKEN)"
    tokens = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip() for _ in range(2)]
    assert len({*tokens, TOKEN}) == 3
    assert all(len(t) >= 32 for t in (*tokens, TOKEN))


def test_a_token_that_looks_like_a_flag_still_reaches_the_worker(tiny_folder, tmp_path):
    """A urlsafe token starting with "-" once made every worker of one test process exit
    ("--internal-token: expected one argument"): the harness passes it as --internal-token=T."""
    token = "-looks-like-a-flag-" * 2
    # No drain on stop: the prefill's blocks stay leased (30 s) with nobody to pull them.
    w = Worker("colocated", str(tiny_folder), cache_dir=tmp_path, token=token,
               extra=["--drain-timeout-s", "0"])  # raises if it exits
    try:
        out = w.prefill("flag-token", [5, 6, 7, 8, 9], {"temperature": 0, "max_tokens": 2})
        assert out["request_id"] == "flag-token"
    finally:
        w.stop()
        w.close()
