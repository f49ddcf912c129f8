"""Issue 28, hardening round two: hostile clients against a real cluster (router, prefill and
decode workers, Redis). Items 1 and 7 (grammar bombs, constraints that fail in the grammar
engine), 2 (n > 1 admission) and 3 (resources held after the client stops caring). One cluster
is shared by the file; each test leaves it as it found it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from common.block_events import MAX_HASHES_PER_ENTRY
from common.registry import EVENT_SHARDS, RedisKeys
from testing.cluster import Router, Worker
from testing.metrics import series_sum
from testing.redis_server import REDIS_URL
from tests.polling import wait_for
from tests.security.slow_client import UnreadStream

pytestmark = pytest.mark.redis

MODEL = "tiny-random"
WRITE_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 2.0
BOMBS = [
    ("guided_regex", {"guided_regex": "((a{1000}){1000})"}),
    ("guided_regex", {"guided_regex": "(a{10000}){10000}"}),
    ("guided_regex", {"guided_regex": "((ab){1000}){1000}"}),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bomb", "schema": {"type": "string", "pattern": "^((a{100}){100}){100}$"}}}}),
    ("guided_grammar", {"guided_grammar": 'start: /((a{1000}){1000})/'}),
]
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def cluster(tiny_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp("round-two")
    ns = f"r2-{uuid.uuid4().hex[:6]}"
    procs: list = []
    try:
        procs.append(Worker("prefill", str(tiny_folder), cache_dir=work, namespace=ns,
                            num_blocks=2048))
        procs.append(Worker("decode", str(tiny_folder), cache_dir=work, namespace=ns,
                            num_blocks=2048))
        r = Router(tiny_folder, ns, cache_dir=work, extra=[
            "--stream-write-timeout-s", str(WRITE_TIMEOUT_S),
            "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", "3"])
        procs.append(r)
        r.wait_workers(2)
        r.namespace = ns
        yield r, procs[0], procs[1]
    finally:
        for p in reversed(procs):
            p.close()


def complete(r: Router, **body) -> httpx.Response:
    return r.client.post("/v1/completions",
                         json={"model": MODEL, "prompt": "hello there", "max_tokens": 4, **body})


def generated(*workers: Worker) -> float:
    return sum(series_sum(w.metrics(), "tandem_generation_tokens_total") for w in workers)


def quiet(*workers: Worker, timeout: float = 20.0) -> None:
    """Until no worker generates any more (what earlier tests started has ended)."""
    deadline = time.monotonic() + timeout
    last = generated(*workers)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = generated(*workers)
        if now == last:
            return
        last = now
    raise AssertionError("the workers kept generating")


def inflight(r: Router) -> float:
    return r.metrics()["tandem_router_inflight_requests"]


# ---- items 1 and 7: grammars ----------------------------------------------------------------


def test_grammar_bombs_are_400s_naming_the_field_and_never_reach_an_engine(cluster):
    """Item 1: a 40-byte regex compiled in 1 ms, then its first mask held the engine thread for
    1-2 s: four clients looping it opened both workers' breakers. Now the router computes the
    first masks under llguidance's limits, off its event loop, and refuses it."""
    r, p, d = cluster
    quiet(p, d)
    before = generated(p, d)
    for param, fields in BOMBS:
        t0 = time.monotonic()
        resp = complete(r, n=8, **fields)
        assert resp.status_code == 400, (param, resp.text)
        err = resp.json()["error"]
        assert err["param"] == param, resp.text
        assert time.monotonic() - t0 < 2.0
    assert generated(p, d) == before  # no engine saw a bomb
    # Ordinary constraints still pass.
    ok = complete(r, guided_regex="[a-z]{1,8}", max_tokens=8, temperature=0)
    assert ok.status_code == 200, ok.text
    choice = complete(r, guided_choice=["yes", "no"], max_tokens=4)
    assert choice.status_code == 200 and choice.json()["choices"][0]["text"] in ("yes", "no")


