"""A throwaway local Redis Cluster (`redis-server --cluster-enabled yes` nodes joined by
`redis-cli --cluster create`), for the cluster tests and benchmarks: three masters with one
replica each by default, nothing persisted, a short node timeout so a failover takes seconds."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from testing.redis_server import wait_redis


def _free_port_pair() -> int:
    """A port p with p + 10000 (its cluster bus) free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class LocalRedisCluster:
    def __init__(self, work_dir: Path, num_masters: int = 3, replicas: int = 1,
                 node_timeout_ms: int = 1000) -> None:
        if not shutil.which("redis-server") or not shutil.which("redis-cli"):
            raise RuntimeError("redis-server and redis-cli are needed for a local Redis Cluster")
        self.dir = Path(work_dir)
        self.node_timeout_ms = node_timeout_ms
        self.ports = [_free_port_pair() for _ in range(num_masters * (1 + replicas))]
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for port in self.ports:
                self._start(port)
            subprocess.run(["redis-cli", "--cluster", "create",
                            *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", str(replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """A live node: the clients learn the rest from it (a client given only a dead node
        cannot start, so after `kill` this names another one)."""
        return f"redis://127.0.0.1:{self.live_ports()[0]}/0"

    def _start(self, port: int) -> None:
        node_dir = self.dir / f"node-{port}"
        node_dir.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms),
             "--save", "", "--appendonly", "no", "--dir", str(node_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_redis(port)

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.live_ports()[0],
                            require_full_coverage=False)

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def masters(self) -> list[int]:
        out = []
        for port in self.live_ports():
            info = redis.Redis(port=port).info("replication")
            if info.get("role") == "master":
                out.append(port)
        return out

    def master_of(self, key: str) -> int:
        c = self.client()
        try:
            return c.get_node_from_key(key).port
        finally:
            c.close()

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports `cluster_state:ok` with all 16384 slots served."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                infos = [redis.Redis(port=p).cluster("info") for p in self.live_ports()]
                if all(i.get("cluster_state") == "ok" and int(i.get("cluster_slots_ok", 0)) == 16384
                       for i in infos):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the Redis Cluster did not reach state ok")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
