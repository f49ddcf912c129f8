"""A victim's latency while hostile clients attack the cluster (issue 28).

    .venv/bin/python bench/attack.py [--requests 40] [--min-phase-s 10] [--attacks a,b]
                                     [--out bench/results/attack.json]

One real cluster (tiny-random: a prefill worker, a decode worker, a router, Redis) serves a
victim that sends completions back to back (8 tokens each; at least `--requests`, for at least
`--min-phase-s`, so a phase spans an attack's cycle of connect, stall and cut), first idle, then
while each attack runs (at most 50 connections; each attack alone):
  grammar_bombs  8 clients loop `((a{1000}){1000})`-style constraints with n=8 (refused: 400)
  n_orphans      8 clients loop n=8 requests whose last choice is invalid (seed overflow) and
                 1,500 tokens each (refused before any choice starts)
  slow_readers   8 clients open n=8 streams with top_logprobs 20 and never read (cut after the
                 stream write deadline; each reconnects once it sees the cut, or once the
                 deadline has passed: a FIN queued behind the unread stream never arrives)
  slowloris      40 connections send headers a byte a second (closed at the header deadline,
                 reconnecting)
  heavy_streams  not an attack, not run unless named: 8 clients loop n=8 streams of 1,500
                 tokens and read them (64 sequences: every slot of the decode worker's batch);
                 `--worker-arg=--scheduling-policy=fcfs` for the batch without sharing
The victim and the attackers are told apart as a gateway tells clients apart: by API key
(`victim-key`, `attacker-key`), and the router runs with per-client limits
(`--client-max-requests`, `--client-max-running`, `--client-requests-per-s`; 0 turns one off
to compare). Each attack runs
in a process of its own, so the attackers' threads never share the victim's interpreter (and
GIL) and the figures are the router's.

JSON: victim p50/p99 (ms) and statuses per phase, the ratio against idle, what the attackers
got back, the router's per-client settings and the load average. Not a test: figures depend on
the machine (on a shared one, compare the ratios of one run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.cluster import Router, Worker  # noqa: E402 - the same process helpers as the tests

MODEL = "tiny-random"
VICTIM = {"Authorization": "Bearer victim-key"}
ATTACKER = {"Authorization": "Bearer attacker-key"}
BOMBS = [{"guided_regex": "((a{1000}){1000})"}, {"guided_regex": "(a{10000}){10000}"},
         {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {
             "type": "string", "pattern": "^((a{100}){100}){100}$"}}}},
         {"guided_grammar": "start: /((ab){1000}){1000}/"}]


WRITE_TIMEOUT_S = 5.0  # the router's --stream-write-timeout-s


def victim(url: str, n: int, min_s: float = 0.0) -> tuple[list[float], dict[int, int]]:
    ms, statuses = [], {}
    end = time.monotonic() + min_s
    with httpx.Client(timeout=120, headers=VICTIM) as c:
        i = 0
        while i < n or time.monotonic() < end:
            i += 1
            t0 = time.perf_counter()
            r = c.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": f"victim {i}",
                                                     "max_tokens": 8, "temperature": 0})
            ms.append((time.perf_counter() - t0) * 1000)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    return ms, statuses


def summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50_ms": round(q[49], 1), "p99_ms": round(q[98], 1), "max_ms": round(max(ms), 1)}


def grammar_bombs(url: str, stop: threading.Event, got: list, i: int) -> None:
    with httpx.Client(timeout=120, headers=ATTACKER) as c:
        while not stop.is_set():
            got.append(c.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 16, "n": 8,
                **BOMBS[(i + len(got)) % len(BOMBS)]}).status_code)


def n_orphans(url: str, stop: threading.Event, got: list, i: int) -> None:
    with httpx.Client(timeout=120, headers=ATTACKER) as c:
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
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Authorization: Bearer attacker-key\r\nContent-Type: "
                      b"application/json\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)
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
    with httpx.Client(timeout=120, headers=ATTACKER) as c:
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


def attacker_process(name: str, url: str, stop, out) -> None:
    """One attack's clients, as threads of a process of their own; what they got goes to `out`."""
    attack, clients = ATTACKS[name]
    got: list = []
    threads = [threading.Thread(target=attack, args=(url, stop, got, i)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(got)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40, help="victim requests per phase (at least)")
    ap.add_argument("--min-phase-s", type=float, default=10.0, help="victim seconds per phase (at least)")
    ap.add_argument("--attacks", default=DEFAULT_ATTACKS, help="which, comma-separated")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attack.json"))
    ap.add_argument("--client-max-requests", type=int, default=2, help="0: no limit")
    ap.add_argument("--client-max-running", type=int, default=8, help="0: no limit")
    ap.add_argument("--client-requests-per-s", type=float, default=20.0, help="0: no limit")
    ap.add_argument("--router-arg", action="append", default=[], help="more router flags "
                    "(repeat; e.g. --router-arg=--send-buffer-bytes=65536)")
    ap.add_argument("--worker-arg", action="append", default=[], help="more flags of both workers")
    args = ap.parse_args()
    limits = []
    if args.client_max_requests:
        limits += ["--client-max-requests", str(args.client_max_requests)]
    if args.client_max_running:
        limits += ["--client-max-running", str(args.client_max_running)]
    if args.client_requests_per_s:
        limits += ["--client-requests-per-s", str(args.client_requests_per_s)]
    from engine.tiny import build_tiny_random  # torch: not for the attackers' processes

    work = Path(args.out).parent
    work.mkdir(parents=True, exist_ok=True)
    folder = build_tiny_random(work / "models" / MODEL)
    ns = f"attack-{uuid.uuid4().hex[:6]}"
    procs: list = []
    try:
        procs.append(Worker("prefill", str(folder), cache_dir=work, namespace=ns, num_blocks=2048,
                            extra=args.worker_arg))
        procs.append(Worker("decode", str(folder), cache_dir=work, namespace=ns, num_blocks=2048,
                            extra=args.worker_arg))
        router = Router(folder, ns, cache_dir=work, extra=[
            "--stream-write-timeout-s", str(WRITE_TIMEOUT_S), "--header-timeout-s", "5",
            "--api-key", "victim-key", "--api-key", "attacker-key", *limits, *args.router_arg])
        procs.append(router)
        router.wait_workers(2)
        victim(router.url, 5)  # warm up
        ms, statuses = victim(router.url, args.requests, args.min_phase_s)
        result = {"victim_requests": args.requests, "min_phase_s": args.min_phase_s,
                  "router_limits": limits, "router_args": args.router_arg,
                  "worker_args": args.worker_arg,
                  "load_average_start": os.getloadavg(),
                  "idle": {**summary(ms), "requests": len(ms), "statuses": statuses}}
        print("idle", result["idle"], flush=True)
        mp = multiprocessing.get_context("spawn")
        for name in args.attacks.split(","):
            clients = ATTACKS[name][1]
            stop, out = mp.Event(), mp.Queue()
            proc = mp.Process(target=attacker_process, args=(name, router.url, stop, out))
            proc.start()
            time.sleep(4.0)  # the attack is under way (the process imports, then connects)
            ms, statuses = victim(router.url, args.requests, args.min_phase_s)
            stop.set()
            got = out.get(timeout=60)
            proc.join(30)
            row = {**summary(ms), "requests": len(ms), "statuses": statuses,
                   "attack_connections": clients,
                   "p50_vs_idle": round(summary(ms)["p50_ms"] / result["idle"]["p50_ms"], 2),
                   "p99_vs_idle": round(summary(ms)["p99_ms"] / result["idle"]["p99_ms"], 2)}
            if name in ("grammar_bombs", "n_orphans", "heavy_streams"):
                row["attacker_statuses"] = {str(s): got.count(s) for s in sorted(set(got))}
            else:
                seen = [x for x in got if x is not None]
                row["attacker_streams_ended"] = len(got)  # cut seen, or past the deadline
                row["attacker_cut_after_s"] = summary([x * 1000 for x in seen]) if len(seen) > 1 else seen
            result[name] = row
            print(name, row, flush=True)
            time.sleep(3.0)  # what the attack left running drains before the next phase
        result["load_average_end"] = os.getloadavg()
    finally:
        for p in reversed(procs):
            p.close()
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
