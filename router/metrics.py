"""Prometheus metrics of the router (DESIGN.md "Observability")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token", buckets=_LAT, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between tokens", buckets=_FAST + _LAT[4:], registry=r)
        self.latency = Histogram("tandem_request_latency_seconds", "Request latency", buckets=_LAT, registry=r)
        self.overhead = Histogram("tandem_router_overhead_seconds", "Router work before the first worker call",
                                  buckets=_FAST, registry=r)
        self.prefill = Histogram("tandem_prefill_time_seconds", "Prefill leg as seen by the router",
                                 buckets=_LAT, registry=r)
        self.requests = Counter("tandem_requests", "Requests by status", ["status"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens routed", registry=r)
        self.completion_tokens = Counter("tandem_completion_tokens", "Tokens returned", registry=r)
        self.hit_tokens = Counter("tandem_prefix_cache_hit_tokens", "Prompt tokens served from cache",
                                  ["pool"], registry=r)
        self.route = Counter("tandem_route_decisions", "Plans chosen", ["plan"], registry=r)
        self.retries = Counter("tandem_retries", "Retries and resumes", ["kind"], registry=r)
        self.redis_up = Gauge("tandem_redis_up", "1 when the prefix index answers", registry=r)
        self.inflight = Gauge("tandem_router_inflight_requests", "Requests running or queued in this router",
                              registry=r)  # the HPA's scaling signal (charts/tandem)
        for pool in ("prefill", "decode"):  # series exist from the start, so rate() sees the first hits
            self.hit_tokens.labels(pool)
        self.workers = Gauge("tandem_live_workers", "Live workers by role", ["role"], registry=r)
