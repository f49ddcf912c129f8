"""Local clusters for the integration tests and the benchmarks: real `tandem prefill|decode|
colocated|router` processes on loopback, a real Redis, real NIXL (or TCP) between them."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from testing.metrics import scrape
from testing.processes import ROOT, start_on_free_port, stop_process, wait_http_ok
from testing.redis_server import REDIS_URL

# The internal token of the clusters this process starts: a new one per process, so no
# credential is written in code and no worker of one run takes another run's calls.
TOKEN = secrets.token_hex(24)  # hex: a urlsafe token may start with "-", read as a flag


class Worker:
    """A real `tandem prefill|decode|colocated` process, ready (its /ready answers 200) once
    built; started on another port if its first one was taken before it could bind it."""

    def __init__(self, role: str, model: str, *, cache_dir: Path, namespace: str | None = None,
                 extra: list[str] | None = None, num_blocks: int = 256, block_size: int = 4,
                 token: str | None = TOKEN, ttl: float = 3.0, host: str = "127.0.0.1",
                 netns: str | None = None, env: dict[str, str] | None = None) -> None:
        self.role, self.host, self.token, self.cache_dir = role, host, token, cache_dir
        # In a network namespace (another "host"): `ip netns exec`, bound to that host's address.
        prefix = ["ip", "netns", "exec", netns] if netns else []
        cmd = [*prefix, sys.executable, "-m", "tandem.cli", role, "--model", model, "--cache-dir",
               str(cache_dir), "--port", "0", "--num-blocks", str(num_blocks),
               "--block-size", str(block_size), "--heartbeat-ttl", str(ttl), "--host", host]
        if namespace:
            cmd += ["--redis-url", REDIS_URL, "--namespace", namespace]
        if token:
            cmd += [f"--internal-token={token}"]
        cmd += extra or []
        self.cmd, self.env = cmd, {**os.environ, **(env or {})}
        self.client = httpx.Client(timeout=60,
                                   headers={"Authorization": f"Bearer {token}"} if token else {})
        self.log = None
        self.proc = start_on_free_port(self._use_port, self._launch, self._wait_ready,
                                       lambda: Path(self.log.name))

    def _use_port(self, port: int) -> None:
        """Point the command, the URL, the id and the client at `port`."""
        self.port = port
        self.cmd[self.cmd.index("--port") + 1] = str(port)
        self.url = f"http://{self.host}:{port}"
        self.worker_id = f"{self.role}-{self.host}-{port}"
        self.client.base_url = self.url
        if self.log is None:  # one log for every start, named after the first port
            self.log = open(self.cache_dir / f"{self.role}-{port}.log", "w")

    def _launch(self) -> subprocess.Popen:
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=self.env)
        return self.proc

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the worker and wait for it to exit; its exit status."""
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def restart(self, new_port: bool = False) -> None:
        """Start the same command again and wait until it is ready: on the same port (same id),
        or on a new one (a new id, as a rescheduled pod gets)."""
        assert self.proc.poll() is not None, "stop the worker first"
        if new_port:
            self.proc = start_on_free_port(self._use_port, self._launch, self._wait_ready,
                                           lambda: Path(self.log.name))
        else:
            self._launch()
            self._wait_ready()

    def _wait_ready(self, timeout: float = 120) -> None:
        wait_http_ok(self.proc, Path(self.log.name), lambda: self.client.get("/ready", timeout=5),
                     f"{self.role} worker", timeout, interval=0.2)

    def metrics(self) -> dict[str, float]:
        return scrape(self.client)

    def prefill(self, request_id: str, prompt: list[int], sampling: dict, **kw) -> dict:
        r = self.client.post("/prefill", json={"request_id": request_id, "prompt_token_ids": prompt,
                                               "sampling": sampling, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    def generate(self, request_id: str, prompt: list[int], sampling: dict, output_token_ids=(),
                 kv_transfer_params: dict | None = None) -> list[dict]:
        body = {"request_id": request_id, "prompt_token_ids": prompt,
                "output_token_ids": list(output_token_ids), "sampling": sampling}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        with self.client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            return [json.loads(line) for line in r.iter_lines() if line]

    def kill(self, sig=signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(15)

    def close(self) -> None:
        stop_process(self.proc, 20)
        self.client.close()
        self.log.close()


@contextmanager
def pd_pair(model: str, workdir: Path, namespace: str,
            extra: list[str] = ()) -> Iterator[tuple[Worker, Worker]]:
    """A prefill worker (3 s leases) and a decode worker sharing a namespace; stopped on exit."""
    p = Worker("prefill", model, cache_dir=workdir, namespace=namespace,
               extra=["--lease-seconds", "3", *extra])
    try:
        d = Worker("decode", model, cache_dir=workdir, namespace=namespace, extra=list(extra))
        try:
            yield p, d
        finally:
            d.close()
    finally:
        p.close()


@contextmanager
def two_by_two(folder: Path, workdir: Path,
               namespace: str) -> Iterator[tuple[Router, list[Worker]]]:
    """Two prefill and two decode workers (10 s drain, 5 s leases) and a router in front, all
    stopped on exit: the cluster the lifecycle tests and the rolling-restart soak restart."""
    workers: list[Worker] = []
    router = None
    try:
        for role in ("prefill", "prefill", "decode", "decode"):
            workers.append(Worker(role, str(folder), cache_dir=workdir, namespace=namespace,
                                  extra=["--drain-timeout-s", "10", "--lease-seconds", "5"]))
        router = Router(folder, namespace, cache_dir=workdir)
        router.wait_workers(4)
        yield router, workers
    finally:
        for p in [router, *workers]:
            if p is not None:
                p.close()


def expected_tokens(reference, prompt: list[int], sampling: dict) -> list[int]:
    """What the one-process reference engine generates for `prompt`."""
    from engine import SamplingParams

    return reference.generate(prompt, SamplingParams(**sampling))[0].token_ids


def pd_generate(p: Worker, d: Worker, request_id: str, prompt: list[int],
                sampling: dict) -> tuple[list[int], dict]:
    """Prefill on P, then decode on D with the first token and P's kv_transfer_params."""
    pre = p.prefill(request_id, prompt, sampling)
    first = pre["first_token_id"]
    if pre.get("finish_reason"):
        return [first], pre
    events = d.generate(request_id, prompt, sampling, [first], pre["kv_transfer_params"])
    tokens = [first] + [t for ev in events for t in ev["token_ids"]]
    return tokens, events[-1]


class Router:
    """A real `tandem router` process over Redis discovery, serving HTTP once built (ready or
    not: `wait_workers`); started on another port if its first one was taken before it could
    bind it."""

    def __init__(self, tokenizer_folder: Path | None, namespace: str | None, *, cache_dir: Path,
                 policy: str = "kv_aware", block_size: int = 4, token: str | None = TOKEN,
                 redis_url: str | None = REDIS_URL, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        """`tokenizer_folder` pins the router to that one model (`--model`, `--tokenizer`);
        None: it serves every model that registers."""
        self.cache_dir = cache_dir
        cmd = [sys.executable, "-m", "tandem.cli", "router", "--block-size", str(block_size),
               "--port", "0", "--policy", policy, "--cache-dir", str(cache_dir)]
        if tokenizer_folder is not None:
            cmd += ["--model", tokenizer_folder.name, "--tokenizer", str(tokenizer_folder)]
        if redis_url:
            cmd += ["--redis-url", redis_url, "--namespace", namespace]
        if token:
            cmd += [f"--internal-token={token}"]
        cmd += extra or []
        self.cmd, self.env = cmd, {**os.environ, **(env or {})}
        self.client = httpx.Client(timeout=60)
        self.log = None
        self.proc = start_on_free_port(self._use_port, self._launch, self._wait_serving,
                                       lambda: Path(self.log.name))

    def _use_port(self, port: int) -> None:
        self.port = port
        self.cmd[self.cmd.index("--port") + 1] = str(port)
        self.url = f"http://127.0.0.1:{port}"
        self.client.base_url = self.url
        if self.log is None:  # one log for every start, named after the first port
            self.log = open(self.cache_dir / f"router-{port}.log", "w")

    def _launch(self) -> subprocess.Popen:
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=self.env)
        return self.proc

    def _wait_serving(self, timeout: float = 60) -> None:
        """Until it answers HTTP at all (its port is its own); raises if it exits first."""
        # A short timeout per probe: whoever took the port may accept and never answer.
        wait_http_ok(self.proc, Path(self.log.name), lambda: self.client.get("/ready", timeout=5),
                     "router", timeout, interval=0.05, any_status=True)

    def wait_workers(self, n: int, timeout: float = 30, models: int = 0) -> None:
        """Until the router routes to `n` workers (and serves `models` models)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                r = self.client.get("/ready")
                ready = r.json()
                if (r.status_code == 200 and len(ready["workers"]) >= n
                        and len(ready.get("models", [])) >= models):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router did not see {n} workers")

    def metrics(self) -> dict[str, float]:
        return scrape(self.client)

    def close(self) -> None:
        stop_process(self.proc, 15)
        self.client.close()
        self.log.close()


