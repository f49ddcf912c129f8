"""Router settings, built once at the edge: CLI flags (generated from these fields by
tandem/flags.py) over TANDEM_ROUTER_* environment variables over the defaults here. Each field's
description is its `--help` text and its line in the configuration reference
(docs/configuration.md). The SLOs and the SLO planner's fields are `PlannerSettings`
(router/planner_settings.py), part of these."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from router.planner_settings import PlannerSettings


class RouterSettings(BaseSettings, PlannerSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_ROUTER_", extra="forbid")

    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(8000, description="HTTP port (OpenAI API, /metrics)")
    model: str | None = Field(None, description="serve only this model name; none: every model "
                              "whose workers register in the namespace")
    tokenizer_path: Path | None = Field(None, description="tokenizer folder of --model (default: "
                                        "the folder its workers publish, else "
                                        "{model_dir}/{model}); without --model, tried for any "
                                        "model whose workers' folder is not on this machine")
    model_dir: Path | None = Field(None, description="where tokenizers of models are looked up "
                                   "by name when a worker's own folder is not on this machine "
                                   "(default: {cache_dir}/models)")
    cache_dir: Path = Field(Path.home() / ".cache" / "tandem", description="where prepared "
                            "models live ($TANDEM_CACHE_DIR)")
    chat_template: Path | None = Field(None, description="a chat template file that replaces "
                                       "the models' own (e.g. templates/chatml_tools.jinja "
                                       "for tool calling with SmolLM2)")
    tool_call_parser: str = Field("hermes", description="how tool calls are read from a model's "
                                  "text with tool_choice auto: a name in common/tool_calls.py's "
                                  "PARSERS (hermes)")
    block_size: int = Field(16, description="tokens per KV block of static workers that do not "
                            "report theirs (registered workers publish their own)")
    hash_salt: str | None = Field(None, description="salt of the block hashes (cache isolation); "
                                  "must match the workers'")
    redis_url: str | None = Field(None, description="Redis with the worker registry and the "
                                  "prefix index; none: static workers and an in-process index")
    redis_cluster: bool = Field(False, description="--redis-url names one node of a Redis "
                                "Cluster (common/redis_client.py)")
    namespace: str = Field("default", description="Redis key namespace shared with the workers")
    workers: list[str] = Field([], description="static worker [backend:]role=url[,model=NAME], "
                               "repeatable: decode=http://127.0.0.1:8300 (a Tandem worker) or "
                               "vllm:prefill=http://127.0.0.1:8100 (vLLM with the NixlConnector); "
                               "without model=, --model or what the worker reports")
    internal_token: str | None = Field(None, description="bearer token of the workers' internal "
                                       "API ($TANDEM_INTERNAL_TOKEN)")
    vllm_api_key: str | None = Field(None, description="the --api-key of vLLM backends, if they "
                                     "have one")
    speculative_ttl_s: float = Field(2.0, ge=0, le=60, description="how long a block this router "
                                     "sent to a bridged vLLM worker counts as held before the "
                                     "worker's own report arrives (router/speculative.py); 0: off")
    vllm_report_full_prefix: bool = Field(False, description="ask vLLM workers to re-report a "
                                          "request's whole cached prefix in their KV events "
                                          "(vllm_xargs kv_cache_report_mode=full), so a bridge "
                                          "that lost history heals on the next hit")
    api_keys: list[str] = Field([], description="accepted client API key, repeatable; none: no "
                                "authentication")
    api_keys_file: Path | None = Field(None, description="file with one client API key per line")
    rate_limit_rpm: int | None = Field(None, description="requests per minute per key, shared "
                                       "through Redis")
    rate_limit_tpm: int | None = Field(None, description="tokens (prompt + max_tokens) per "
                                       "minute per key")
    policy: str = Field("kv_aware", description="routing policy: a name in router/policy.py's "
                        "POLICIES (kv_aware, round_robin, least_loaded, random)")
    policy_seed: int | None = Field(None, description="seeds the random policy (reproducible "
                                    "runs, the simulator)")
    index: Literal["replica", "redis"] = Field("replica", description="prefix index backend "
                                               "(router/index.py INDEXES): replica, a copy in "
                                               "the router fed by the workers' event streams; "
                                               "redis, one Lua lookup per request")
    index_search: str = Field("gallop", description="leading-match search: gallop or exact "
                              "(router/index.py)")
    index_poll_interval_s: float = Field(0.02, gt=0, le=10, description="how often the replica "
                                         "index reads the workers' block events")
    refresh_interval_s: float = Field(0.5, description="how often the worker directory is read "
                                      "from Redis")
    redis_restart_grace_s: float = Field(5.0, description="keep known workers this long after "
                                         "Redis lost its data")
    probe_interval_s: float = Field(2.0, description="health checks of every worker")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM/SIGINT: how long "
                                   "in-flight requests may take to finish after the router stops "
                                   "listening; a stream still open then ends with an error event")
    request_timeout_s: float = Field(300.0, description="longest a request may take end to end")
    stream_write_timeout_s: float = Field(30.0, gt=0, description="a streaming client that "
                                          "accepts no data for this long is cut (its slot and "
                                          "worker streams are freed)")
    send_buffer_bytes: int | None = Field(256 << 10, ge=1, description="kernel send "
                                          "buffer of each client connection: how much of a "
                                          "stream a client that reads nothing absorbs before "
                                          "the write deadline starts (none: the kernel's "
                                          "autotuning, MBs)")
    header_timeout_s: float = Field(10.0, gt=0, description="a connection must send a "
                                    "request's complete headers within this")
    body_timeout_s: float = Field(30.0, gt=0, description="... and its complete body within "
                                  "this")
    # Past these a worker counts as failed (router/backends.py Timeouts): a prefill is retried
    # elsewhere or done locally, a decode stream resumes on another worker.
    prefill_timeout_s: float = Field(60.0, description="longest prefill leg before it is retried "
                                     "elsewhere (and aborted on its worker), plus the time its "
                                     "uncached tokens, and those queued ahead of it there, take "
                                     "at --prefill-timeout-min-tokens-per-s")
    stream_stall_timeout_s: float = Field(30.0, description="longest silence inside a decode "
                                          "stream before it resumes elsewhere; before its first "
                                          "event, plus the time a local prefill of the prompt "
                                          "takes at --prefill-timeout-min-tokens-per-s")
    prefill_timeout_min_tokens_per_s: float = Field(50.0, gt=0, description="the slowest "
                                                    "prefill rate a healthy worker is allowed "
                                                    "(SmolLM2 prefills 8k tokens at ~160/s on 2 "
                                                    "idle CPU cores, ~3x slower on busy ones)")
    max_prefill_retries: int = Field(2, description="prefill attempts on other workers after a "
                                     "failure")
    retry_backoff_s: float = Field(0.05, description="pause before a retry")
    kv_full_waits: int = Field(3, ge=0, description="when every decode worker refused a prompt's "
                               "KV import for a full cache (503 out_of_kv_blocks): how many "
                               "times to wait their Retry-After (at most 5 s) and try again "
                               "before the client gets that 503")
    breaker_failures: int = Field(3, description="consecutive failures that open a worker's "
                                  "circuit breaker")
    breaker_cooldown_s: float = Field(5.0, description="how long an open breaker keeps a worker "
                                      "out")
    max_tokens_default: int = Field(256, description="max_tokens of requests that give none")
    max_running: int = Field(512, description="requests in flight before new ones queue")
    max_queued: int = Field(2048, description="queued requests beyond which: 503 + Retry-After")
    # Per client (its API key, else its address; router/clients.py). Off by default: behind a
    # proxy every client has the proxy's address.
    client_max_requests: int | None = Field(None, ge=1, description="requests of one client "
                                            "(API key, else address) worked on at once; more "
                                            "wait their turn (none: no limit)")
    client_max_waiting: int = Field(64, ge=0, description="requests of one client waiting "
                                    "their turn beyond which: 429")
    client_requests_per_s: float | None = Field(None, gt=0, description="requests per second "
                                                "of one client beyond a burst: more wait "
                                                "their turn, and past twice the burst: 429 "
                                                "(none: no limit)")
    client_burst: int = Field(20, ge=1, description="requests of one client that go at once "
                              "before --client-requests-per-s paces them")
    client_max_running: int | None = Field(None, ge=1, description="choices of one client "
                                           "running on the workers at once; more queue (none: "
                                           "no limit; the queue is fair between clients either "
                                           "way)")
    # kv_aware cost model (seconds); every weight and threshold is a setting.
    default_prefill_tokens_per_s: float = Field(1000.0, description="prefill rate assumed until "
                                                "a worker's has been measured")
    default_transfer_bytes_per_s: float = Field(2e9, description="KV transfer rate assumed until "
                                                "decode workers' pulls have measured it")
    # A tier hit is priced at the worker's measured reload rate (its load's
    # `reload_tokens_per_s`); until it has measured one, at this multiple of its prefill rate.
    host_reload_vs_prefill: float = Field(20.0, gt=0, description="reload rate from a worker's "
                                          "host-memory KV tier assumed until it reports one, as "
                                          "a multiple of its prefill rate")
    disk_reload_vs_prefill: float = Field(4.0, gt=0, description="reload rate from a worker's "
                                          "disk KV tier assumed until it reports one, as a "
                                          "multiple of its prefill rate")
    bytes_per_block: int = Field(368_640, description="KV bytes per block of workers that do "
                                 "not publish theirs")
    transfer_weight: float = Field(1.0, description="weight of the predicted transfer time")
    transfer_fixed_s: float = Field(0.005, description="fixed cost of the second leg: HTTP call, "
                                    "handshake, notification")
    # Peer pulls are priced per (source, destination) locality pair (router/fabric.py): the
    # pair's measured rate, else its link class's seed here, else the destination's measured
    # transfer rate (or --default-transfer-bytes-per-s).
    link_same_node_bytes_per_s: float | None = Field(
        None, gt=0, description="KV pull rate assumed between workers of one locality (one node: "
        "NVLink, shared memory) until measured; none: as any transfer")
    link_same_rack_bytes_per_s: float | None = Field(
        None, gt=0, description="KV pull rate assumed between localities that differ in their "
        "last level only (one rack: RDMA) until measured; none: as any transfer")
    link_same_zone_bytes_per_s: float | None = Field(
        None, gt=0, description="KV pull rate assumed between localities that differ in their "
        "last two levels (one zone, across racks) until measured; none: as any transfer")
    link_cross_zone_bytes_per_s: float | None = Field(
        None, gt=0, description="KV pull rate assumed between localities that share less "
        "(across zones: TCP) until measured; none: as any transfer")
    max_body_bytes: int = Field(4 << 20, description="largest request body")
    cache_salt_per_key: bool = Field(True, description="salt each API key's KV blocks apart "
                                     "(with --api-key): a key's prompts never hit another key's "
                                     "cache, so no key learns by timing or cached_tokens what "
                                     "another sent; off: keys share the cache")
    forwarded_allow_ips: list[str] = Field([], description="addresses or CIDRs of the reverse "
                                           "proxies whose X-Forwarded-For names the client, "
                                           "repeatable (the per-client limits, fair sharing and "
                                           "per-key cache count by it); none: the connection's "
                                           "own address, whatever the header says")
    expose_worker_ids: bool = Field(False, description="name the prefill and decode workers "
                                    "(their ids carry host and port) in each response's "
                                    "`tandem` field; off: they are left out")
    ready_roles: list[Literal["prefill", "decode", "colocated"]] = Field(
        [], description="roles /ready also waits for, repeatable (e.g. prefill: not ready "
        "while every request would be prefilled on a decode worker); a worker that decodes is "
        "always needed")
    instance_nonce: str | None = Field(None, max_length=128, description="echoed in /ready's "
                                       "X-Tandem-Instance header, so whoever started this router "
                                       "(tandem up) knows the one answering is its own")
    offload_chars: int = Field(16 << 10, description="request bodies larger than this many "
                               "bytes are rendered and tokenized off the event loop")
    max_model_len_default: int = Field(8192, description="context limit while no worker has "
                                       "published its own")
    local_prefill_interference: float = Field(0.05, description="extra cost per running decode "
                                              "on the decode worker of a local prefill")
    # Conditional disaggregation: a decode worker prefills locally only when it already holds
    # most of the prompt and what is left is short (else prefill belongs on the prefill pool).
    conditional_disagg: bool = Field(True, description="let a decode worker prefill locally when "
                                     "that is predicted faster; off: every request with a "
                                     "prefill pool goes disagg")
    local_prefill_max_uncached_tokens: int = Field(256, description="local prefill only below "
                                                   "this many uncached tokens ...")
    local_prefill_min_cached_fraction: float = Field(0.5, description="... and with at least this "
                                                     "share of the prompt cached there")
    # ... or any prompt, while the prefill pool is backed up (its shortest queue holds at least
    # the prompt's own uncached tokens), priced with the stall it costs D's running streams.
    local_prefill_when_backed_up: bool = Field(True, description="also prefill locally while the "
                                               "prefill pool is backed up, when predicted faster")
    local_prefill_stall_weight: float = Field(1.0, description="weight of the stall a local "
                                              "prefill costs the decode worker's running streams")
    decode_growth_tokens: int = Field(256, ge=0, description="kv_aware charges a placement "
                                      "whose decode worker's step with one more stream is "
                                      "predicted past --slo-itl (on the decode step line the "
                                      "SLO planner fits; --planner-decode-step-* until then) "
                                      "the excess times this many tokens: the time the "
                                      "answer's decode runs over the SLO; 0: a decode worker's "
                                      "batch is not priced")
    near_tie_s: float = Field(0.002, description="plans predicted within this of the best count "
                              "as ties (broken by load, then by cache headroom)")
    # Placement under cache pressure (router/eviction_cost.py): a plan is also charged for the
    # prefix-cache blocks it pushes out where it lands.
    eviction_weight: float = Field(0.5, ge=0, description="cost of each cached block a placement "
                                   "evicts, as a share of recomputing it on that worker (the "
                                   "chance it would be hit again); 0: placement ignores how full "
                                   "each cache is")
    placement_memory_s: float = Field(10.0, ge=0, le=60, description="the blocks this router "
                                      "sent to a worker count against the cache headroom it "
                                      "reported until a newer report shows them (reports come "
                                      "a heartbeat apart, a third of its --heartbeat-ttl), for "
                                      "at most this long; 0: not counted")
    peer_pulls: bool = Field(True, description="let the worker that computes a prompt pull the "
                             "leading blocks another worker holds (any role, any KV tier) when "
                             "that is predicted faster than recomputing them (kv_aware), and "
                             "the worker that resumes a stream a drained worker handed off pull "
                             "its blocks from it")
    peer_pull_export_timeout_s: float = Field(
        10.0, gt=0, le=300, description="how long the router waits for a holder to pin and lease "
        "a prefix for a peer pull before computing the prompt instead (it answers in the middle "
        "of an engine step; a reload from its disk tier or a busy event loop can slow it)")
    @property
    def model_folder_root(self) -> Path:
        return self.model_dir or self.cache_dir / "models"
