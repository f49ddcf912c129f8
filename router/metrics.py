"""Prometheus metrics of the router (docs/contract.md "Observability")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.block_events import MEDIA

if TYPE_CHECKING:
    from router.plan import Plan
    from router.planner import Decision
    from router.planner_inputs import Measurements

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


# Every status the router answers with; the series exist from the start so rate() sees the first.
STATUSES = ("200", "400", "401", "404", "413", "429", "500", "503")
# The `model` label of a request whose model is not (yet) known: a body that failed to parse, an
# unknown name (never the name itself: clients must not be able to mint label values).
NO_MODEL = ""


class RouterMetrics:
    """Request-level series carry `model`, the served name (router/models.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        m = ["model"]
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LAT, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between tokens", m,
                             buckets=_FAST + _LAT[4:], registry=r)
        self.latency = Histogram("tandem_request_latency_seconds", "Request latency", m,
                                 buckets=_LAT, registry=r)
        self.overhead = Histogram("tandem_router_overhead_seconds",
                                  "Router work before the first worker call", m,
                                  buckets=_FAST, registry=r)
        self.prefill = Histogram("tandem_prefill_time_seconds",
                                 "Prefill leg as seen by the router", m, buckets=_LAT, registry=r)
        self.requests = Counter("tandem_requests", "Requests by status",
                                ["status", "model"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens routed", m, registry=r)
        self.completion_tokens = Counter("tandem_completion_tokens", "Tokens returned",
                                         m, registry=r)
        self.hit_tokens = Counter("tandem_prefix_cache_hit_tokens",
                                  "Prompt tokens served from cache", ["pool", "model"], registry=r)
        self.route = Counter("tandem_route_decisions", "Plans chosen",
                             ["plan", "model"], registry=r)
        self.cached_tokens = Counter("tandem_router_cached_tokens",
                                     "Prompt tokens routed to a worker that holds them, by the "
                                     "KV tier it holds them in (as planned)",
                                     ["medium", "model"], registry=r)
        self.retries = Counter("tandem_retries", "Retries and resumes",
                               ["kind", "model"], registry=r)
        self.models = Gauge("tandem_served_models", "Models with a live worker", registry=r)
        self._known: set[str] = set()
        self.add_model(NO_MODEL)
        self.redis_up = Gauge("tandem_redis_up", "1 when the prefix index answers", registry=r)
        self.inflight = Gauge("tandem_router_inflight_requests",
                              "Requests running or queued in this router",
                              registry=r)  # the HPA's scaling signal (charts/tandem)
        self.workers = Gauge("tandem_live_workers", "Live workers by role", ["role"], registry=r)
        self.planner = PlannerGauges(r)

    def add_model(self, model: str) -> None:
        """Create a model's series at zero, so rate() sees its first requests and hits."""
        if model in self._known:
            return
        self._known.add(model)
        for status in STATUSES:
            self.requests.labels(status, model)
        if model != NO_MODEL:
            for pool in ("prefill", "decode"):
                self.hit_tokens.labels(pool, model)
            for kind in ("prefill", "resume"):  # the retries the dispatcher counts
                self.retries.labels(kind, model)
            for medium in MEDIA:
                self.cached_tokens.labels(medium, model)

    def count_cached(self, plan: Plan, model: str) -> None:
        """The prompt tokens `plan` counts on as cached on its prefilling worker, by tier."""
        worker = plan.prefill or plan.decode
        media = plan.cached_media
        counts = ((("device", plan.cached_blocks),) if media is None else
                  (("device", media.device), ("host", media.host), ("disk", media.disk)))
        for medium, n in counts:
            if n:
                self.cached_tokens.labels(medium, model).inc(n * worker.block_size)

    def count(self, status: int, model: str) -> None:
        self.requests.labels(str(status), model if model in self._known else NO_MODEL).inc()


class PlannerGauges:
    """The SLO planner's decision per model and pool, and what it was made from
    (router/planner_loop.py): what a Kubernetes autoscaler follows (charts/tandem)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, m = registry, ["model"]
        self.desired = Gauge("tandem_planner_desired_replicas", "Replicas the SLO planner "
                             "wants per pool (damped, bounded)", ["model", "pool"], registry=r)
        self.needed = Gauge("tandem_planner_needed_replicas", "Replicas the forecast load "
                            "needs per pool (before damping and bounds)", ["model", "pool"],
                            registry=r)
        self.tokens = Gauge("tandem_planner_tokens_per_second", "Uncached prompt and output "
                            "tokens per second, measured and forecast (with headroom)",
                            ["model", "kind", "basis"], registry=r)
        self.streams = Gauge("tandem_planner_streams_decoding", "Streams running on the decode "
                             "workers", m, registry=r)
        self.queued = Gauge("tandem_planner_prefill_queued_tokens", "Uncached prompt tokens "
                            "queued on the prefill workers", m, registry=r)
        self.prefill_rate = Gauge("tandem_planner_prefill_worker_tokens_per_second",
                                  "One prefill worker's rate, as the planner uses it", m,
                                  registry=r)
        self.step = Gauge("tandem_planner_decode_step_seconds", "The decode step time's fitted "
                          "line: base and per running sequence", ["model", "term"], registry=r)

    def export(self, model: str, m: Measurements, d: Decision) -> None:
        for pool in ("prefill", "decode"):
            self.desired.labels(model, pool).set(d.pool(pool).desired)
            self.needed.labels(model, pool).set(d.pool(pool).needed)
        for kind, measured, forecast in (
                ("uncached_prompt", m.uncached_prompt_tokens_per_s,
                 d.uncached_prompt_tokens_per_s),
                ("output", m.output_tokens_per_s, d.output_tokens_per_s)):
            self.tokens.labels(model, kind, "measured").set(measured)
            self.tokens.labels(model, kind, "forecast").set(forecast)
        self.streams.labels(model).set(m.streams_decoding)
        self.queued.labels(model).set(m.prefill_queued_tokens)
        self.prefill_rate.labels(model).set(d.prefill_tokens_per_s)
        for term, value in zip(("base", "per_sequence"), d.decode_step, strict=True):
            self.step.labels(model, term).set(value)
