"""What a simulated worker and link cost: measured on this machine (`calibrated`) or given as a
JSON file for other hardware (`load`), e.g. a GPU profile:

    {"prefill_tokens_per_s": 45000, "prefill_fixed_s": 0.004,
     "decode_step_base_s": 0.012, "decode_step_per_seq_s": 0.00008,
     "link_bytes_per_s": 40e9, "link_latency_s": 0.0005,
     "block_size": 16, "block_bytes": 2097152, "num_blocks": 60000, "router_hop_s": 0.0008,
     "host_blocks": 600000, "disk_blocks": 1800000}
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class CostProfile:
    prefill_tokens_per_s: float  # uncached prompt tokens per second, one worker
    prefill_fixed_s: float  # per prefill (scheduling, sampling, HTTP)
    decode_step_base_s: float  # one decode step of batch 1 ...
    decode_step_per_seq_s: float  # ... plus this per extra running sequence
    link_bytes_per_s: float  # KV pull bandwidth between a prefill and a decode worker
    link_latency_s: float  # fixed cost of one pull (handshake, notification)
    block_size: int = 16
    block_bytes: int = 368_640  # KV bytes of one block (SmolLM2 fp16: 16 x 23,040)
    num_blocks: int = 4096  # KV blocks per worker (its prefix cache's capacity)
    router_hop_s: float = 0.001  # one router -> worker HTTP hop
    # The fixed part of a prefill on a decode worker (the local plan, or a colocated worker),
    # whose first token streams out rather than coming back with KV parameters; None = as above.
    local_prefill_fixed_s: float | None = None
    # Cores that every worker and the router share (one small machine: their work slows each
    # other down); None = each worker has hardware of its own (a GPU per worker). With it, every
    # process (each worker, the router, the load generator) is one thread on the shared host:
    # its work runs in order, one job at a time (a Python process, bound by its GIL), and the
    # costs below, all CPU work of one process, apply.
    host_cores: float | None = None
    # router work before the first worker call (template, tokenize, route)
    router_cpu_s: float = 0.0
    # Hashing a prompt's blocks and the replica index lookup (bench/index.py: gallop p50 is
    # ~0.14 us per worker per doubling of the prompt's blocks): they grow with the fleet and the
    # context, and run on the router's one event loop.
    hash_s_per_block: float = 0.5e-6
    lookup_base_s: float = 10e-6
    lookup_s_per_worker_doubling: float = 0.14e-6
    router_relay_cpu_per_token_s: float = 0.0  # the router's work per token it relays to a client
    client_cpu_per_token_s: float = 0.0  # a load generator on the same machine, per token it reads
    # A worker's own work per request besides its prefill or decode steps (HTTP, leases, pulls,
    # events), after the work the request waits for: it delays the worker's next job.
    prefill_io_cpu_s: float = 0.0
    decode_io_cpu_s: float = 0.0
    # Spread of every CPU cost (coefficient of variation, lognormal, mean 1): real service times
    # vary, and without it simulated requests fall into lockstep (e.g. each session always
    # meeting the same prefill worker under round robin).
    jitter: float = 0.0
    # KV tiers below the device (`python -m sim sweep --tiers`): each worker's host-
    # memory and disk tier capacities in blocks (0: no such tier), their reload rates into the
    # device in bytes/s, and what offloading a block costs the worker's step (0: the copy runs
    # on a side stream or thread, off the step, as the engine's does).
    host_blocks: int = 0
    disk_blocks: int = 0
    host_reload_bytes_per_s: float = 50e9  # host -> GPU over PCIe Gen5, effective
    disk_reload_bytes_per_s: float = 5e9  # a local NVMe drive
    offload_s_per_block: float = 0.0
    # From a new worker's start to its first request (model load plus graph capture; tens of
    # seconds on GPUs): what scaling up waits for (`python -m sim autoscale`).
    startup_s: float = 0.0
    # Peer prefix pulls (`python -m sim sweep --peer-pulls`): workers fill nodes of
    # `workers_per_node` in order, nodes fill racks of `nodes_per_rack` (locality
    # "z/r<rack>/n<node>"), and a pull between two workers moves at its link's rate (None: at
    # `link_bytes_per_s`, as a P/D transfer), after `link_latency_s`.
    workers_per_node: int = 8
    nodes_per_rack: int = 4
    same_node_bytes_per_s: float | None = None
    same_rack_bytes_per_s: float | None = None
    cross_rack_bytes_per_s: float | None = None

    def locality(self, index: int) -> str:
        """Where the fleet's `index`-th worker runs."""
        node = index // self.workers_per_node
        return f"z/r{node // self.nodes_per_rack}/n{node}"

    def pull_s(self, num_blocks: int, link: str) -> float:
        """Pulling `num_blocks` over a link of class `link` (common/locality.py)."""
        rate = {"same_node": self.same_node_bytes_per_s,
                "same_rack": self.same_rack_bytes_per_s}.get(link, self.cross_rack_bytes_per_s)
        return self.link_latency_s + num_blocks * self.block_bytes / (rate or self.link_bytes_per_s)

    def decode_step_s(self, batch: int) -> float:
        return self.decode_step_base_s + self.decode_step_per_seq_s * max(batch - 1, 0)

    def prefill_s(self, num_uncached: int, local: bool = False) -> float:
        fixed = (self.local_prefill_fixed_s if local and self.local_prefill_fixed_s is not None
                 else self.prefill_fixed_s)
        return fixed + num_uncached / self.prefill_tokens_per_s

    def lookup_s(self, num_blocks: int, num_workers: int) -> float:
        """Hashing a prompt of `num_blocks` blocks and matching it against `num_workers`."""
        return (num_blocks * self.hash_s_per_block + self.lookup_base_s
                + num_workers * math.log2(num_blocks + 1) * self.lookup_s_per_worker_doubling)

    def transfer_s(self, num_blocks: int) -> float:
        return self.link_latency_s + num_blocks * self.block_bytes / self.link_bytes_per_s

    def reload_tokens_per_s(self, medium: str) -> float:
        """Prompt tokens per second reloaded from tier `medium` (host, disk) into the device:
        what a worker with tiers reports in its load (`reload_tokens_per_s`)."""
        rate = self.host_reload_bytes_per_s if medium == "host" else self.disk_reload_bytes_per_s
        return rate / self.block_bytes * self.block_size

    def reload_s(self, num_host_blocks: int, num_disk_blocks: int) -> float:
        """Reloading that many blocks from the host and the disk tier into the device."""
        return self.block_bytes * (num_host_blocks / self.host_reload_bytes_per_s
                                   + num_disk_blocks / self.disk_reload_bytes_per_s)

    def to_json(self) -> dict:
        return asdict(self)


