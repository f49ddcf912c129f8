"""vLLM servers, each with its `tandem vllm-bridge`, registered in one Redis namespace: the fleet
that the end-to-end tests (tests/vllm_bridge/test_vllm_routing.py) and bench/vllm_routing.py put
behind Tandem's router. It also reads back what the bridges published: a worker's registration
and its block set."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import redis
import zmq

from common.hashing import member_hash
from common.registry import RedisKeys
from testing.processes import ROOT, stop_process
from testing.redis_server import REDIS_URL
from testing.vllm_server import VLLMServer


class VLLMBridge:
    """A real `tandem vllm-bridge` process for one server (endpoints given, block size read from
    the server's /metrics unless the server was started with one)."""

    def __init__(self, server: VLLMServer, role: str, namespace: str, log_dir: Path, *,
                 token: str | None = None, redis_url: str = REDIS_URL,
                 extra: list[str] | None = None) -> None:
        self.server = server
        self.worker_id = f"vllm-127.0.0.1-{server.port}"
        cmd = [sys.executable, "-m", "tandem.cli", "vllm-bridge", "--vllm-url", server.url,
               "--role", role, "--redis-url", redis_url, "--namespace", namespace,
               "--worker-id", self.worker_id, "--model-folder", str(server.folder)]
        if server.events_endpoint:
            cmd += ["--events-endpoint", server.events_endpoint,
                    "--replay-endpoint", server.replay_endpoint]
        if server.options.block_size:
            cmd += ["--block-size", str(server.options.block_size)]
        if token:
            cmd += [f"--internal-token={token}"]
        self.log_path = log_dir / f"bridge-{server.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*cmd, *(extra or [])], cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def close(self) -> None:
        stop_process(self.proc, 15)
        self._log.close()


class FleetIndex:
    """What the bridges of one namespace published, read straight from Redis."""

    def __init__(self, namespace: str, redis_url: str = REDIS_URL) -> None:
        self.keys = RedisKeys(namespace)
        self.redis = redis.Redis.from_url(redis_url)

    def registration(self, worker_id: str) -> dict[str, str]:
        raw = self.redis.hgetall(self.keys.worker(worker_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def blocks(self, worker_id: str) -> set[int]:
        """The worker's published block set as hashes."""
        members = self.redis.smembers(self.keys.blocks(worker_id))
        return {h for h in map(member_hash, members) if h is not None}

    def leading_match(self, worker_id: str, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, the worker's set holds (what the router counts)."""
        held = self.blocks(worker_id)
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def epoch(self, worker_id: str) -> str | None:
        """The epoch of the worker's block events ("epoch:seq" in its registration)."""
        events = self.registration(worker_id).get("events", "")
        return events.partition(":")[0] or None

    def wait_registered(self, worker_ids: list[str], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.registration(w) for w in worker_ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"bridges did not register {worker_ids}")
            time.sleep(0.2)

    def delete(self) -> None:
        """Every key of the namespace (a test's or a run's own)."""
        for key in self.redis.scan_iter(match=f"{self.keys.prefix}*"):
            self.redis.delete(key)
        self.redis.close()


class EventTap:
    """A second subscriber to one vLLM server's KV events, on a thread, decoded raw (msgpack, no
    vllm_bridge code), so tests and benchmarks see what the server itself reports. A subclass
    sets its own state, then calls `__init__`, and implements `on_batch`."""

    def __init__(self, endpoint: str) -> None:
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def on_batch(self, seq: int, payload: bytes, events: list) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()  # topic, seq (8 bytes big-endian), payload
            _ts, events, *_ = msgspec.msgpack.decode(frames[2])
            self.on_batch(int.from_bytes(frames[1], "big"), frames[2], events)