def test_a_victim_is_served_while_clients_send_bombs(cluster):
    """Item 1's attack: while four clients loop grammar bombs with n=8, another client's
    requests are answered (no 503, no breaker opened)."""
    r, _, _ = cluster
    stop = threading.Event()
    codes: list[int] = []

    def attacker(i: int) -> None:
        with httpx.Client(base_url=r.url, timeout=30) as c:
            while not stop.is_set():
                _, fields = BOMBS[i % len(BOMBS)]
                codes.append(c.post("/v1/completions", json={
                    "model": MODEL, "prompt": "x", "max_tokens": 16, "n": 8, **fields}).status_code)

    threads = [threading.Thread(target=attacker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        worst = 0.0
        for _ in range(10):
            t0 = time.monotonic()
            resp = complete(r, max_tokens=8)
            worst = max(worst, time.monotonic() - t0)
            assert resp.status_code == 200, resp.text
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert codes and set(codes) == {400}, set(codes)
    assert worst < 5.0, worst


def test_a_constraint_that_fails_in_the_grammar_engine_is_an_error_not_stop(cluster):
    """Item 7: a recursive required schema answered 200 `finish_reason: stop` with `'{"'`,
    which breaks it; the regex bomb gave `'aaaa'`. The router refuses both up front, and a
    worker that meets one anyway ends the request with finish reason `error`."""
    r, _, d = cluster
    resp = complete(r, response_format={"type": "json_schema", "json_schema": {
        "name": "loop", "schema": RECURSIVE}}, max_tokens=16)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format", resp.text
    for kind, spec in (("json", json.dumps(RECURSIVE)), ("regex", "((a{1000}){1000})")):
        events = d.generate(f"g7-{kind}-{uuid.uuid4().hex[:6]}", [5, 6, 7], {
            "max_tokens": 16, "temperature": 0, "structured": {"kind": kind, "spec": spec}})
        assert events[-1]["finish_reason"] == "error", events[-3:]
        assert d.client.get("/ready").status_code == 200  # the worker lives on


# ---- item 2: n > 1 ----------------------------------------------------------------------------


def test_n_choices_are_validated_before_any_starts(cluster):
    """Item 2: `n: 8` with `seed` = 2**63 - 7 answered 400 (the last choice's seed overflows)
    while the other seven generated on, 1,500 tokens each, with no admission slot counted."""
    r, p, d = cluster
    quiet(p, d)
    before = generated(p, d)
    resp = complete(r, n=8, seed=2**63 - 7, max_tokens=1500, ignore_eos=True)
    assert resp.status_code == 400, resp.text
    time.sleep(2.0)
    assert generated(p, d) == before, "choices of a refused request generated"
    assert inflight(r) == 0


# ---- item 3: clients that stop caring -----------------------------------------------------------


def test_a_non_streaming_request_is_aborted_when_its_client_leaves(cluster):
    """Item 3c: 4 generations were still running 29 s after their client disconnected."""
    r, p, d = cluster
    quiet(p, d)
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1800, "n": 4,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", r.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 20
        while generated(p, d) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    time.sleep(1.5)
    a = generated(p, d)
    time.sleep(2.0)
    assert generated(p, d) == a, "the workers kept generating for a client that left"
    assert inflight(r) == 0


def _unread_stream(port: int, max_tokens: int, n: int = 8) -> UnreadStream:
    """A streaming chat request for `n` choices with 20 top logprobs each that its client stops
    reading after the first bytes (on a socket with a 4 KiB receive buffer)."""
    return UnreadStream(port, {"n": n, "max_tokens": max_tokens, "ignore_eos": True,
                               "logprobs": True, "top_logprobs": 20,
                               "messages": [{"role": "user", "content": "hi"}]})


def test_a_streaming_client_that_stops_reading_is_cut_and_frees_its_slot(cluster):
    """Items 3a and 3b: a streaming client that stopped reading kept its admission slot for
    330 s, and the router buffered every choice's frames (18 MB for one request)."""
    r, p, d = cluster
    quiet(p, d)
    s = _unread_stream(r.port, max_tokens=1800)
    try:
        deadline = time.monotonic() + 60
        while inflight(r) != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert inflight(r) == 0, "a client that reads nothing still holds its slot"
        a = generated(p, d)
        time.sleep(1.5)
        assert generated(p, d) == a, "its worker streams still run"
    finally:
        s.close()
    assert complete(r).status_code == 200



def test_a_cut_stream_closes_its_worker_streams_at_once(cluster, tiny_folder, tmp_path):
    """Item 3a, the rest of it: a cut stream whose generations are parked frees them at once,
    not at the worker's parked timeout (30 s). A router whose deadline (12 s) comes after the
    parking: once it cuts, the decode worker has nothing left running, waiting or parked within
    10 s, and the router logged no "aclose(): asynchronous generator is already running" (seen
    at cuts in bench/attack.py runs, when a choice's task was waiting on a silent worker stream;
    that race, which this cluster does not always meet, is pinned in
    tests/router/test_sse_close.py)."""
    _, p, d = cluster
    quiet(p, d)
    r = Router(tiny_folder, cluster[0].namespace, cache_dir=tmp_path,
               extra=["--stream-write-timeout-s", "12"])
    s = None
    try:
        r.wait_workers(2)
        log = Path(r.log.name)
        s = _unread_stream(r.port, max_tokens=1800)
        wait_for(lambda: d.metrics()["tandem_worker_parked_requests"] == 8, 60,
                 "the unread stream's 8 generations parked")
        wait_for(lambda: inflight(r) == 0, 60, "the stream cut")
        # Parked generations would stay 30 s (--parked-timeout-s); closed ones go now.
        wait_for(lambda: all(d.metrics()[f"tandem_worker_{k}_requests"] == 0
                             for k in ("running", "waiting", "parked")), 10,
                 "the decode worker's generations of the cut stream aborted")
        assert "already running" not in log.read_text()
    finally:
        if s is not None:
            s.close()
        r.close()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_stream_that_is_not_read_holds_bounded_memory_in_the_router(cluster, tiny_folder,
                                                                      tmp_path):
    """Item 3b: for n > 1 the router buffered every choice's frames in an unbounded queue: one
    request with `top_logprobs: 20` that its client did not read grew the router by 18 MB
    (n x max_tokens x ~1.4 KB). A router with a write deadline long enough not to cut the
    stream: once the workers stop producing, the router has grown by a fraction of what the
    request would have buffered (each choice holds 32 frames and a 32 KiB read buffer; the
    rest waits in the worker's stream, whose writes wait on the router)."""
    _, p, d = cluster
    quiet(p, d)
    r = Router(tiny_folder, cluster[0].namespace, cache_dir=tmp_path,
               extra=["--stream-write-timeout-s", "600"])
    n, max_tokens = 8, 1500
    s = None
    try:
        r.wait_workers(2)
        for _ in range(3):  # warm: the router's own allocations for such a request are made
            assert r.client.post("/v1/chat/completions", json={
                "model": MODEL, "n": 2, "max_tokens": 16, "logprobs": True, "top_logprobs": 20,
                "stream": True, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        before = _rss_bytes(r.proc.pid)
        s = _unread_stream(r.port, max_tokens=max_tokens, n=n)
        start = generated(p, d)
        deadline = time.monotonic() + 120
        last = -1.0
        while time.monotonic() < deadline:  # until the workers stop producing for it
            time.sleep(2.0)
            now = generated(p, d)
            if now == last:
                break
            last = now
        produced = last - start
        assert produced > 0, "the stream never started"
        grown = _rss_bytes(r.proc.pid) - before
        would_buffer = produced * 1400  # what the router held before: every frame produced
        assert grown < 8 << 20, (
            f"the router grew by {grown / 1e6:.1f} MB while {produced:.0f} tokens were produced")
        assert inflight(r) == n  # the stream is alive (n choices), waiting on its client
        print(f"produced {produced:.0f} tokens (~{would_buffer / 1e6:.1f} MB of frames); "
              f"router grew {grown / 1e6:.1f} MB")
    finally:
        if s is not None:
            s.close()
        r.close()
    quiet(p, d, timeout=60)


def _send_queue(port: int) -> list[int]:
    """Bytes queued in the kernel on each established connection from `port` (ss's Send-Q)."""
    out = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return [int(line.split()[1]) for line in out.splitlines() if line.strip()]


def test_a_client_that_reads_nothing_absorbs_a_bounded_part_of_its_stream(cluster):
    """Item 3a's cause: a client that stopped reading let the router's kernel buffers absorb
    MBs of its stream (send-buffer autotuning) before a write blocked, so the write deadline
    did not start counting. The router's connections now have a 256 KiB send buffer
    (`--send-buffer-bytes`): what waits in the kernel for such a client stays below twice that
    (the kernel doubles the figure for its bookkeeping)."""
    r, p, d = cluster
    quiet(p, d)
    s = _unread_stream(r.port, max_tokens=1500)
    try:
        most = 0
        deadline = time.monotonic() + WRITE_TIMEOUT_S + 1
        while time.monotonic() < deadline:
            most = max([most, *_send_queue(r.port)])
            time.sleep(0.1)
        assert 0 < most <= 2 * (256 << 10), most
    finally:
        s.close()
    quiet(p, d, timeout=60)


def _post_raw(port: int, path: str, body: dict, key: str) -> socket.socket:
    """A request sent on a socket of its own (closing it is the client leaving)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
              + data)
    return s


def _engine_requests(*workers: Worker) -> float:
    return sum(w.metrics()["tandem_worker_running_requests"]
               + w.metrics()["tandem_worker_waiting_requests"] for w in workers)


def test_one_client_cannot_take_the_workers_from_another(cluster, tiny_folder, tmp_path):
    """Item 1's class (one client taking the engines from the others): a router with per-client
    limits (`--client-max-running 8`, clients told apart by API key) runs at most 8 of one
    client's choices at once, whatever it queues, and another client's request goes ahead of
    that client's queued ones."""
    _, p, d = cluster
    quiet(p, d)
    r = Router(tiny_folder, cluster[0].namespace, cache_dir=tmp_path, extra=[
        "--api-key", "a-key", "--api-key", "b-key", "--client-max-running", "8"])
    hogs: list[socket.socket] = []
    try:
        r.wait_workers(2)
        body = {"model": MODEL, "prompt": "hog", "n": 8, "max_tokens": 1500, "ignore_eos": True}
        hogs = [_post_raw(r.port, "/v1/completions", body, "a-key") for _ in range(3)]
        wait_for(lambda: _engine_requests(p, d) >= 8, 30, "the first hog to run")
        most = 0.0
        for _ in range(10):
            most = max(most, _engine_requests(p, d))
            time.sleep(0.2)
        assert most <= 8, f"{most} of one client's choices ran at once"
        assert inflight(r) == 8 + 2  # 8 choices running, the 2 other requests queued
        t0 = time.monotonic()
        resp = r.client.post("/v1/completions", headers={"Authorization": "Bearer b-key"},
                             json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert time.monotonic() - t0 < 20  # not behind the hog's 1,500-token choices
    finally:
        for s in hogs:
            s.close()
        r.close()
    quiet(p, d, timeout=60)


def test_partial_headers_and_bodies_are_cut(cluster):
    """Item 3d: connections with partial headers or a partial body were held indefinitely."""
    r, _, _ = cluster
    with socket.create_connection(("127.0.0.1", r.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        s.settimeout(HEADER_TIMEOUT_S + 10)
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the router
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 5
    with socket.create_connection(("127.0.0.1", r.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\":")
        s.settimeout(20)
        answer = s.recv(4096)
        assert b" 408 " in answer.split(b"\r\n")[0], answer[:200]
    assert complete(r).status_code == 200


# ---- item 4: Redis is data ----------------------------------------------------------------------


def ready(r: Router) -> dict:
    return r.client.get("/ready").json()


def discovery_errors(r: Router) -> float:
    return r.metrics().get('tandem_background_errors_total{task="worker_discovery"}', 0.0)


def feed_errors(r: Router) -> float:
    return r.metrics().get('tandem_background_errors_total{task="index_feed"}', 0.0)


@pytest.fixture
def rds():
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


def test_a_wrong_typed_registration_is_skipped_and_counted(cluster, rds):
    """Item 4a: `SET worker:{evil} x` failed the whole discovery pipeline: nothing joined or
    left from then on, and nothing was counted."""
    r, _, _ = cluster
    ns = r.namespace
    key = RedisKeys(ns).worker("decode-evil")
    before = discovery_errors(r)
    rds.set(key, "x", ex=30)
    try:
        wait_for(lambda: discovery_errors(r) > before, 10, "the bad key to be counted")
        time.sleep(1.0)
        assert ready(r)["redis"] is True  # discovery rounds succeed around it
        assert len(ready(r)["workers"]) == 2
        assert complete(r).status_code == 200
    finally:
        rds.delete(key)


def test_a_wrong_typed_event_stream_is_skipped(cluster, rds):
    """Item 4b: a wrong-typed `events:{...}` key failed every poll of the replica index: no new
    block events were applied from any stream."""
    r, p, d = cluster
    keys = RedisKeys(r.namespace)
    busy = {keys.event_shard(p.worker_id), keys.event_shard(d.worker_id)}
    shard = next(s for s in range(EVENT_SHARDS) if s not in busy)
    rds.delete(keys.events(shard))
    rds.set(keys.events(shard), "x", ex=30)
    try:
        errors = feed_errors(r)
        wait_for(lambda: feed_errors(r) > errors, 10, "the bad stream to be counted")
        seen = ready(r)["index"]["stream_entries"]
        for i in range(3):  # new prompts: new blocks, new events on the workers' streams
            prompt = f"a fresh prompt number {i} {uuid.uuid4().hex} " * 4
            assert complete(r, prompt=prompt).status_code == 200
        wait_for(lambda: ready(r)["index"]["stream_entries"] > seen, 10,
                 "the other streams' entries to be applied")
    finally:
        rds.delete(keys.events(shard))


def test_a_stranger_field_lives_one_heartbeat(cluster, rds):
    """Item 4c: one extra field in a live worker's hash broke its signature for good (the
    heartbeat never removed it): the worker stayed refused, 503 for everyone."""
    r, _, d = cluster
    key = RedisKeys(r.namespace).worker(d.worker_id)
    rds.hset(key, "x", "1")
    wait_for(lambda: not rds.hexists(key, "x"), 5, "the heartbeat to rewrite the hash")
    wait_for(lambda: d.worker_id in ready(r)["workers"], 10, "the worker to be accepted again")
    assert complete(r).status_code == 200


def test_forged_block_events_are_capped_and_applied_without_stalling(cluster, rds):
    """Item 4d: 15.7 MB of fake `stored` entries under a real worker's id, epoch and next
    sequence grew the router by 250 MB and stalled /health for 1.9 s."""
    r, _, d = cluster
    keys = RedisKeys(r.namespace)
    epoch, _, seq = rds.hget(keys.worker(d.worker_id), "events").decode().partition(":")
    seq = int(seq)
    stream = keys.events(keys.event_shard(d.worker_id))
    pipe = rds.pipeline(transaction=False)
    for _ in range(32):  # 2M hashes
        seq += 1
        packed = os.urandom(8 * MAX_HASHES_PER_ENTRY)
        pipe.xadd(stream, {"w": d.worker_id, "e": epoch, "s": str(seq), "k": "stored", "h": packed})
    errors = feed_errors(r)
    worst = 0.0
    pipe.execute()
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        assert r.client.get("/health").status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    assert feed_errors(r) > errors
    assert ready(r)["index"]["entries"] < 10 * 2048, ready(r)["index"]
    assert worst < 0.5, worst
    assert complete(r).status_code == 200


# ---- item 8: worker answers are bounded; item 10: less said to strangers ----------------------


class FakeDecode:
    """A decode worker that answers /ready like one (`info`: a real worker's, so the router takes
    it for the same model) and streams what `mode` says to /generate."""

    def __init__(self, info: dict | None = None) -> None:
        import http.server

        fake = self
        info = info or {"ready": True, "role": "decode"}
        self.mode = "ok"
        self.hits = 0
        self.vocab_size = 0  # mode "beyond_vocab" answers this id (the first one past the model's)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._send(200, json.dumps(info).encode())

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.hits += 1
                rid = body["request_id"]
                if fake.mode == "huge_ids":
                    events = [{"request_id": rid, "token_ids": [2**40, 5]}]
                elif fake.mode == "beyond_vocab":  # within int32, past the model's vocabulary
                    events = [{"request_id": rid, "token_ids": [5, fake.vocab_size]},
                              {"request_id": rid, "token_ids": [], "finish_reason": "length"}]
                elif fake.mode == "long_logprobs":
                    events = [{"request_id": rid, "token_ids": [5], "logprobs": [
                        {"token_id": 5, "logprob": -1.0, "top": [[5, -1.0]] * 60_000}]}]
                else:  # "endless": far past max_tokens
                    events = [{"request_id": rid, "token_ids": [5] * 1000} for _ in range(400)]
                    events.append({"request_id": rid, "token_ids": [], "finish_reason": "length"})
                self._send(200, b"".join(json.dumps(e).encode() + b"\n" for e in events))

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def with_fake(cluster, tiny_folder, tmp_path_factory):
    """A router (no Redis) over a lying decode worker and the real one, round robin."""
    _, _, d = cluster
    fake = FakeDecode(d.client.get("/ready").json())
    fake.vocab_size = d.client.get("/ready").json()["vocab_size"]
    r = Router(tiny_folder, None, cache_dir=tmp_path_factory.mktemp("fake"), redis_url=None,
               policy="round_robin", extra=["--worker", f"decode={fake.url}",
                                            "--worker", f"decode={d.url}",
                                            "--breaker-failures", "100"])
    try:
        r.wait_workers(2)
        yield r, fake
    finally:
        r.close()
        fake.close()


def test_a_lying_worker_is_cut_at_max_tokens_or_failed_over(with_fake):
    """Item 8: ids past uint32 gave a 500 (or a stream cut without an error frame), a worker that
    streamed 400,000 tokens for max_tokens 8 had them all relayed, and 60,000-entry logprob lists
    passed through. Now the router truncates at max_tokens itself, and an answer out of bounds
    is a failed worker: the request resumes on the other."""
    r, fake = with_fake
    for mode in ("endless", "huge_ids", "long_logprobs", "beyond_vocab"):
        fake.mode = mode
        hits = fake.hits
        for stream in (False, True):
            for _ in range(2):  # round robin: one of the two lands on the liar
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "logprobs": 1,
                        "stream": stream}
                resp = r.client.post("/v1/completions", json=body)
                assert resp.status_code == 200, (mode, resp.text[:300])
                if stream:
                    frames = [json.loads(line[6:]) for line in resp.text.splitlines()
                              if line.startswith("data: {")]
                    assert not any("error" in f for f in frames), (mode, frames[-1])
                    lps = [t for f in frames for c in f["choices"]
                           for t in (c.get("logprobs") or {}).get("tokens", [])]
                    assert len(lps) <= 8, mode
                else:
                    out = resp.json()
                    assert out["usage"]["completion_tokens"] <= 8, (mode, out["usage"])
                    assert len(out["choices"][0]["logprobs"]["tokens"]) <= 8
                    assert all(len(t) <= 2 for t in out["choices"][0]["logprobs"]["top_logprobs"])
        assert fake.hits > hits, mode
    log = Path(r.log.name).read_text()
    assert "token id 320 is outside the model's vocabulary [0, 320)" in log, log[-2000:]


def test_ids_beyond_the_models_vocabulary_fail_the_worker(tiny_folder, tmp_path):
    """Item 8: an id within int32 but past the model's vocabulary (config.json's 320 for
    tiny-random, not the tokenizer's 259: ids 259-319 are the model's to sample) was dropped
    from the text silently and answered 200. Now it fails the worker; with no other decode
    worker the request is a 503. The router learns the size from the workers' registrations,
    or (here: the fake reports none) from the model folder it was given."""
    vocab = json.loads((tiny_folder / "config.json").read_text())["vocab_size"]
    fake = FakeDecode()
    fake.mode, fake.vocab_size = "beyond_vocab", vocab
    r = Router(tiny_folder, None, cache_dir=tmp_path, redis_url=None,
               extra=["--worker", f"decode={fake.url}", "--breaker-failures", "100"])
    try:
        r.wait_workers(1)
        resp = r.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                     "max_tokens": 4})
        assert resp.status_code == 503, resp.text
        assert fake.hits == 1
        fake.vocab_size = vocab - 1  # the last id of the vocabulary is the model's to answer
        resp = r.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                     "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 2
    finally:
        r.close()
        fake.close()


def test_strangers_learn_no_addresses_and_no_internals(cluster):
    """Item 10: worker ids (host:port) in every response's `tandem` field, 503 messages with
    worker ids and exception reprs, pydantic's text with its URL, and the workers'
    unauthenticated /ready with tokenizer path, model digest and hash seed."""
    r, p, d = cluster
    out = complete(r).json()
    assert "decode_worker" not in out["tandem"] and "prefill_worker" not in out["tandem"]
    text = json.dumps(out)
    for w in (p, d):
        assert str(w.port) not in text
    bad = complete(r, n=2, seed=2**63 - 1)
    assert (bad.status_code == 400 and "pydantic" not in bad.text
            and "http" not in bad.text), bad.text
    for w in (p, d):
        stranger = httpx.get(f"{w.url}/ready", timeout=10)
        assert stranger.status_code == 200 and stranger.json() == {"ready": True}, stranger.text
        assert "model_digest" in w.client.get("/ready").json()  # the token holder's view


def test_a_failed_request_is_a_plain_503_and_one_log_line(tiny_folder, tmp_path):
    """Item 10 and the failure log: when the last decode worker fails mid-request the client got
    the worker's id and the exception's repr, and the router logged nothing about it."""
    fake = FakeDecode()
    fake.mode = "huge_ids"
    r = Router(tiny_folder, None, cache_dir=tmp_path, redis_url=None,
               extra=["--worker", f"decode={fake.url}", "--breaker-failures", "100"])
    try:
        r.wait_workers(1)
        resp = r.client.post("/v1/completions", headers={"X-Request-Id": "client-7"},
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "worker_failure"
        assert ("127.0.0.1" not in resp.text and "decode-" not in resp.text
                and "Error" not in resp.text)
        log = (tmp_path / f"router-{r.port}.log").read_text()
        failed = [line for line in log.splitlines() if " failed: plan " in line]
        assert len(failed) == 1, log[-2000:]
        assert "decode static-decode-0" in failed[0] and "malformed StreamEvent" in failed[0]
    finally:
        r.close()
        fake.close()


def test_echo_is_refused_until_implemented(cluster):
    """Item 6: `echo: true` was accepted and ignored (no prompt text, no prompt logprobs):
    likelihood-scoring harnesses got silently wrong numbers."""
    r, _, _ = cluster
    resp = complete(r, echo=True, logprobs=1, max_tokens=1)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "echo"
    assert complete(r, echo=False).status_code == 200
