"""Prometheus metrics of a worker (docs/contract.md "Observability"), on the app's own registry.

Request-level series carry `model` (the worker's first served name). The same figures are also
exported under vLLM's names and label (`vllm:*{model_name}`), so Grafana boards, alerts and
autoscalers written for vLLM work unchanged against Tandem workers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from worker.tier_metrics import TierMetrics

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# vLLM's own buckets for these two (vllm/v1/metrics/loggers.py).
_VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
              7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0)
FINISH_REASONS = ("stop", "length", "abort")


class _WithModel:
    """A labelled metric whose last label, `model`, is fixed: `.labels(endpoint, status)`."""

    def __init__(self, metric, model: str) -> None:
        self.metric, self.model = metric, model

    def labels(self, *values: str):
        return self.metric.labels(*values, self.model)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, role: str, model: str = "") -> None:
        self.role = role
        r, m = registry, ["model"]
        self.requests = _WithModel(Counter("tandem_worker_requests",
                                           "Requests by endpoint and status",
                                           ["endpoint", "status", "model"], registry=r), model)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens received", m,
                                     registry=r).labels(model)
        self.cache_hit_tokens = _WithModel(Counter(
            "tandem_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
            ["pool", "model"], registry=r), model)
        self.generated_tokens = Counter("tandem_generation_tokens", "Tokens generated", m,
                                        registry=r).labels(model)
        self.queue_time = Histogram("tandem_queue_time_seconds", "Arrival to first schedule", m,
                                    buckets=_LATENCY, registry=r).labels(model)
        self.prefill_time = Histogram("tandem_prefill_time_seconds", "Arrival to first token", m,
                                      buckets=_LATENCY, registry=r).labels(model)
        self.pull_fallbacks = _WithModel(Counter(
            "tandem_kv_pull_fallbacks", "Pulls that failed and fell back to local prefill",
            ["reason", "model"], registry=r), model)
        self.pull_failures = _WithModel(Counter(
            "tandem_worker_kv_pull_failures", "Failed KV pulls, by what followed "
            "(--kv-pull-failure-policy: recompute, fail)", ["policy", "model"], registry=r), model)
        self.peer_pulled_tokens = Counter(
            "tandem_worker_peer_pulled_tokens", "Prompt tokens pulled from a peer's cache "
            "instead of computed (worker/peer_pull.py)", m, registry=r).labels(model)
        self.peer_pull_fallbacks = _WithModel(Counter(
            "tandem_worker_peer_pull_fallbacks", "Peer prefix pulls that pulled nothing (the "
            "prompt was computed), by reason", ["reason", "model"], registry=r), model)
        self.prefix_exports = _WithModel(Counter(
            "tandem_worker_prefix_exports", "Peer prefix exports answered, by outcome (leased, "
            "none_held)", ["outcome", "model"], registry=r), model)
        self.shed = Counter("tandem_load_shed", "Requests refused with 503 (queue full)", m,
                            registry=r).labels(model)
        self.running = Gauge("tandem_worker_running_requests", "Running sequences", registry=r)
        self.waiting = Gauge("tandem_worker_waiting_requests", "Waiting sequences", registry=r)
        self.free_blocks = Gauge("tandem_worker_free_blocks", "Free KV blocks", registry=r)
        self.kv_usage = Gauge("tandem_worker_kv_usage", "Fraction of KV blocks in use", registry=r)
        self.pinned_blocks = Gauge("tandem_worker_pinned_blocks", "Blocks pinned for a peer "
                                   "prefix pull: exported, or reserved to pull into",
                                   registry=r)
        self.held_requests = Gauge("tandem_worker_held_requests",
                                   "Prefilled requests holding blocks for export", registry=r)
        self.parked_requests = Gauge("tandem_worker_parked_requests", "Requests out of the batch "
                                     "while their reader is behind (engine/output_stream.py)",
                                     registry=r)
        self.preemptions = Counter("tandem_worker_preemptions", "Sequences taken out of the "
                                   "batch with their blocks freed, to be recomputed (blocks ran "
                                   "short, or another client's turn: engine/fair_share.py)",
                                   registry=r)
        self._num_preemptions = 0
        self.kv_tiers = TierMetrics(r)
        self._vllm(r, model)

    def _vllm(self, r: CollectorRegistry, model: str) -> None:
        n = ["model_name"]
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests in model execution "
                                  "batches", n, registry=r).labels(model)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed",
                                  n, registry=r).labels(model)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100%)", n,
                                   registry=r).labels(model)
        self.vllm_cache_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in "
                                          "tokens", n, registry=r).labels(model)
        self.vllm_cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", n,
                                       registry=r).labels(model)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", n,
                                   buckets=_VLLM_TTFT, registry=r).labels(model)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", n,
                                  buckets=_VLLM_ITL, registry=r).labels(model)
        success = Counter("vllm:request_success", "Finished requests by finish reason",
                          ["model_name", "finished_reason"], registry=r)
        self.vllm_success = {reason: success.labels(model, reason) for reason in FINISH_REASONS}

    def observe_first_token(self, out, pool: str) -> None:
        """Prompt, cache-hit, queue and prefill figures of a request's first output."""
        num_prompt = len(out.prompt_token_ids)
        self.prompt_tokens.inc(num_prompt)
        self.cache_hit_tokens.labels(pool).inc(out.num_cached_tokens)
        self.vllm_cache_queries.inc(num_prompt)
        self.vllm_cache_hits.inc(out.num_cached_tokens)
        if out.first_scheduled_time is not None:
            self.queue_time.observe(out.first_scheduled_time - out.arrival_time)
        if out.first_token_time is not None:
            self.prefill_time.observe(out.first_token_time - out.arrival_time)
            self.vllm_ttft.observe(out.first_token_time - out.arrival_time)

    def observe_tokens(self, num_tokens: int, seconds: float) -> None:
        """`num_tokens` more tokens of a stream, `seconds` after its previous ones."""
        self.generated_tokens.inc(num_tokens)
        for _ in range(min(num_tokens, 64)):
            self.vllm_itl.observe(seconds / num_tokens)

    def observe_finish(self, reason: str | None) -> None:
        counter = self.vllm_success.get(reason or "")
        if counter is not None:
            counter.inc()

    def sample_engine(self, stats: dict[str, int]) -> None:
        """Set the gauges from an engine's `stats()`."""
        usage = 1 - stats["free_blocks"] / stats["num_blocks"]
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.free_blocks.set(stats["free_blocks"])
        self.kv_usage.set(usage)
        self.held_requests.set(stats["held"])
        self.pinned_blocks.set(stats.get("pinned_blocks", 0))
        self.parked_requests.set(stats["parked"])
        num = stats.get("preemptions", 0)
        if num > self._num_preemptions:  # the engine's running total, as a counter
            self.preemptions.inc(num - self._num_preemptions)
            self._num_preemptions = num
        self.kv_tiers.sample(stats.get("kv_tiers"))
        self.vllm_running.set(stats["running"])
        self.vllm_waiting.set(stats["waiting"])
        self.vllm_kv_usage.set(usage)
