"""How a cluster stops and restarts (issue 17): each service drains on SIGTERM (deregisters at
once, finishes or hands off its streams, exits 0); a rolling restart of every worker under
streaming load fails no request and loses or repeats no token; `tandem up` stopped by SIGTERM or
killed by SIGKILL leaves no process and no Redis key behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from common.registry import RedisKeys
from testing.cluster import TOKEN, Router, Worker, two_by_two
from testing.processes import ROOT, alive, descendants, free_port
from testing.redis_server import REDIS_URL
from testing.streaming_load import StreamingLoad

TINY = "tiny-random"


def _redis() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL)


def _keys(ns: str) -> list[bytes]:
    return list(_redis().scan_iter(match=f"tandem:{ns}:*", count=1000))


def _wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    pytest.fail(f"not within {timeout} s: {what}")


@pytest.fixture(scope="module")
def cluster_2p2d(tiny_folder, tmp_path_factory):
    """One 2P+2D cluster for the module: a test that stops a worker starts it again."""
    ns = f"roll-{uuid.uuid4().hex[:8]}"
    with two_by_two(tiny_folder, tmp_path_factory.mktemp("roll"), ns) as (router, workers):
        yield router, workers, ns


def test_sigterm_deregisters_at_once_and_exits_zero(cluster_2p2d):
    router, workers, ns = cluster_2p2d
    d = workers[2]
    key = RedisKeys(ns).worker(d.worker_id)
    try:
        assert _redis().exists(key)
        d.proc.send_signal(signal.SIGTERM)
        _wait_until(lambda: not _redis().exists(key), 3.0, "the registration deleted")
        assert d.proc.wait(30) == 0
        assert "Traceback" not in Path(d.log.name).read_text()
    finally:  # the cluster whole again for the next test (same port: same id)
        if d.proc.poll() is not None:
            d.restart()
            router.wait_workers(4)


def test_rolling_restart_under_streaming_load_loses_nothing(cluster_2p2d):
    router, workers, ns = cluster_2p2d
    load = StreamingLoad(router.url, TINY, num_clients=3, max_tokens=40).start()
    time.sleep(1.0)
    for w in workers:
        ok_before = load.num_ok
        assert w.stop(signal.SIGTERM) == 0, Path(w.log.name).read_text()[-2000:]
        w.restart()
        router.wait_workers(4)
        # The load keeps flowing through every restart.
        _wait_until(lambda ok=ok_before: load.num_ok > ok + 3, 30, "answers after a restart")
    result = load.stop()
    assert result["failures"] == [] and result["mismatches"] == [], result
    assert result["ok"] >= 20
    r = _redis()
    for w in workers:  # every worker back in the index
        assert r.exists(RedisKeys(ns).worker(w.worker_id))
    assert set(router.client.get("/ready").json()["workers"]) == {w.worker_id for w in workers}


def test_a_stream_open_when_the_routers_drain_ends_gets_an_error_event(tiny_folder, tmp_path):
    """The router's drain (its own SIGTERM, its worker still up) outlasted by a stream: the
    stream ends with an OpenAI error event and [DONE] at --drain-timeout-s, and the router
    exits 0. Before, uvicorn's graceful shutdown cancelled it there and closed the connection
    with neither (a silent cut; on a loaded machine `tandem up`'s stop above, whose workers'
    hand-offs reached the router after its drain had ended, failed so)."""
    ns = f"rdrain-{uuid.uuid4().hex[:8]}"
    w = Worker("colocated", str(tiny_folder), cache_dir=tmp_path, namespace=ns, num_blocks=1024)
    router = Router(tiny_folder, ns, cache_dir=tmp_path, extra=["--drain-timeout-s", "1"])
    try:
        router.wait_workers(1)
        results: list[str] = []
        started = threading.Event()
        # ignore_eos and 1,900 tokens: seconds of streaming, far longer than the 1 s drain.
        t = threading.Thread(target=_stream, args=(router.url, 0, results, started, 1900))
        t.start()
        assert started.wait(60), results
        router.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert results == ["error"], (results, Path(router.log.name).read_text()[-3000:])
        assert router.proc.wait(30) == 0
    finally:
        router.close()
        w.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_stopping_tandem_up_leaves_no_process_and_no_key(sig, tiny_folder, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_folder),
           "--port", str(port), "--redis-url", REDIS_URL, "--cache-dir", str(tmp_path),
           "--threads", "1", "--num-blocks", "256", "--drain-timeout-s", "5"]
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                          env={**os.environ, "TANDEM_INTERNAL_TOKEN": TOKEN},
                          start_new_session=True)
    family: set[int] = set()
    try:
        url = f"http://127.0.0.1:{port}"
        # The launcher's own limits (300 s for the workers, 60 s for the router): a loaded
        # machine took more than 120 s to start this cluster.
        _wait_until(lambda: up.poll() is None and _ready(url), 360, "tandem up ready")
        # The default namespace names the port, and a suffix keeps two clusters apart.
        ns = re.search(r"namespace '([^']+)'", (tmp_path / "up.log").read_text()).group(1)
        assert re.fullmatch(rf"local-{port}-[0-9a-f]{{6}}", ns), ns
        assert _keys(ns)
        results: list[str] = []
        started = [threading.Event() for _ in range(2)]
        streams = [threading.Thread(target=_stream, args=(url, i, results, started[i]))
                   for i in range(2)]
        for t in streams:
            t.start()
        # The streams are running (their first chunk came): a connection the router had not
        # taken yet when it stopped listening would be refused, which is no cut of a stream.
        for e in started:
            assert e.wait(60), results
        family = descendants(up.pid)
        assert len(family) >= 3  # two workers and the router at least
        up.send_signal(sig)
        for t in streams:
            t.join(60)
        # Every stream finished, or ended with a clean error (never a hang or a cut).
        assert len(results) == 2 and all(r in ("done", "error") for r in results), (
            results, (tmp_path / "up.log").read_text()[-3000:])
        if sig == signal.SIGTERM:
            assert up.wait(60) == 0
        _wait_until(lambda: not any(alive(p) for p in family), 40,
                    f"every process of the cluster gone: {[p for p in family if alive(p)]}")
        _wait_until(lambda: not _keys(ns), 10, f"no key of {ns} left: {_keys(ns)}")
    finally:
        for pid in family | {up.pid}:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        up.wait(10)
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _stream(url: str, i: int, results: list[str], started: threading.Event | None = None,
            max_tokens: int = 1500) -> None:
    """One long streamed completion; appends how it ended: "done" ([DONE] after the last
    chunk), "error" (an HTTP error, or an error event before the stream closed) or "cut: ..."
    (closed with neither, or not at all within the client's 60 s)."""
    body = {"model": TINY, "prompt": f"a long story {i}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    outcome, lines = "cut", 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                outcome = "error"
            for line in r.iter_lines():
                lines += 1
                if started is not None:
                    started.set()
                if line == "data: [DONE]":
                    outcome = "done" if outcome != "error" else outcome
                elif line.startswith("data: ") and '"error"' in line:
                    outcome = "error"
        if outcome == "cut":
            outcome = f"cut: closed after {lines} lines"
    except httpx.HTTPError as e:
        outcome = f"cut: {e!r} after {lines} lines"
    finally:
        if started is not None:
            started.set()
    results.append(outcome)
