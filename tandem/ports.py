"""Local TCP ports for the local cluster (tandem/launcher.py): whether something listens on one,
waiting until something does, and one that is free."""

from __future__ import annotations

import socket
import time


def port_open(host: str, port: int) -> bool:
    """Whether `host:port` accepts a connection within 0.3 s."""
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def wait_open(host: str, port: int, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Until `host:port` accepts a connection; False if it did not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not port_open(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def free_port() -> int:
    """A port of 127.0.0.1 that the kernel reports free now (the caller binds it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
