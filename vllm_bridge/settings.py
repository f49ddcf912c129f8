"""`tandem vllm-bridge` settings, built once at the edge: CLI flags (generated from these fields by
tandem/flags.py) over TANDEM_BRIDGE_* environment variables over the defaults here. Each field's
description is its `--help` text and its line in the configuration reference
(docs/configuration.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.block_events import WORKER_ID_PATTERN
from vllm_bridge.events import MAX_PAYLOAD_BYTES

# What a worker registers as its URL (common/registry.py WorkerRegistration.url): no path.
URL_PATTERN = r"^https?://[A-Za-z0-9.\-\[\]:]+(:[0-9]{1,5})?$"
ZMQ_PATTERN = r"^(tcp://\S{1,500}|ipc://\S{1,500})$"


class BridgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_BRIDGE_", extra="forbid")

    vllm_url: str = Field(pattern=URL_PATTERN, description="the vLLM server this bridge "
                          "mirrors, as the bridge reaches it (e.g. http://127.0.0.1:8000)")
    advertise_url: str | None = Field(None, pattern=URL_PATTERN, description="the vLLM "
                                      "server's URL as routers reach it, registered in Redis "
                                      "(default: --vllm-url)")
    vllm_api_key: str | None = Field(None, max_length=4096, description="the vLLM server's "
                                     "--api-key, if it has one (sent on the bridge's probes)")
    events_endpoint: str | None = Field(None, pattern=ZMQ_PATTERN, description="vLLM's KV "
                                        "events PUB socket (tcp://host:port or ipc://path); "
                                        "default: read from the server's /kv_event_sources")
    replay_endpoint: str | None = Field(None, pattern=ZMQ_PATTERN, description="vLLM's replay "
                                        "ROUTER socket; default: read from /kv_event_sources. "
                                        "Without one, lost or missed events empty the index "
                                        "until they are reported again")
    topic: str | None = Field(None, max_length=1024, description="the events' topic "
                              "(default: the server's, from /kv_event_sources, else any)")
    dp_rank: int = Field(0, ge=0, le=1023, description="which data-parallel rank's events "
                         "to mirror (a vLLM server with --data-parallel-size > 1 has one "
                         "publisher per rank)")
    role: Literal["colocated", "prefill", "decode"] = Field("colocated", description="the "
                                                           "role the vLLM server is registered "
                                                           "with")
    worker_id: str | None = Field(None, pattern=WORKER_ID_PATTERN, description="id in Redis "
                                  "and metrics (default: vllm-host-port of the advertised URL)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", max_length=4096, description="Redis "
                           "where the server is registered and its block set published")
    redis_cluster: bool = Field(False, description="--redis-url names one node of a Redis "
                                "Cluster (common/redis_client.py)")
    namespace: str = Field("default", pattern=r"^[A-Za-z0-9._\-]{1,128}$", description="Redis "
                           "key namespace shared with the routers")
    internal_token: str | None = Field(None, max_length=4096, description="signs the "
                                       "registration, as workers do ($TANDEM_INTERNAL_TOKEN); "
                                       "routers that hold a token refuse unsigned ones")
    hash_salt: str | None = Field(None, max_length=1024, description="salt of the block "
                                  "hashes; must match the routers'")
    block_size: int | None = Field(None, ge=1, le=1 << 16, description="the server's tokens "
                                   "per KV block (default: read from its /metrics "
                                   "vllm:cache_config_info)")
    model_folder: Path | None = Field(None, description="the served model's folder, if the "
                                      "bridge can read it: its digest (config and tokenizer "
                                      "files) names the model, as Tandem workers do; default: "
                                      "the digest of the model path vLLM reports, as routers "
                                      "probing vLLM compute it")
    max_blocks: int | None = Field(None, ge=1, le=1 << 26, description="vLLM blocks mapped "
                                   "at most; past it the index is emptied (default: four times "
                                   "the server's KV blocks)")
    health_interval_s: float = Field(2.0, ge=0.05, le=60, description="how often the server's "
                                     "/health and /metrics are read")
    health_timeout_s: float = Field(5.0, gt=0, le=60, description="longest wait for one probe")
    unhealthy_after: int = Field(2, ge=1, le=100, description="failed health probes in a row "
                                 "after which the server is deregistered (routers drop it at "
                                 "once); it registers anew once healthy")
    heartbeat_ttl_s: float = Field(10.0, ge=1, le=3600, description="registration TTL; routers "
                                   "drop the server this long after the bridge's last "
                                   "heartbeat (the bridge died)")
    replay_timeout_s: float = Field(5.0, gt=0, le=300, description="longest wait for a replay "
                                    "answer; past it the gap resets the index")
    max_payload_bytes: int = Field(MAX_PAYLOAD_BYTES, ge=1024, le=MAX_PAYLOAD_BYTES,
                                   description="largest event batch accepted; ZMQ drops the "
                                   "connection of a peer that sends a larger frame")
    max_queued_bytes: int = Field(2 * MAX_PAYLOAD_BYTES, ge=1024, le=1 << 30,
                                  description="event batches held between the sockets and "
                                  "decoding, in bytes; past it a batch is dropped (a gap, "
                                  "replayed). At least --max-payload-bytes")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="serve Prometheus "
                                     "metrics on 127.0.0.1 at this port (none: logs only)")

    @model_validator(mode="after")
    def _queue_holds_a_batch(self) -> BridgeSettings:
        if self.max_queued_bytes < self.max_payload_bytes:
            raise ValueError("--max-queued-bytes must be at least --max-payload-bytes")
        return self

    @property
    def public_url(self) -> str:
        return (self.advertise_url or self.vllm_url).rstrip("/")

    @property
    def resolved_worker_id(self) -> str:
        if self.worker_id:
            return self.worker_id
        url = urlsplit(self.public_url)
        return f"vllm-{url.hostname}-{url.port or (443 if url.scheme == 'https' else 80)}"

    def resolve_endpoint(self, endpoint: str) -> str:
        """A vLLM endpoint as the bridge connects to it: the wildcard host vLLM bound (`*`)
        replaced by the vLLM URL's host."""
        if not endpoint.startswith("tcp://"):
            return endpoint
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if host in ("*", "0.0.0.0", "[::]", "::", "[*]") and sep:
            name = urlsplit(self.vllm_url).hostname or "127.0.0.1"
            return f"tcp://{f'[{name}]' if ':' in name else name}:{port}"
        return endpoint
