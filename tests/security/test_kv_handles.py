"""KV handles and the peer plane, against real worker processes (real NIXL, real TCP transport):
a decode worker pulls only with a signed, unexpired handle issued for its own prompt, only from
the engine and address the handle names; anything else (forged, tampered, expired, mismatched,
unsigned, or a hostile peer) is refused with nothing written to the cache, and the request is
prefilled locally with the right tokens. Issue items 2-6, 10, 11 and 12."""

from __future__ import annotations

import json
import socket
import struct
import time
import uuid

import httpx
import pytest
import xxhash

from common.hashing import hash_tokens
from engine import SamplingParams
from kv_transfer import handle, tcp_wire
from testing.cluster import TOKEN, Worker
from testing.metrics import series_sum
from tests.security.fakes import FakePeer

pytestmark = pytest.mark.redis

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
X = [(11 * j + 5) % 256 for j in range(22)]
Y = [(17 * j + 3) % 256 for j in range(22)]  # same length as X: only the content differs


def expected(reference, prompt):
    return reference.generate(prompt, SamplingParams(**GREEDY))[0].token_ids


def counter(w: Worker, prefix: str) -> float:
    return sum(v for k, v in w.metrics().items() if k.startswith(prefix))


def fallbacks(w: Worker, reason: str) -> float:
    return series_sum(w.metrics(), "tandem_kv_pull_fallbacks_total", reason=reason)


def decode(d: Worker, rid: str, prompt: list[int], first: int,
           kvp: dict | None) -> tuple[list[int], dict]:
    events = d.generate(rid, prompt, GREEDY, [first], kvp)
    return [first] + [t for ev in events for t in ev["token_ids"]], events[-1]


