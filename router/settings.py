"""Router settings, built once at the edge (CLI flags over TANDEM_ROUTER_* variables)."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_ROUTER_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "smollm2-135m-instruct"  # served model name; also the tokenizer folder's name
    tokenizer_path: Path | None = None  # default: {cache_dir}/models/{model}
    cache_dir: Path = Path.home() / ".cache" / "tandem"
    block_size: int = 16
    hash_salt: str | None = None
    redis_url: str | None = None
    namespace: str = "default"
    workers: list[str] = []  # static [backend:]role=url: prefill=http://h:8200, vllm:decode=http://h:8100
    internal_token: str | None = None
    vllm_api_key: str | None = None  # the --api-key of vLLM backends, if they have one
    api_keys: list[str] = []  # client API keys; empty = no authentication
    api_keys_file: Path | None = None  # one key per line
    rate_limit_rpm: int | None = None  # per key, shared through Redis
    rate_limit_tpm: int | None = None  # prompt + max_tokens, per key
    policy: str = "kv_aware"
    policy_seed: int | None = None  # seeds the random policy (reproducible runs, the simulator)
    index_search: str = "gallop"  # or "exact" (linear, stops at the first miss); see router/index.py
    refresh_interval_s: float = 0.5
    redis_restart_grace_s: float = 5.0  # keep known workers this long after Redis lost its data
    probe_interval_s: float = 2.0  # health checks of statically listed workers
    request_timeout_s: float = 300.0
    # Past these a worker counts as failed (router/backends.py Timeouts): a prefill is retried
    # elsewhere or done locally, a decode stream resumes on another worker.
    prefill_timeout_s: float = 60.0
    stream_stall_timeout_s: float = 30.0  # longest silence inside a decode stream
    max_prefill_retries: int = 2
    retry_backoff_s: float = 0.05
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    max_tokens_default: int = 256
    max_running: int = 512  # requests in flight before new ones queue
    max_queued: int = 2048  # beyond this: 503 + Retry-After
    # kv_aware cost model (seconds); every weight and threshold is a setting.
    default_prefill_tokens_per_s: float = 1000.0
    default_transfer_bytes_per_s: float = 2e9  # until decode workers' pulls have measured it
    bytes_per_block: int = 368_640  # for workers that do not publish theirs
    transfer_weight: float = 1.0
    transfer_fixed_s: float = 0.005  # second leg: HTTP call, handshake, notification
    max_body_bytes: int = 4 << 20
    offload_chars: int = 16 << 10  # texts longer than this are tokenized off the event loop
    max_model_len_default: int = 8192
    local_prefill_interference: float = 0.05  # extra cost per running decode on the D worker
    # Conditional disaggregation: a decode worker prefills locally only when it already holds
    # most of the prompt and what is left is short (else prefill belongs on the prefill pool).
    conditional_disagg: bool = True  # off: every request with a prefill pool goes disagg
    local_prefill_max_uncached_tokens: int = 256
    local_prefill_min_cached_fraction: float = 0.5
    # ... or any prompt, while the prefill pool is backed up (its shortest queue holds at least
    # the prompt's own uncached tokens), priced with the stall it costs D's running streams.
    local_prefill_when_backed_up: bool = True
    local_prefill_stall_weight: float = 1.0
    near_tie_s: float = 0.002

    @property
    def tokenizer_folder(self) -> Path:
        return self.tokenizer_path or self.cache_dir / "models" / self.model
