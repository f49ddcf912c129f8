"""Worker settings, built once at the edge (CLI flags over TANDEM_* environment variables)."""

from __future__ import annotations

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
    device: str = "cpu"
    dtype: str | None = None
    num_blocks: int | None = None
    kv_memory_gb: float = 1.0
    block_size: int = 16
    threads: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    transport: str | None = None  # nixl | tcp; default: nixl where it imports
    transport_port: int = 0
    lease_seconds: float = 30.0
    pull_timeout_s: float = 10.0
    max_queue: int = 256  # prefill requests waiting beyond this get 503 + Retry-After

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def url(self) -> str:
        return f"http://{self.public_host}:{self.port}"

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.role}-{self.public_host}-{self.port}"
