"""Worker settings, built once at the edge: CLI flags (generated from these fields by
tandem/flags.py) over TANDEM_* environment variables over the defaults here. Each field's
description is its `--help` text and its line in the configuration reference
(docs/configuration.md)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.block_events import WORKER_ID_PATTERN
from common.locality import LOCALITY_PATTERN, MAX_LOCALITY_CHARS
from common.model_identity import check_name

Role = Literal["prefill", "decode", "colocated"]


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    role: Role = Field("colocated", description="which phase this worker serves (the subcommand)")
    model: str = Field("smollm2-135m-instruct", description="model name (smollm2-135m-instruct, "
                       "tiny-random) or a Hugging Face folder")
    model_id: str | None = Field(None, description="the engine's name for the model in logs "
                                 "(default: the model folder's name)")
    served_model_name: list[str] = Field([], description="name(s) clients use in `model`, "
                                         "repeatable or several after one flag, as in vllm serve "
                                         "(default: the model id)")
    hash_salt: str | None = Field(None, description="salt of the block hashes (cache isolation); "
                                  "must match the router's")
    cache_dir: Path | None = Field(None, description="where prepared models live "
                                   "(default $TANDEM_CACHE_DIR or ~/.cache/tandem)")
    host: str = Field("127.0.0.1", description="listen address; beyond loopback only with an "
                      "internal token (or --insecure)")
    port: int = Field(8100, description="HTTP port (internal API, OpenAI endpoints, /metrics)")
    advertise_host: str | None = Field(None, description="address peers and the router use to "
                                       "reach this worker (default: --host)")
    locality: str = Field("", max_length=MAX_LOCALITY_CHARS, pattern=LOCALITY_PATTERN,
                          description="where this worker runs, outermost first, e.g. "
                          "zone-a/rack-3/node-7 (the chart: the zone and the node from the "
                          "downward API); the router prices KV pulls between localities")
    redis_cluster: bool = Field(False, description="--redis-url names one node of a Redis "
                                "Cluster (common/redis_client.py)")
    worker_id: str | None = Field(None, pattern=WORKER_ID_PATTERN, description="id in Redis "
                                  "and metrics (default: role-host-port)")
    redis_url: str | None = Field(None, description="Redis for registration and block events, "
                                  "e.g. redis://127.0.0.1:6379/0; none: static workers only")
    namespace: str = Field("default", description="Redis key namespace shared with the router")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM/SIGINT: how long in-flight "
                                   "requests may take to finish after deregistering; the router "
                                   "resumes what is left on another worker")
    drain_handoff: bool = Field(True, description="on SIGTERM/SIGINT, hand the streams "
                                "running here to other workers at once: each ends with a "
                                "hand-off event, and its KV stays here, leased to whichever "
                                "worker the router resumes it on, until --drain-timeout-s; off: "
                                "streams run to their end within --drain-timeout-s")
    heartbeat_ttl_s: float = Field(10.0, description="registration TTL; the router drops a worker "
                                   "this long after its last heartbeat")
    internal_token: str | None = Field(None, description="bearer token of the internal API and "
                                       "key for signing KV handles ($TANDEM_INTERNAL_TOKEN)")
    # Without a token the internal API is open and KV handles unsigned: allowed on loopback
    # (development), refused on any other address unless the operator says --insecure.
    insecure: bool = Field(False, description="allow listening beyond loopback without an "
                           "internal token, and accept unsigned KV handles (never in production)")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:N")
    dtype: str | None = Field(None, description="float32 (CPU default) or bfloat16 (CUDA default)")
    num_blocks: int | None = Field(None, description="KV cache blocks (overrides --kv-memory-gb)")
    kv_memory_gb: float = Field(1.0, description="KV cache size in GiB")
    block_size: int = Field(16, description="tokens per KV block (a power of two; the router's "
                            "must match)")
    threads: int | None = Field(None, description="torch CPU threads (default: torch's)")
    pack_weights: bool = Field(True, description="oneDNN-prepacked matmul weights on CPU float32 "
                               "(engine/linear.py)")
    cpu_ops: bool = Field(True, description="fused C++ layer ops on CPU float32, built once "
                          "into ~/.cache/tandem/cpu_ops with the machine's compiler; without "
                          "one, torch's ops (engine/cpu_ops.py)")
    enforce_eager: bool = Field(False, description="no CUDA graphs: every engine step runs "
                                "eagerly (as vLLM's flag); on CPU graphs are never used")
    # HTTP and streaming never wait on the engine for the GIL. Unset: on for colocated CPU
    # workers, off for prefill and decode ones (measured slower at 1000-token contexts with one
    # thread each, docs/architecture.md); a CUDA worker always steps on a thread.
    engine_process: bool | None = Field(None, description="step the engine in its own process "
                                        "beside the API process (CPU only), or on a thread of it; "
                                        "default: a process for colocated, a thread for prefill "
                                        "and decode")
    max_num_seqs: int = Field(64, description="sequences in one batch")
    max_num_batched_tokens: int = Field(2048, description="tokens in one engine step (decodes "
                                        "plus prefill chunks)")
    long_prefill_token_threshold: int = Field(512, ge=0, description="prompts longer than this "
                                              "are prefilled one at a time, so the first is "
                                              "answered before the next starts "
                                              "(engine/scheduler.py); 0: no limit")
    max_model_len: int | None = Field(None, description="longest prompt + output "
                                      "(default: the model's)")
    transport: Literal["nixl", "tcp"] | None = Field(None, description="KV transfer (default: "
                                                     "nixl where it imports, else tcp)")
    transport_port: int = Field(0, description="fixed KV transfer listen port (tcp transport; "
                                "0 = any), for firewalls")
    lease_seconds: float = Field(30.0, description="how long exported blocks stay pinned "
                                 "waiting for the decode side's pull")
    max_lease_seconds: float = Field(120.0, description="the longest a /prefill caller may pin "
                                     "exported blocks for")
    handshake_timeout_s: float = Field(5.0, description="KV metadata handshake with a peer, "
                                       "start to end; on the tcp data port, a connection's "
                                       "preamble and request header")
    pull_timeout_s: float = Field(10.0, description="one KV pull; past it the pull has failed "
                                  "(see --kv-pull-failure-policy)")
    kv_pull_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="what a decode worker does when its KV pull fails (the "
        "prefill worker died or stalled mid-transfer): `recompute` prefills the prompt locally; "
        "`fail` ends the request (the router answers 503 `kv_transfer_failed`, which the client "
        "may retry, and tries no other decode worker); either frees what the pull held")
    max_unread_tokens: int = Field(64, ge=0, description="a generation whose reader (the "
                                   "router's stream, an OpenAI client) has left this many tokens "
                                   "unread is parked: out of the batch, costing the others no "
                                   "compute, its KV blocks kept until blocks run short, resumed "
                                   "when the reader has caught up to half of this; 0: never parked")
    parked_timeout_s: float = Field(30.0, gt=0, description="a generation parked this long is "
                                    "aborted and its blocks freed (as the router's "
                                    "--stream-write-timeout-s cuts a client that reads nothing)")
    send_buffer_bytes: int | None = Field(16 << 10, ge=1, description="kernel send buffer of each "
                                          "connection: how much of a stream a reader that reads "
                                          "nothing absorbs before the worker's writes wait and "
                                          "its unread tokens count (none: the kernel's "
                                          "autotuning, MBs)")
    scheduling_policy: Literal["fair", "fcfs"] = Field("fair", description="how the batch is "
                                                       "shared: `fair` between the clients the "
                                                       "router names (engine/fair_share.py), "
                                                       "`fcfs` first come, first served")
    host_kv_gb: float = Field(0.0, ge=0, description="host-memory KV tier in GiB: blocks evicted "
                              "from the device cache are kept there and reloaded on a later "
                              "prefix hit (engine/kv_tiers.py); 0: off")
    disk_kv_dir: Path | None = Field(None, description="folder of the disk KV tier: blocks leaving "
                                     "the host tier are written there, and a restart on the same "
                                     "folder serves them again; one folder per worker")
    disk_kv_gb: float = Field(10.0, gt=0, description="the disk KV tier's budget in GiB (with "
                              "--disk-kv-dir)")
    decode_kv_mirror_gb: float = Field(0.5, ge=0, description="memory for the decode rows' KV "
                                       "kept contiguous between steps on the SDPA (CPU) path, "
                                       "instead of gathered from the blocks in every layer of "
                                       "every step (engine/decode_kv_mirror.py); 0: off")
    max_queue: int = Field(256, description="prefills waiting beyond this get 503 + Retry-After")
    max_body_bytes: int = Field(64 << 20, description="largest request body (internal requests "
                                "carry token ids: 1M tokens is ~8 MB)")
    fault_injection: bool = Field(False, description="test builds only: POST /debug/engine-fault "
                                  "makes the engine fail (needs the internal token)")

    def engine_config(self):
        """The engine's configuration (engine/config.py) from these settings."""
        from engine.config import EngineConfig

        return EngineConfig(
            model=self.model, model_id=self.model_id, cache_dir=self.cache_dir, device=self.device,
            dtype=self.dtype, block_size=self.block_size, num_blocks=self.num_blocks,
            kv_memory_bytes=int(self.kv_memory_gb * (1 << 30)), max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold or None,
            num_threads=self.threads, pack_weights=self.pack_weights, cpu_ops=self.cpu_ops,
            hash_salt=self.hash_salt,
            enforce_eager=self.enforce_eager, max_unread_tokens=self.max_unread_tokens or None,
            parked_timeout_s=self.parked_timeout_s, scheduling_policy=self.scheduling_policy,
            host_kv_bytes=int(self.host_kv_gb * (1 << 30)),
            disk_kv_dir=str(self.disk_kv_dir) if self.disk_kv_dir is not None else None,
            disk_kv_bytes=int(self.disk_kv_gb * (1 << 30)),
            decode_kv_mirror_bytes=int(self.decode_kv_mirror_gb * (1 << 30)),
        )

    @property
    def use_engine_process(self) -> bool:
        if not self.device.startswith("cpu"):
            return False
        return self.role == "colocated" if self.engine_process is None else self.engine_process

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def url(self) -> str:
        return f"http://{self.public_host}:{self.port}"

    @property
    def on_loopback(self) -> bool:
        return (is_loopback(self.host)
                and (self.advertise_host is None or is_loopback(self.advertise_host)))

    @field_validator("served_model_name")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        return list(dict.fromkeys(check_name(n) for n in names))

    @property
    def served_names(self) -> list[str]:
        """The names this worker answers to: those given, or the model id (the engine names its
        model after the folder, which is named after `--model`)."""
        return (self.served_model_name
                or [check_name(self.model_id or Path(self.model).expanduser().name)])

    def security_problem(self) -> str | None:
        """Why this configuration must not start, or None."""
        if self.internal_token or self.insecure or self.on_loopback:
            return None
        return (f"refusing to listen on {self.host} without an internal token: anyone who can "
                "reach this port could drive the engine and read its KV cache. Set "
                "--internal-token (or TANDEM_INTERNAL_TOKEN), "
                "or pass --insecure to run open anyway.")

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
