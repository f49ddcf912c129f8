"""Local TCP ports for the local cluster (tandem/launcher.py): whether something listens on one,
and one that is free."""

from __future__ import annotations

import socket


def port_open(host: str, port: int) -> bool:
    """Whether `host:port` accepts a connection within 0.3 s."""
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def free_port() -> int:
    """A port of 127.0.0.1 that the kernel reports free now (the caller binds it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
