"""A second "host" for tests and benchmarks: a network namespace joined to this one by a veth
pair. Needs root and iproute2; the addresses exist only on the pair made here."""

from __future__ import annotations

import subprocess
import uuid


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


class Link:
    """`root_ips` on this side of the pair (the first is the primary), `ns_ip` in the namespace."""

    def __init__(self, root_ips: list[str], ns_ip: str, prefix_len: int = 24) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns, self.dev_root, self.dev_ns = f"tdm-d-{tag}", f"vr{tag}", f"vd{tag}"
        sh("ip", "netns", "add", self.ns)
        sh("ip", "link", "add", self.dev_root, "type", "veth", "peer", "name", self.dev_ns)
        sh("ip", "link", "set", self.dev_ns, "netns", self.ns)
        for ip in root_ips:
            sh("ip", "addr", "add", f"{ip}/{prefix_len}", "dev", self.dev_root)
        sh("ip", "link", "set", self.dev_root, "up")
        sh("ip", "-n", self.ns, "addr", "add", f"{ns_ip}/{prefix_len}", "dev", self.dev_ns)
        sh("ip", "-n", self.ns, "link", "set", self.dev_ns, "up")
        sh("ip", "-n", self.ns, "link", "set", "lo", "up")

    def shape(self, rate: str, burst: str) -> None:
        """Token-bucket rate limit on both ends (this kernel has tbf, not netem)."""
        for prefix, dev in ((["ip", "netns", "exec", self.ns], self.dev_ns), ([], self.dev_root)):
            sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
               "burst", burst, "latency", "50ms")

    def blackhole(self, ip: str, on: bool = True) -> None:
        """Inside the namespace, traffic to `ip` is dropped (or flows again)."""
        sh("ip", "-n", self.ns, "route", "add" if on else "del", "blackhole", f"{ip}/32")

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.dev_root], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
