"""Hostile clients, peers and Redis entries against a real cluster (router, workers, Redis), and
the dead-worker path end to end. Issue items 1, 7, 8, 9, 12, 13, the engine-failure contract and
secure defaults."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from common.registry import RedisKeys, registration_signature
from testing.cluster import TOKEN, Router, Worker
from testing.processes import ROOT, free_port
from testing.redis_server import REDIS_URL
from tests.polling import wait_for
from tests.security.fakes import FakePeer

pytestmark = pytest.mark.redis

MODEL = "tiny-random"


def complete(r: Router, headers: dict | None = None, **body) -> httpx.Response:
    return r.client.post("/v1/completions", headers=headers or {},
                         json={"model": MODEL, "prompt": "hello there", "max_tokens": 4, **body})


def ready_workers(r: Router) -> dict:
    try:
        return r.client.get("/ready").json().get("workers", {})
    except httpx.HTTPError:
        return {}


@pytest.fixture(scope="module")
def cluster(tiny_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp("hardening")
    ns = f"hard-{uuid.uuid4().hex[:6]}"
    p = Worker("prefill", str(tiny_folder), cache_dir=work, namespace=ns)
    d = Worker("decode", str(tiny_folder), cache_dir=work, namespace=ns)
    r = Router(tiny_folder, ns, cache_dir=work)
    r.wait_workers(2)
    yield r, p, d, ns, work
    r.close()
    p.close()
    d.close()


def test_extreme_sampling_values_are_400s_and_every_engine_lives(cluster):
    """Item 1: `top_k: 2**63` passed both HTTP layers and killed the engine thread, on the
    prefill worker and then on the decode worker it fell back to: 503s for good."""
    r, p, d, _, _ = cluster
    for value in (2**63, 2**64, -(2**63) - 1):
        resp = complete(r, top_k=value)
        assert resp.status_code == 400, (value, resp.text)
    # In range for the wire, over this model's vocabulary: the worker's 400, relayed.
    resp = complete(r, top_k=100_000)
    assert resp.status_code == 400 and "top_k" in resp.json()["error"]["message"], resp.text
    sampling = {"temperature": 0.5, "top_k": 2**63, "max_tokens": 2}
    assert p.client.post("/prefill", json={"request_id": "tk-p", "prompt_token_ids": [1, 2, 3],
                                           "sampling": sampling}).status_code == 400
    assert d.client.post("/generate", json={"request_id": "tk-d", "prompt_token_ids": [1, 2, 3],
                                            "sampling": sampling}).status_code == 400
    for w, extra in ((d, {}), (p, {"kv_transfer_params": {"do_remote_decode": True}})):
        resp = w.client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2,
                                                      "top_k": 2**63, **extra})
        assert resp.status_code == 400, resp.text
        resp = w.client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2,
                                                      "top_k": 100_000, **extra})
        assert resp.status_code == 400, resp.text
    for w in (p, d):
        assert w.client.get("/ready").status_code == 200
    ok = complete(r, top_k=5, max_tokens=6)
    assert ok.status_code == 200, ok.text


def test_client_request_ids_never_reach_the_workers(cluster):
    """Item 7: three requests reusing one X-Request-Id made the decode worker answer 500, which
    opened its circuit breaker: 503 for every user for 5 s."""
    r, _, d, _, _ = cluster
    headers = {"X-Request-Id": "same-id"}
    with cf.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: complete(r, headers, max_tokens=16, ignore_eos=True),
                                range(3)))
    assert [x.status_code for x in results] == [200, 200, 200], [x.text for x in results]
    assert all(x.json()["tandem"]["client_request_id"] == "same-id" for x in results)
    assert len({x.json()["id"] for x in results}) == 3
    assert complete(r).status_code == 200  # no breaker opened
    # A worker given one id twice at once answers 409 (the caller's fault), not 500.
    body = {"request_id": "dup-1", "prompt_token_ids": [5, 6, 7],
            "sampling": {"max_tokens": 40, "ignore_eos": True}}
    with d.client.stream("POST", "/generate", json=body) as first:
        assert first.status_code == 200
        second = d.client.post("/generate", json=body)
        assert second.status_code == 409, second.text
        assert second.json()["error"]["code"] == "duplicate_request_id"
        first.read()


def test_a_malformed_registration_does_not_stop_discovery(cluster, tiny_folder):
    """Item 8: a non-integer block_size in one worker's Redis hash killed the discovery loop:
    new workers never joined, departed ones were never dropped."""
    r, _, _, ns, work = cluster
    client = redis.Redis.from_url(REDIS_URL)
    bad = RedisKeys(ns).worker("decode-bad")
    client.hset(bad, mapping={"role": "decode", "url": "http://127.0.0.1:1", "block_size": "x",
                              "load": "{not json"})
    client.expire(bad, 60)
    try:
        wait_for(lambda: r.metrics().get('tandem_background_errors_total{task="worker_discovery"}',
                                         0) > 0,
                 10, "the bad entry to be counted")
        d2 = Worker("decode", str(tiny_folder), cache_dir=work, namespace=ns)
        try:
            wait_for(lambda: d2.worker_id in ready_workers(r), 15, "the new worker to join")
        finally:
            d2.close()
        wait_for(lambda: d2.worker_id not in ready_workers(r), 15, "the departed worker to leave")
        assert "decode-bad" not in ready_workers(r)
    finally:
        client.delete(bad)
        client.close()


def test_a_heartbeating_worker_that_is_not_ready_gets_no_traffic(cluster):
    """The router health-checks Redis-discovered workers too: a registration whose worker does
    not answer /ready is never offered to the policy."""
    r, _, _, ns, _ = cluster
    fake = FakePeer()  # answers 404 to everything
    client = redis.Redis.from_url(REDIS_URL)
    key = RedisKeys(ns).worker("decode-zombie")
    fields = {"role": "decode", "url": fake.url, "block_size": "4", "capacity": "256"}
    fields["signature"] = registration_signature("decode-zombie", fields, TOKEN)  # a token holder
    client.hset(key, mapping=fields)
    client.expire(key, 30)
    try:
        wait_for(lambda: "/ready" in fake.hits, 10, "the router to probe the zombie")
        time.sleep(0.5)
        for _ in range(8):
            assert "decode-zombie" not in ready_workers(r)
            assert complete(r, max_tokens=3).status_code == 200
            time.sleep(0.25)
    finally:
        client.delete(key)
        client.close()
        fake.close()


def test_a_registration_without_the_token_is_never_contacted(cluster):
    """Whoever can write to Redis cannot make the router send requests (and the internal token)
    to a host of its choosing: registrations are signed with the internal token."""
    r, _, _, ns, _ = cluster
    fake = FakePeer()
    client = redis.Redis.from_url(REDIS_URL)
    key = RedisKeys(ns).worker("decode-forged")
    fields = {"role": "decode", "url": fake.url, "block_size": "4", "capacity": "256"}
    client.hset(key, mapping={
        **fields, "signature": registration_signature("decode-forged", fields, "guess")})
    client.expire(key, 30)
    try:
        before = r.metrics().get('tandem_background_errors_total{task="worker_discovery"}', 0)
        wait_for(lambda: r.metrics().get('tandem_background_errors_total{task="worker_discovery"}',
                                         0) > before,
                 10, "the forged registration to be refused")
        for _ in range(4):
            assert complete(r, max_tokens=3).status_code == 200
        time.sleep(2.5)  # a probe round
        assert fake.hits == [] and "decode-forged" not in ready_workers(r)
    finally:
        client.delete(key)
        client.close()
        fake.close()


def test_non_ascii_credentials_are_401s(cluster, tiny_folder):
    """Item 12: a non-ASCII Authorization header gave a 500 with a traceback."""
    _, p, d, ns, work = cluster
    bad = {"Authorization": b"Bearer \xff\xfe\xc3("}
    for w, path in ((p, "/prefill"), (d, "/generate"), (p, "/kv/metadata")):
        method = "GET" if path == "/kv/metadata" else "POST"
        resp = httpx.request(method, f"{w.url}{path}", headers=bad, json={}, timeout=10)
        assert resp.status_code == 401, (path, resp.text)
    keyed = Router(tiny_folder, ns, cache_dir=work, extra=["--api-key", "client-key"])
    try:
        keyed.wait_workers(2)
        resp = complete(keyed, bad)
        assert resp.status_code == 401, resp.text
        assert complete(keyed, {"Authorization": "Bearer client-key"}).status_code == 200
    finally:
        keyed.close()


def test_limits_and_cheap_checks_come_before_tokenizing(cluster, tiny_folder):
    """Item 9: a 4 MiB body was tokenized on the event loop before the context check and
    before the rate limiter, and never counted against the key's limit."""
    _, _, _, ns, work = cluster
    r = Router(tiny_folder, ns, cache_dir=work,
               extra=["--api-key", "k", "--rate-limit-rpm", "3"])
    try:
        r.wait_workers(2)
        auth = {"Authorization": "Bearer k"}
        huge = "abc " * (900 << 10)  # 3.5 MiB of text
        for _ in range(3):
            resp = r.client.post("/v1/completions", headers=auth,
                                 json={"model": MODEL, "prompt": huge, "max_tokens": 4})
            assert resp.status_code == 400, resp.text[:300]
            assert resp.json()["error"]["code"] == "context_length_exceeded"
        resp = r.client.post("/v1/completions", headers=auth,
                             json={"model": MODEL, "prompt": huge, "max_tokens": 4})
        assert resp.status_code == 429 and "Retry-After" in resp.headers, resp.text[:300]
        assert r.client.get("/health").status_code == 200
    finally:
        r.close()


