"""`tandem up` / `tandem demo`: a local cluster of processes (Redis, prefill and decode workers,
the router) with readable progress and a clean shutdown however it is stopped: SIGINT, SIGTERM or
SIGHUP are forwarded to every child as SIGTERM (each drains and deregisters, tandem/server.py),
what outlives the drain is killed, and a launcher killed with SIGKILL takes its children with it
(they get SIGTERM from the kernel when their parent dies)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.local_redis import local_redis
from tandem.ports import free_port, port_open
from tandem.server import parent_death_signal


def _say(msg: str) -> None:
    print(f"[tandem] {msg}", flush=True)


@dataclass
class Cluster:
    model: str
    cache_dir: Path
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False  # redis_url is one node of a Redis Cluster (never started here)
    namespace: str | None = None  # None: derived from the router port, so two clusters differ
    drain_timeout_s: float = 30.0
    num_blocks: int | None = None
    threads: int | None = None
    # KV tiers of every worker (None: the workers' own settings); each worker's disk tier is the
    # subfolder of `disk_kv_dir` named after it, so a restart on the same folder finds its blocks.
    host_kv_gb: float | None = None
    disk_kv_dir: Path | None = None
    disk_kv_gb: float | None = None
    log_dir: Path = Path(".tandem-logs")
    # The cluster's internal token (workers' internal API, /kv/metadata, KV handle signatures).
    # None: a fresh random one per cluster, so the internal plane is never open by default.
    internal_token: str | None = None
    extra_worker_args: list[str] = field(default_factory=list)
    extra_router_args: list[str] = field(default_factory=list)
    # Client API keys of the router; given to it by environment (TANDEM_ROUTER_API_KEYS), like
    # the token, never on its command line.
    api_keys: list[str] = field(default_factory=list)
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    specs: dict[str, list[str]] = field(default_factory=dict)  # name -> CLI args, for restarts
    restarts: dict[str, int] = field(default_factory=dict)
    retiring: set[str] = field(default_factory=set)  # workers draining on purpose
    _next: dict[str, int] = field(default_factory=dict)  # each role's next worker index
    _worker_common: list[str] = field(default_factory=list)  # every worker's arguments

    def _spawn(self, name: str, args: list[str],
               env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # a restart appends
        log = open(self.log_dir / f"{name}.log", "a" if name in self.specs else "w")
        # The token goes by environment, not argv: argv is readable by every user (ps).
        env = {**os.environ, "TANDEM_INTERNAL_TOKEN": self.internal_token or "", **(env or {})}
        # Own session: the terminal's Ctrl-C reaches the launcher alone, which forwards it.
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                preexec_fn=parent_death_signal())
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]
        self.specs[name] = args
        return proc

    def _redis(self) -> str | None:
        if self.redis_url is None:
            return None
        redis = local_redis(self.redis_url, self.redis_cluster, self.log_dir)
        if redis.proc is not None:
            # a child from now on: stopped with the rest, even while still starting
            self.procs.append(("redis", redis.proc))
            redis.wait_listening()
        _say(redis.note)
        return redis.url

    def up(self) -> str:
        if not self.internal_token:
            self.internal_token = secrets.token_urlsafe(32)
        self.port = self.port or free_port()
        if port_open("127.0.0.1", self.port):
            # Another router (another cluster) answers there: its readiness would pass for ours.
            raise SystemExit(f"[tandem] port {self.port} is in use; stop what listens there or "
                             "choose another --port")
        # Two clusters on one Redis never share a namespace by default (the same port on two
        # hosts, or one after another): the port says whose it is, the suffix keeps them apart.
        self.namespace = self.namespace or f"local-{self.port}-{secrets.token_hex(3)}"
        self.nonce = secrets.token_hex(8)
        redis_url = self._redis()
        if redis_url:
            _say(f"Redis namespace {self.namespace!r}")
        static: list[str] = []
        common = ["--model", self.model, "--cache-dir", str(self.cache_dir),
                  "--drain-timeout-s", str(self.drain_timeout_s), *self.extra_worker_args]
        if self.num_blocks:
            common += ["--num-blocks", str(self.num_blocks)]
        if self.threads:
            common += ["--threads", str(self.threads)]
        if self.host_kv_gb is not None:
            common += ["--host-kv-gb", str(self.host_kv_gb)]
        if self.disk_kv_gb is not None:
            common += ["--disk-kv-gb", str(self.disk_kv_gb)]
        cluster_flag = ["--redis-cluster"] if self.redis_cluster else []
        if redis_url:
            common += ["--redis-url", redis_url, "--namespace", self.namespace, *cluster_flag]
        self._worker_common = common
        workers = []
        for role, n in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for _ in range(n):
                name, url = self.add_worker(role)
                workers.append((name, url))
                static.append(f"{role}={url}")
        for name, url in workers:
            self._wait(f"{url}/ready", name, 300)
            _say(f"{name} ready at {url}")
        port = self.port
        router = ["router", "--model", Path(self.model).name, "--cache-dir", str(self.cache_dir),
                  "--port", str(port), "--drain-timeout-s", str(self.drain_timeout_s),
                  *self.extra_router_args]
        if redis_url:
            router += ["--redis-url", redis_url, "--namespace", self.namespace, *cluster_flag]
        else:
            for entry in static:
                router += ["--worker", entry]
        env = {"TANDEM_ROUTER_INSTANCE_NONCE": self.nonce}
        if self.api_keys:
            env["TANDEM_ROUTER_API_KEYS"] = json.dumps(self.api_keys)
        self._spawn("router", router, env)
        url = f"http://127.0.0.1:{port}"
        self._wait(f"{url}/ready", "router", 60, nonce=self.nonce)
        _say(f"router ready at {url}/v1 (logs in {self.log_dir}/)")
        return url

    def add_worker(self, role: str) -> tuple[str, str]:
        """Start one more `role` worker (it registers in Redis once ready); (name, url)."""
        i = self._next.get(role, 0)
        self._next[role] = i + 1
        port, name = free_port(), f"{role}-{i}"
        tier = (["--disk-kv-dir", str(self.disk_kv_dir / name)]
                if self.disk_kv_dir is not None else [])
        self._spawn(name, [role, *self._worker_common, *tier, "--port", str(port)])
        return name, f"http://127.0.0.1:{port}"

    def pool(self, role: str) -> list[str]:
        """The `role` workers running and not draining, oldest first."""
        return [n for n, p in self.procs if n.startswith(f"{role}-") and p.poll() is None
                and n not in self.retiring]

    def retire_worker(self, role: str) -> str | None:
        """Drain the newest `role` worker (SIGTERM: it deregisters, finishes its requests and
        exits; the supervisor lets it go); its name, or None when there is none."""
        names = self.pool(role)
        if not names:
            return None
        name = names[-1]
        self.retiring.add(name)
        dict(self.procs)[name].send_signal(signal.SIGTERM)
        return name

    def _wait(self, url: str, name: str, timeout: float, nonce: str | None = None) -> None:
        """Until `url` answers 200 (with `nonce`: and says it is the process started here)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pname, proc in self.procs:
                if proc.poll() is not None:
                    log = (self.log_dir / f"{pname}.log").read_text()[-2000:]
                    raise RuntimeError(f"{pname} exited with {proc.returncode}:\n{log}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200 and (nonce is None
                                            or r.headers.get("X-Tandem-Instance") == nonce):
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{name} was not ready within {timeout:.0f} s")

    def supervise(self, poll_s: float = 0.5, max_backoff_s: float = 30.0,
                  healthy_after_s: float = 60.0, tick: Callable[[], None] | None = None) -> str:
        """Keep the cluster running until a process that cannot be restarted exits (the router,
        Redis); returns its name. A worker that exits (a dead engine exits non-zero) is started
        again on its own port, after a backoff that doubles with each quick failure; one that
        was retired (drained) is let go. `tick()` runs every round (the autoscaler)."""
        started = {name: time.monotonic() for name, _ in self.procs}
        due: dict[str, float] = {}
        while True:
            now = time.monotonic()
            for name, proc in list(self.procs):
                if proc.poll() is None or name in due:
                    continue
                if name in self.retiring:
                    self.retiring.discard(name)
                    self.procs = [(n, p) for n, p in self.procs if n != name]
                    _say(f"{name} drained and stopped (exit {proc.returncode})")
                    continue
                if name not in self.specs or not name.startswith(("prefill-", "decode-")):
                    return name
                if now - started.get(name, now) > healthy_after_s:
                    self.restarts[name] = 0  # it had been up a while: a fresh failure
                delay = min(max_backoff_s, 2 ** self.restarts.get(name, 0) - 1)
                self.restarts[name] = self.restarts.get(name, 0) + 1
                _say(f"{name} exited with {proc.returncode}; restarting in {delay:.0f} s")
                due[name] = now + delay
            for name, when in list(due.items()):
                if now >= when:
                    del due[name]
                    self._spawn(name, self.specs[name])
                    started[name] = time.monotonic()
            if tick is not None:
                tick()
            time.sleep(poll_s)

    def down(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child (each drains, deregisters and exits), wait out the drain, kill
        what is left. The router goes first: it stops taking requests while workers finish."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout_s + grace_s
        try:
            for name, proc in reversed(self.procs):
                try:
                    proc.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    _say(f"{name} did not stop in time; killing it")
        except KeyboardInterrupt:  # a second Ctrl-C (or SIGTERM): no more waiting
            _say("stopping now")
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        self.procs.clear()
        _say("stopped")
