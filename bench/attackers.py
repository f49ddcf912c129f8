"""The hostile clients of bench/attack.py, one function per attack: each loops until `stop`
and appends what it got back to `got`. They run as threads of a process of their own
(`attacker_process`), so they never share the victim's interpreter."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx

MODEL = "tiny-random"
ATTACKER = {"Authorization": "Bearer attacker-key"}


def attacker_headers() -> dict[str, str]:
    """An attacker's credentials: its key, or (no key) a new X-Forwarded-For each time."""
    if ATTACKER:
        return dict(ATTACKER)
    return {"X-Forwarded-For": ".".join(str(b) for b in os.urandom(4))}


def attacker_client() -> httpx.Client:
    return httpx.Client(timeout=120, event_hooks={"request": [_rotate]})


def _rotate(request: httpx.Request) -> None:
    request.headers.update(attacker_headers())


BOMBS = [{"guided_regex": "((a{1000}){1000})"}, {"guided_regex": "(a{10000}){10000}"},
         {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {
             "type": "string", "pattern": "^((a{100}){100}){100}$"}}}},
         {"guided_grammar": "start: /((ab){1000}){1000}/"}]


WRITE_TIMEOUT_S = 5.0  # the router's --stream-write-timeout-s


def grammar_bombs(url: str, stop: threading.Event, got: list, i: int) -> None:
    with attacker_client() as c:
        while not stop.is_set():
            got.append(c.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 16, "n": 8,
                **BOMBS[(i + len(got)) % len(BOMBS)]}).status_code)


def n_orphans(url: str, stop: threading.Event, got: list, i: int) -> None:
    with attacker_client() as c:
        while not stop.is_set():
            got.append(c.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 1500, "n": 8, "ignore_eos": True,
                "seed": 2**63 - 7}).status_code)


CLOSE, CLOSE_WAIT = 7, 8  # linux/tcp_states.h


def slow_reader(url: str, stop: threading.Event, got: list, i: int) -> None:
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "n": 8, "max_tokens": 1500, "ignore_eos": True,
                       "stream": True, "logprobs": True, "top_logprobs": 20,
                       "messages": [{"role": "user", "content": f"hi {i}"}]}).encode()
    while not stop.is_set():
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(0.5)
        try:
            s.connect(("127.0.0.1", port))
            head = "".join(f"{k}: {v}\r\n" for k, v in attacker_headers().items()).encode()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + head
                      + b"Content-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            while not stop.is_set():  # queued behind its own client's limit: it waits
                try:
                    s.recv(256)
                    break
                except TimeoutError:
                    continue
            t0 = time.monotonic()
            while not stop.is_set():  # read nothing more; see when the router cuts us
                time.sleep(0.5)
                if _closed(s):
                    got.append(round(time.monotonic() - t0, 1))
                    break
                if time.monotonic() - t0 > WRITE_TIMEOUT_S + 2:
                    got.append(None)  # cut by now, unseen: a new stream
                    break
        except OSError:
            pass
        finally:
            s.close()


def slowloris(url: str, stop: threading.Event, got: list, i: int) -> None:
    port = int(url.rsplit(":", 1)[1])
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                t0 = time.monotonic()
                while not stop.is_set():
                    s.sendall(b"X")  # a byte a second, never a complete head
                    time.sleep(1.0)
                    if _closed(s):
                        got.append(round(time.monotonic() - t0, 1))
                        break
        except OSError:
            pass


def heavy_streams(url: str, stop: threading.Event, got: list, i: int) -> None:
    body = {"model": MODEL, "n": 8, "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"heavy {i}"}]}
    with attacker_client() as c:
        while not stop.is_set():
            with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        break
            got.append(r.status_code)


def _closed(s: socket.socket) -> bool:
    """Whether the router closed the connection, without reading it (a peek sees the unread
    stream, not the FIN behind it): the TCP state, CLOSE_WAIT once the peer has closed."""
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in (CLOSE_WAIT, CLOSE)
    except OSError:
        return True


ATTACKS = {"grammar_bombs": (grammar_bombs, 8), "n_orphans": (n_orphans, 8),
           "slow_readers": (slow_reader, 8), "slowloris": (slowloris, 40),
           "heavy_streams": (heavy_streams, 8)}
DEFAULT_ATTACKS = "grammar_bombs,n_orphans,slow_readers,slowloris"


def attacker_process(name: str, url: str, stop, out, by_address: bool) -> None:
    """One attack's clients, as threads of a process of their own; what they got goes to `out`."""
    if by_address:
        ATTACKER.clear()
    attack, clients = ATTACKS[name]
    got: list = []
    threads = [threading.Thread(target=attack, args=(url, stop, got, i)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(got)