def test_compose_has_no_default_token():
    """Item 13: compose fell back to the token `change-me`."""
    compose = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())
    values = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "TANDEM_INTERNAL_TOKEN":
                    values.append(v)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(compose)
    assert values
    for v in values:
        assert v.startswith("${TANDEM_INTERNAL_TOKEN:?"), v  # required, no default
        assert "change-me" not in v


def test_a_worker_beyond_loopback_needs_a_token(tiny_folder, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_INTERNAL_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "prefill", "--model",
                           str(tiny_folder), "--host", "0.0.0.0", "--port", str(free_port())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "internal token" in proc.stderr and "--insecure" in proc.stderr


# ---- the dead-worker path --------------------------------------------------------------------


def test_a_dead_engine_is_a_dead_worker(tiny_folder, tmp_path):
    """If the engine thread dies, the worker fails its requests, leaves Redis at once, and exits
    non-zero; the router stops routing there."""
    ns = f"dead-{uuid.uuid4().hex[:6]}"
    p = Worker("prefill", str(tiny_folder), cache_dir=tmp_path, namespace=ns)
    d = Worker("decode", str(tiny_folder), cache_dir=tmp_path, namespace=ns, ttl=30.0,
               extra=["--enable-fault-injection"])
    r = Router(tiny_folder, ns, cache_dir=tmp_path)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        r.wait_workers(2)
        assert complete(r).status_code == 200
        # A stream in flight when the engine dies ends with an error event, not a hang.
        body = {"request_id": "inflight", "prompt_token_ids": [3, 4, 5],
                "sampling": {"max_tokens": 500, "ignore_eos": True}}
        with d.client.stream("POST", "/generate", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(lines)
            assert d.client.post("/debug/engine-fault").json() == {"injected": True}
            rest = list(lines)
        assert '"error"' in rest[-1], rest[-3:]
        assert d.proc.wait(30) == 1
        # Deregistered at once (its heartbeat TTL is 30 s: expiry did not do this).
        assert not client.exists(RedisKeys(ns).worker(d.worker_id),
                                 RedisKeys(ns).blocks(d.worker_id))
        wait_for(lambda: d.worker_id not in ready_workers(r), 10, "the router to drop the worker")
        resp = complete(r)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_workers", resp.text
    finally:
        client.close()
        r.close()
        d.close()
        p.close()


def _procs_of(ns: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tandem.cli" in cmd and ns.encode() in cmd:
            out.append(int(pid))
    return out


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def test_tandem_up_generates_a_token_and_restarts_a_dead_worker(tmp_path):
    """`tandem up` sets a fresh internal token per cluster (the internal plane is never open by
    default) and starts a worker again after it exits (here: its engine failed)."""
    ns = f"up-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_INTERNAL_TOKEN"}
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--model", MODEL,
                           "--cache-dir", str(tmp_path), "--port", str(port), "--namespace", ns,
                           "--num-blocks", "64", "--enable-fault-injection"],
                          cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    router = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ok(f"{router}/ready") or up.poll() is not None, 180, "tandem up")
        assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        decode = [pid for pid in _procs_of(ns) if "decode" in _cmdline(pid)]
        assert len(decode) == 1
        cmd = _cmdline(decode[0])
        url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        token = _environ(decode[0]).get("TANDEM_INTERNAL_TOKEN")
        assert token and len(token) >= 32 and token not in cmd  # by environment, not argv
        assert httpx.get(f"{url}/kv/metadata", timeout=10).status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"{url}/kv/metadata", headers=auth, timeout=10).status_code == 200
        assert httpx.post(f"{url}/debug/engine-fault", headers=auth, timeout=10).status_code == 200
        wait_for(lambda: not os.path.exists(f"/proc/{decode[0]}") or _zombie(decode[0]), 30,
                 "the failed worker to exit")
        wait_for(lambda: [pid for pid in _procs_of(ns) if "decode" in _cmdline(pid)
                          and pid != decode[0]], 30, "tandem up to restart it")
        wait_for(lambda: _ok(f"{url}/ready"), 120, "the restarted worker")
        wait_for(lambda: _ok(f"{router}/ready"), 30, "the router to see it")
        resp = httpx.post(f"{router}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert "restarting" in (tmp_path / "up.log").read_text()
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
        for pid in _procs_of(ns):
            os.kill(pid, signal.SIGKILL)
        log.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