def load(path: str | Path) -> CostProfile:
    data = json.loads(Path(path).read_text())
    known = {f.name for f in fields(CostProfile)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown profile fields {sorted(unknown)}; known: {sorted(known)}")
    return CostProfile(**data)


# Measured here (2 cores, 1 torch thread per worker, SmolLM2-135M fp32, bench/engine.py and
# bench/kv_transfer.py figures, README): prefill ~480 tok/s per thread (968 tok/s on 2), decode
# 30 tok/s at batch 1 and 111 tok/s aggregate at batch 8 (on 2 threads; halved for 1), NIXL over
# loopback ~4 GB/s with ~2 ms fixed cost per pull.
SMOLLM2_CPU = CostProfile(prefill_tokens_per_s=480.0, prefill_fixed_s=0.01,
                          decode_step_base_s=0.066, decode_step_per_seq_s=0.0064,
                          link_bytes_per_s=4e9, link_latency_s=0.002, block_size=16,
                          block_bytes=737_280, num_blocks=2048, router_hop_s=0.002)

# tiny-random (2 layers, hidden 64) as the tests and bench/policies.py run it, every process on
# this 2-core machine: the costs are all fixed overheads (HTTP, scheduling, Python). Measured by
# bench/sim_profile.py (two pooled calibrations of 3 clusters each, rounded).
TINY_CPU = CostProfile(prefill_tokens_per_s=72_000.0, prefill_fixed_s=0.0026,
                       decode_step_base_s=0.0014, decode_step_per_seq_s=0.00045,
                       link_bytes_per_s=2e8, link_latency_s=0.00155, block_size=4, block_bytes=2048,
                       num_blocks=2048, router_hop_s=0.00026, local_prefill_fixed_s=0.0033,
                       host_cores=1.88, router_cpu_s=0.001, router_relay_cpu_per_token_s=0.00024,
                       client_cpu_per_token_s=0.0003, prefill_io_cpu_s=0.00014,
                       decode_io_cpu_s=0.0003, jitter=0.26)

PROFILES = {"smollm2-cpu": SMOLLM2_CPU, "tiny-cpu": TINY_CPU}


def calibrated(name: str) -> CostProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)} or "
                         "give a JSON file")
    return PROFILES[name]
