"""Prometheus metrics of a worker (DESIGN.md "Observability"), on the app's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.role = role
        self.requests = Counter("tandem_worker_requests", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens received",
                                     registry=registry)
        self.cache_hit_tokens = Counter("tandem_prefix_cache_hit_tokens",
                                        "Prompt tokens served from the prefix cache", ["pool"],
                                        registry=registry)
        self.generated_tokens = Counter("tandem_generation_tokens", "Tokens generated",
                                        registry=registry)
        self.queue_time = Histogram("tandem_queue_time_seconds", "Arrival to first schedule",
                                    buckets=_LATENCY, registry=registry)
        self.prefill_time = Histogram("tandem_prefill_time_seconds", "Arrival to first token",
                                      buckets=_LATENCY, registry=registry)
        self.pull_fallbacks = Counter("tandem_kv_pull_fallbacks",
                                      "Pulls that failed and fell back to local prefill",
                                      ["reason"], registry=registry)
        self.shed = Counter("tandem_load_shed", "Requests refused with 503 (queue full)",
                            registry=registry)
        self.running = Gauge("tandem_worker_running_requests", "Running sequences", registry=registry)
        self.waiting = Gauge("tandem_worker_waiting_requests", "Waiting sequences", registry=registry)
        self.free_blocks = Gauge("tandem_worker_free_blocks", "Free KV blocks", registry=registry)
        self.kv_usage = Gauge("tandem_worker_kv_usage", "Fraction of KV blocks in use",
                              registry=registry)
        self.held_requests = Gauge("tandem_worker_held_requests",
                                   "Prefilled requests holding blocks for export", registry=registry)

    def observe_first_token(self, out, pool: str) -> None:
        """Prompt, cache-hit, queue and prefill figures of a request's first output."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.cache_hit_tokens.labels(pool).inc(out.num_cached_tokens)
        if out.first_scheduled_time is not None:
            self.queue_time.observe(out.first_scheduled_time - out.arrival_time)
        if out.first_token_time is not None:
            self.prefill_time.observe(out.first_token_time - out.arrival_time)

    def sample_engine(self, stats: dict[str, int]) -> None:
        """Set the gauges from an engine's `stats()`."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.free_blocks.set(stats["free_blocks"])
        self.kv_usage.set(1 - stats["free_blocks"] / stats["num_blocks"])
        self.held_requests.set(stats["held"])