def wait_leases_free(p: Worker, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while counter(p, "tandem_kv_leased_blocks") > 0:
        assert time.monotonic() < deadline, "leases were not released"
        time.sleep(0.1)


def forged(kvp: dict, **changes) -> dict:
    """`kvp` with `changes`, signed again with the right token (a token holder's handle)."""
    fields = {**kvp, **changes}
    fields.pop("signature", None)
    return handle.sign(fields, TOKEN)


def _pair(transport: str, tiny_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"handles-{transport}")
    ns = f"handles-{uuid.uuid4().hex[:6]}"
    extra = ["--transport", transport, "--lease-seconds", "5"]
    p = Worker("prefill", str(tiny_folder), cache_dir=work, namespace=ns, extra=extra)
    d = Worker("decode", str(tiny_folder), cache_dir=work, namespace=ns,
               extra=[*extra, "--max-num-seqs", "8"])
    return p, d


def _pair_fixture(transport: str):
    @pytest.fixture(scope="module")
    def pair(tiny_folder, tmp_path_factory):
        p, d = _pair(transport, tiny_folder, tmp_path_factory)
        yield p, d
        p.close()
        d.close()

    return pair


nixl_pd = _pair_fixture("nixl")
tcp_pd = _pair_fixture("tcp")


@pytest.fixture(params=["nixl", "tcp"])
def pd(request):
    """Both transports: the handle rules hold whatever carries the bytes."""
    return request.getfixturevalue(f"{request.param}_pd")


@pytest.fixture
def fake():
    peer = FakePeer()
    yield peer
    peer.close()


def test_a_handle_for_another_prompt_is_refused_and_nothing_is_poisoned(pd, reference):
    """Item 3: decoding prompt Y with prompt X's handle once copied X's KV into Y's blocks and
    published them under Y's hashes."""
    p, d = pd
    pre_x = p.prefill(f"x-{uuid.uuid4().hex[:6]}", X, GREEDY)
    pre_y = p.prefill(f"y-{uuid.uuid4().hex[:6]}", Y, GREEDY)
    before = fallbacks(d, "invalid_handle")
    tokens, _ = decode(d, f"poison-{uuid.uuid4().hex[:6]}", Y, pre_y["first_token_id"],
                       pre_x["kv_transfer_params"])
    assert tokens == expected(reference, Y)
    assert fallbacks(d, "invalid_handle") == before + 1
    # Y's blocks as now cached on D serve a later request for Y correctly (a local prefill that
    # reuses them), and the real handle for X still works.
    again = d.generate(f"again-{uuid.uuid4().hex[:6]}", Y, GREEDY)
    assert [t for ev in again for t in ev["token_ids"]] == expected(reference, Y)
    tokens, last = decode(d, f"x-ok-{uuid.uuid4().hex[:6]}", X, pre_x["first_token_id"],
                          pre_x["kv_transfer_params"])
    assert tokens == expected(reference, X) and last["timing"]["transfer_bytes"] > 0
    # Y's export was never pulled: its lease runs out on its own.
    wait_leases_free(p)


@pytest.mark.parametrize("how", ["unsigned", "wrong_key", "tampered_blocks", "tampered_host",
                                 "no_engine_id", "expired"])
def test_bad_handles_fall_back_to_a_correct_local_prefill(pd, reference, fake, how):
    """Items 2 and 4: nothing without the token's signature makes a decode worker contact a host
    or fill blocks; a handle whose engine id is missing is refused (it once cached whatever
    engine the peer claimed to be)."""
    p, d = pd
    prompt = [(29 * j + 7 + len(how)) % 256 for j in range(18)]
    pre = p.prefill(f"bad-{how}-{uuid.uuid4().hex[:6]}", prompt, GREEDY,
                    **({"lease_seconds": 1.0} if how == "expired" else {}))
    kvp = dict(pre["kv_transfer_params"])
    if how == "unsigned":
        kvp.pop("signature")
    elif how == "wrong_key":
        kvp = handle.sign({k: v for k, v in kvp.items() if k != "signature"}, "not-the-token")
    elif how == "tampered_blocks":
        kvp["remote_block_ids"] = list(reversed(kvp["remote_block_ids"]))
    elif how == "tampered_host":
        kvp.update(remote_host="127.0.0.1", remote_port=fake.http_port)
    elif how == "no_engine_id":
        kvp = forged(kvp, remote_engine_id=None)
    elif how == "expired":
        time.sleep(1.2)
    before = fallbacks(d, "invalid_handle")
    tokens, last = decode(d, f"bad-d-{how}-{uuid.uuid4().hex[:6]}", prompt,
                          pre["first_token_id"], kvp)
    assert tokens == expected(reference, prompt)
    assert last["timing"]["transfer_bytes"] == 0
    assert fallbacks(d, "invalid_handle") == before + 1
    assert fake.hits == []  # never contacted
    if how != "expired":  # P's export was never pulled: released now, not at its lease's end
        assert p.client.post(f"/abort/{pre['request_id']}").json()["aborted"]
    wait_leases_free(p)


def test_handles_from_outside_the_cluster_reach_no_host(pd, reference, fake):
    """Item 2 (SSRF): the vLLM-compatible endpoint took any remote_host, even one carrying a path.
    """
    _, d = pd
    base = {"do_remote_prefill": True, "remote_engine_id": "prefill-x", "remote_block_ids": [0, 1],
            "remote_request_id": "r1"}
    evil = d.client.post("/v1/completions", json={
        "prompt": X, "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": {**base, "remote_host": "127.0.0.1/steal?x=",
                               "remote_port": fake.http_port}})
    assert evil.status_code == 400, evil.text
    plain = d.client.post("/v1/completions", json={
        "prompt": X, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {**base, "remote_host": "127.0.0.1", "remote_port": fake.http_port}})
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["token_ids"] == expected(reference, X)
    assert fake.hits == []


def test_a_peer_cannot_take_over_an_engine_id(tcp_pd, reference, fake):
    """Item 4: a handle without remote_engine_id made the decode worker cache whatever engine the
    peer's metadata claimed; a peer claiming to be prefill engine E (and serving well-formed
    bytes of its own) then answered every later pull "from E". Now such a handle is refused
    before any contact, and the next real handle from E pulls E's own KV."""
    p, d = tcp_pd  # the fake peer serves its bytes over the tcp transport's wire
    md = p.client.get("/kv/metadata").json()
    prompt = [(31 * j + 1) % 256 for j in range(14)]
    pre = p.prefill(f"hijack-{uuid.uuid4().hex[:6]}", prompt, GREEDY)
    kvp = dict(pre["kv_transfer_params"])
    num_bytes = len(kvp["remote_block_ids"]) * _block_bytes(md["layout"])
    fake.metadata = {**md, "params": {"host": "127.0.0.1", "port": fake.tcp_port}}  # claims E
    fake.tcp_answer = {"ok": True, "num_bytes": num_bytes, "chunk_bytes": num_bytes}
    junk = bytes(range(256)) * (num_bytes // 256 + 1)
    fake.tcp_payload = (struct.pack("<Q", xxhash.xxh3_64_intdigest(junk[:num_bytes]))
                        + junk[:num_bytes])
    hostile = {k: v for k, v in kvp.items() if k not in ("remote_engine_id", "signature")}
    hostile.update(remote_port=fake.http_port)
    tokens, _ = decode(d, f"hijack-d-{uuid.uuid4().hex[:6]}", prompt,
                       pre["first_token_id"], hostile)
    assert tokens == expected(reference, prompt)
    assert fake.hits == [] and fake.tcp_requests == []
    prompt2 = [(37 * j + 2) % 256 for j in range(14)]
    pre2 = p.prefill(f"hijack2-{uuid.uuid4().hex[:6]}", prompt2, GREEDY)
    tokens, last = decode(d, f"hijack2-d-{uuid.uuid4().hex[:6]}", prompt2, pre2["first_token_id"],
                          pre2["kv_transfer_params"])
    assert tokens == expected(reference, prompt2)
    assert last["timing"]["transfer_bytes"] > 0  # pulled, from the real engine
    # The hijack's export was never pulled: released now, not at its lease's end.
    assert p.client.post(f"/abort/{pre['request_id']}").json()["aborted"]
    wait_leases_free(p)


def test_a_trickling_peer_cannot_hold_a_request(pd, reference, fake):
    """Item 10: the metadata handshake has one deadline; a peer that sends a byte a second
    gets a fallback, not a request (and its blocks) held for good."""
    p, d = pd
    fake.metadata = p.client.get("/kv/metadata").json()
    fake.trickle = True
    prompt = [(41 * j + 9) % 256 for j in range(10)]
    pre = p.prefill(f"trickle-{uuid.uuid4().hex[:6]}", prompt, GREEDY)
    hostile = forged(pre["kv_transfer_params"], remote_port=fake.http_port)
    before = fallbacks(d, "timeout")
    tokens, last = decode(d, f"trickle-d-{uuid.uuid4().hex[:6]}", prompt,
                          pre["first_token_id"], hostile)
    assert tokens == expected(reference, prompt)
    assert fallbacks(d, "timeout") == before + 1
    assert counter(d, "tandem_worker_running_requests") == 0
    assert counter(d, "tandem_worker_kv_usage") == 0


def test_lease_seconds_are_capped(pd):
    """Item 10: /prefill once pinned blocks for any lease_seconds (1e9: for good)."""
    p, _ = pd
    for value in (1e9, 121.0, float("inf")):
        r = p.client.post("/prefill", content=json.dumps({
            "request_id": f"lease-{uuid.uuid4().hex[:6]}", "prompt_token_ids": X,
            "sampling": GREEDY, "lease_seconds": value}),
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (value, r.text)
    assert counter(p, "tandem_kv_leased_blocks") == 0


@pytest.mark.parametrize("answer", [
    {"ok": True, "chunk_bytes": 4096},                        # no num_bytes
    [1, 2, 3],                                                # not an object
    {"ok": True, "num_bytes": None, "chunk_bytes": -1},       # the bytes it needs, no chunks
    "expected"], ids=["no_num_bytes", "list", "negative_chunk", "short_stream"])
def test_tcp_transport_does_not_trust_the_peer_header(tcp_pd, reference, fake, answer):
    """Item 11: a missing num_bytes or a list header gave a 500; chunk_bytes=-1 skipped the read
    loop and scattered uninitialised memory into the cache as a success."""
    p, d = tcp_pd
    md = p.client.get("/kv/metadata").json()
    salt = len(json.dumps(answer))  # a prompt of its own: D must not hold it from another case
    prompt = [(43 * j + 4 + salt) % 256 for j in range(20)]
    pre = p.prefill(f"tcp-{uuid.uuid4().hex[:6]}", prompt, GREEDY)
    kvp = pre["kv_transfer_params"]
    num_bytes = len(kvp["remote_block_ids"]) * _block_bytes(md["layout"])
    if answer == "expected":  # the right header, then a stream cut short
        fake.tcp_answer = {"ok": True, "num_bytes": num_bytes, "chunk_bytes": 4096}
        fake.tcp_payload = b"\0" * 100
    elif isinstance(answer, dict) and "num_bytes" in answer:
        fake.tcp_answer = {**answer, "num_bytes": num_bytes}
    else:
        fake.tcp_answer = answer
    fake.metadata = {**md, "engine_id": "prefill-fake",
                     "params": {"host": "127.0.0.1", "port": fake.tcp_port}}
    hostile = forged(kvp, remote_engine_id="prefill-fake", remote_port=fake.http_port)
    before = counter(d, "tandem_kv_pull_fallbacks_total")
    tokens, last = decode(d, f"tcp-d-{uuid.uuid4().hex[:6]}", prompt,
                          pre["first_token_id"], hostile)
    assert tokens == expected(reference, prompt)  # garbage never reached the cache
    assert last["timing"]["transfer_bytes"] == 0
    assert counter(d, "tandem_kv_pull_fallbacks_total") == before + 1
    assert len(fake.tcp_requests) == 1


def _block_bytes(layout: dict) -> int:
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[layout["dtype"]]
    return (2 * layout["num_layers"] * layout["block_size"] * layout["num_kv_heads"]
            * layout["head_dim"] * size)


def test_tcp_transport_refuses_a_non_ascii_token_and_keeps_serving(tcp_pd, reference):
    """Item 12 on the data port: a token of non-ASCII characters is a refusal, not a crash. The
    token is proven by the preamble now (tcp_wire.py): a preamble keyed by such a token, or a
    header sent without one (the old wire), gets the connection closed with no answer."""
    p, d = tcp_pd
    md = p.client.get("/kv/metadata").json()
    host, port = md["params"]["host"], md["params"]["port"]
    header = json.dumps({"op": "pull", "request_id": "x", "block_ids": [0]}).encode()
    for token in ("\u00ff\u4e2d", None):
        with socket.create_connection((host, port), timeout=10) as s:
            challenge = _recv(s, tcp_wire.CHALLENGE_BYTES)
            first = tcp_wire.preamble(token, challenge) if token else b""
            s.sendall(first + struct.pack(">I", len(header)) + header)
            assert _closed(s), token
    prompt = [(47 * j + 6) % 256 for j in range(12)]
    pre = p.prefill(f"tcp-ok-{uuid.uuid4().hex[:6]}", prompt, GREEDY)
    tokens, last = decode(d, f"tcp-ok-d-{uuid.uuid4().hex[:6]}", prompt, pre["first_token_id"],
                          pre["kv_transfer_params"])
    assert tokens == expected(reference, prompt) and last["timing"]["transfer_bytes"] > 0


def _closed(s: socket.socket) -> bool:
    """Whether the peer closed `s` without sending anything more."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:  # closed with our bytes unread: a reset
        return True


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "connection closed"
        out += chunk
    return out


@pytest.mark.nixl
def test_a_bad_notification_does_not_stop_the_lease_watcher(nixl_pd, reference):
    """Item 6: one NIXL notification of invalid UTF-8 killed the lease watcher; leases never
    expired and, since the watcher drives NIXL progress, every later pull timed out."""
    p, d = nixl_pd
    md = p.client.get("/kv/metadata").json()
    import base64

    import torch

    from kv_transfer.nixl_agent import import_nixl as _import_nixl

    nixl = _import_nixl()
    agent = nixl.nixl_agent(f"attacker-{uuid.uuid4().hex[:6]}",
                            nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    mem = torch.zeros(16)
    agent.register_memory(mem)
    name = agent.add_remote_agent(base64.b64decode(md["params"]["agent_metadata"]))
    before = counter(p, 'tandem_background_errors_total{task="kv_notifications"}')
    for msg in (b"tandem:done:\xff\xfe", b"garbage"):
        agent.send_notif(name, msg)
    deadline = time.monotonic() + 10
    while counter(p, 'tandem_background_errors_total{task="kv_notifications"}') < before + 2:
        assert time.monotonic() < deadline, "the bad notifications were not seen"
        agent.get_new_notifs()  # drives this agent's progress (no progress thread): sends go out
        time.sleep(0.05)
    # The watcher lives: a pull goes through (a dead watcher made it time out and fall back),
    # and its lease is released.
    prompt = [(53 * j + 8) % 256 for j in range(16)]
    pre = p.prefill(f"notif-{uuid.uuid4().hex[:6]}", prompt, GREEDY)
    tokens, last = decode(d, f"notif-d-{uuid.uuid4().hex[:6]}", prompt, pre["first_token_id"],
                          pre["kv_transfer_params"])
    assert tokens == expected(reference, prompt)
    assert last["timing"]["transfer_bytes"] > 0
    wait_leases_free(p)
    agent.remove_remote_agent(name)


def test_metadata_needs_the_token_and_nixl_listens_on_loopback_only(pd):
    """Item 5: /kv/metadata without the token, and UCX listening on the external interface of
    a worker started with --host 127.0.0.1."""
    p, _ = pd
    assert httpx.get(f"{p.url}/kv/metadata", timeout=10).status_code == 401
    assert httpx.get(f"{p.url}/kv/metadata", headers={"Authorization": b"Bearer \xff\xfe"},
                     timeout=10).status_code == 401
    addresses = listening_addresses(p.proc.pid)
    assert addresses, "the worker listens somewhere"
    assert all(a in ("127.0.0.1", "::1") for a in addresses), addresses


def listening_addresses(pid: int) -> set[str]:
    """Local addresses of the TCP sockets process `pid` listens on (from /proc)."""
    import ipaddress
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(path) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr = cols[1].split(":")[0]
                raw = bytes.fromhex(hexaddr)
                if v6:
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    out.add(str(ipaddress.IPv6Address(raw)))
                else:
                    out.add(str(ipaddress.IPv4Address(raw[::-1])))
    return out


def test_handles_carry_the_signed_fields(pd):
    """The contract of docs/contract.md: a prefill worker's handle is signed over the fields that
    say what to pull, from where, into which prompt."""
    p, _ = pd
    pre = p.prefill(f"fields-{uuid.uuid4().hex[:6]}", X, GREEDY)
    kvp = pre["kv_transfer_params"]
    assert kvp["num_tokens"] == len(X) and kvp["prompt_hash"] == hash_tokens(X)
    assert kvp["signature"] == handle.signature(kvp, TOKEN)
    assert kvp["expires_at"] > time.time()
    p.client.post(f"/abort/{pre['request_id']}")

