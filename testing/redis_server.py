"""The Redis the tests share (TANDEM_TEST_REDIS_URL, else the one on 127.0.0.1:6379; each test
uses a namespace of its own), and throwaway redis-servers that a test may stop and start."""

from __future__ import annotations

import os
import subprocess
import time

import redis

from testing.processes import free_port

REDIS_URL = os.environ.get("TANDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def wait_redis(port: int, timeout: float = 10.0) -> None:
    """Until the redis-server on `port` answers PING."""
    client = redis.Redis(port=port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise TimeoutError(f"redis-server on {port} did not start")


class RedisServer:
    """A throwaway redis-server on a fixed port, so it can be stopped and started again."""

    def __init__(self, tmp_path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tmp_path
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind",
                                      "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
                                      str(self.dir)], stdout=subprocess.DEVNULL)
        wait_redis(self.port)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
