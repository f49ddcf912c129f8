"""Which network devices UCX may use: the one that carries the worker's address, plus RDMA ports.

UCX's TCP transport listens on every interface it is allowed (a worker started with
`--host 127.0.0.1` accepted connections on its external address); `UCX_NET_DEVICES` limits it.
RDMA ports are kept: they are not TCP listeners, and dropping them would lose the fast path.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

_SIOCGIFADDR = 0x8915


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_interfaces(path: Path = Path("/proc/net/if_inet6")) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in path.read_text().splitlines():
            hexaddr, *_, name = line.split()
            out[str(ipaddress.IPv6Address(bytes.fromhex(hexaddr)))] = name
    except OSError:
        pass
    return out


def interface_for(host: str) -> str | None:
    """The interface whose address is `host` (an IP or a resolvable name), or None."""
    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    except (OSError, ValueError, IndexError):
        return None
    if ip.is_unspecified:
        return None
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return name
    return None


def rdma_ports(root: Path = Path("/sys/class/infiniband")) -> list[str]:
    """`mlx5_0:1`-style names of every RDMA port, as UCX_NET_DEVICES spells them."""
    if not root.is_dir():
        return []
    return sorted(f"{dev.name}:{port.name}" for dev in root.iterdir()
                  for port in (dev / "ports").iterdir() if (dev / "ports").is_dir())


def ucx_net_devices(host: str) -> str | None:
    """A UCX_NET_DEVICES value for a worker bound to `host`; None to leave UCX's default (all)."""
    iface = interface_for(host)
    if iface is None:
        return None
    return ",".join([iface, *rdma_ports()])
