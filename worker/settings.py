"""Worker settings, built once at the edge (CLI flags over TANDEM_* environment variables)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict

Role = Literal["prefill", "decode", "colocated"]


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    role: Role = "colocated"
    model: str = "smollm2-135m-instruct"
    model_id: str | None = None
    cache_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None  # what peers and the router use to reach this worker
    worker_id: str | None = None
    redis_url: str | None = None
    namespace: str = "default"
    heartbeat_ttl_s: float = 10.0
    internal_token: str | None = None
    # Without a token the internal API is open and KV handles unsigned: allowed on loopback
    # (development), refused on any other address unless the operator says --insecure.
    insecure: bool = False
    device: str = "cpu"
    dtype: str | None = None
    num_blocks: int | None = None
    kv_memory_gb: float = 1.0
    block_size: int = 16
    threads: int | None = None
    pack_weights: bool = True  # oneDNN-prepacked matmuls on CPU float32 (engine/linear.py)
    # HTTP and streaming never wait on the engine for the GIL. Unset: on for colocated CPU
    # workers, off for prefill and decode ones (measured slower at 1000-token contexts with one
    # thread each, README "Serving path"); a CUDA worker always steps on a thread.
    engine_process: bool | None = None  # engine core in its own process (engine/core_client.py)

    @property
    def use_engine_process(self) -> bool:
        if not self.device.startswith("cpu"):
            return False
        return self.role == "colocated" if self.engine_process is None else self.engine_process
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    transport: str | None = None  # nixl | tcp; default: nixl where it imports
    transport_port: int = 0
    lease_seconds: float = 30.0
    max_lease_seconds: float = 120.0  # the most a /prefill caller may pin blocks for
    handshake_timeout_s: float = 5.0  # KV metadata handshake with a peer, start to end
    pull_timeout_s: float = 10.0
    max_queue: int = 256  # prefill requests waiting beyond this get 503 + Retry-After
    max_body_bytes: int = 64 << 20  # internal requests carry token ids: 1M tokens is ~8 MB
    # Test builds only: POST /debug/engine-fault makes the engine thread raise (the dead-worker
    # path is tested with it). Needs the internal token like every internal endpoint.
    fault_injection: bool = False

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def url(self) -> str:
        return f"http://{self.public_host}:{self.port}"

    @property
    def on_loopback(self) -> bool:
        return is_loopback(self.host) and (self.advertise_host is None or is_loopback(self.advertise_host))

    def security_problem(self) -> str | None:
        """Why this configuration must not start, or None."""
        if self.internal_token or self.insecure or self.on_loopback:
            return None
        return (f"refusing to listen on {self.host} without an internal token: anyone who can "
                "reach this port could drive the engine and read its KV cache. Set "
                "--internal-token (or TANDEM_INTERNAL_TOKEN), or pass --insecure to run open anyway.")

    @property
    def require_signed_handles(self) -> bool:
        return bool(self.internal_token) and not self.insecure

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.role}-{self.public_host}-{self.port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
