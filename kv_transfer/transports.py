"""The KV transports by name (the `Transport` Protocol is in kv_transfer/transport.py): `nixl`
(NIXL over UCX: RDMA, shared memory or TCP) and `tcp` (our own fallback wire)."""

from __future__ import annotations

from kv_transfer.nixl_transport import NixlTransport, nixl_available
from kv_transfer.tcp_transport import TcpTransport

TRANSPORTS: dict[str, type] = {"nixl": NixlTransport, "tcp": TcpTransport}


def transport_names() -> list[str]:
    return list(TRANSPORTS)


def get_transport_class(name: str) -> type:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose from {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]


def default_transport_name() -> str:
    """`nixl` where the NIXL package imports, else `tcp`."""
    return "nixl" if nixl_available() else "tcp"
