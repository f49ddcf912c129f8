"""The Redis a local cluster (tandem/launcher.py) registers its workers in: the one at the URL
given when it answers, else a redis-server started here on a free port, else none (the router
then keeps its in-process index)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from tandem.ports import free_port, port_open, wait_open
from tandem.server import parent_death_signal


@dataclass(frozen=True)
class LocalRedis:
    url: str | None  # None: no Redis, the router's in-process index
    proc: subprocess.Popen | None  # the redis-server started here, to stop with the cluster
    note: str  # what the launcher tells its user about the choice

    def wait_listening(self) -> None:
        """Until the redis-server started here accepts connections (5 s at most); at once
        when none was started."""
        if self.proc is None or self.url is None:
            return
        where = urllib.parse.urlsplit(self.url)
        wait_open(where.hostname or "127.0.0.1", where.port or 6379, timeout_s=5.0)


def local_redis(redis_url: str, redis_cluster: bool, log_dir: Path) -> LocalRedis:
    """The Redis at `redis_url` if it answers; else (not for a Redis Cluster, which is never
    started here: SystemExit) a redis-server on a free loopback port, logging to
    `log_dir`/redis.log (`wait_listening` waits for it); else none."""
    given = urllib.parse.urlsplit(redis_url)
    host, port = given.hostname or "127.0.0.1", given.port or 6379
    if port_open(host, port):
        return LocalRedis(redis_url, None, f"using the Redis at {redis_url}")
    if redis_cluster:
        raise SystemExit(f"no Redis Cluster node answers at {host}:{port}")
    host = "127.0.0.1"
    if shutil.which("redis-server"):
        port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", host,
                                 "--save", "", "--appendonly", "no"],
                                stdout=open(log_dir / "redis.log", "w"),
                                start_new_session=True, preexec_fn=parent_death_signal())
        return LocalRedis(f"redis://{host}:{port}/0", proc,
                          f"no Redis at {given.hostname}:{given.port or 6379}; started "
                          f"redis-server on {host}:{port}")
    return LocalRedis(None, None, "warning: no Redis reachable and no redis-server installed; "
                      "the router uses its in-process index (approximate, learns from its own "
                      "routing)")
