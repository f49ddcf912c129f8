"""The SLO planner in the router: each second the decode workers' batches are sampled; every
`--planner-interval-s`, for each served model, what this router measured goes to that model's
`Planner` (router/planner.py), and its decision and the inputs behind it to /metrics
(`tandem_planner_*`, docs/contract.md "Observability").

What it measures, all of it already tracked: the prompt tokens it routed less those its plans
counted as cached (`tandem_prompt_tokens_total` less `tandem_router_cached_tokens_total`), the
plans (`tandem_route_decisions_total`), the inter-token latency
(`tandem_inter_token_latency_seconds`, its sum and count), and from the worker directory each
pool's live workers, their measured prefill rates (router/dispatch.py), their queued prompt
tokens and their running streams. Output tokens/s are the streams over the inter-token latency
(the tokens returned, `tandem_completion_tokens_total`, while no stream was observed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry

from common.background import BackgroundErrors, cancelling
from common.block_events import MEDIA
from router.metrics import RouterMetrics
from router.planner import POOLS, Planner, PlannerConfig, PoolBounds
from router.planner_inputs import CounterRate, Measurements, stream_batch, streamed_tokens_per_s
from router.settings import RouterSettings
from router.workers import WorkerDirectory

PLANS = ("disagg", "decode_local", "colocated")


def planner_config(s: RouterSettings) -> PlannerConfig:
    """The planner's configuration from the router's settings (built once, at the edge)."""
    return PlannerConfig(
        slo_ttft_s=s.slo_ttft, slo_itl_s=s.slo_itl, percentile=s.slo_percentile,
        prefill=PoolBounds(s.planner_min_prefill, s.planner_max_prefill),
        decode=PoolBounds(s.planner_min_decode, s.planner_max_decode),
        horizon_s=s.planner_startup_s + s.planner_interval_s, cooldown_s=s.planner_cooldown_s,
        max_step_up=s.planner_max_step_up, max_step_down=s.planner_max_step_down,
        default_prefill_tokens_per_s=s.default_prefill_tokens_per_s,
        decode_step_base_s=s.planner_decode_step_base_s,
        decode_step_per_seq_s=s.planner_decode_step_per_seq_s)


class _Model:
    """One model's planner and the running totals its rates come from."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.rates = {k: CounterRate() for k in ("prompt", "cached", "plans", "output")}
        self.itl = (0.0, 0.0)  # the histogram's (sum, count) at the last decision
        self.batches: list[float] = []  # the decode batch of a stream, sampled each second
        self.streams: list[int] = []  # the streams decoding, sampled each second


class PlannerLoop:
    def __init__(self, config: PlannerConfig, interval_s: float, registry: CollectorRegistry,
                 metrics: RouterMetrics, directory: WorkerDirectory,
                 models: Callable[[], list[str]]) -> None:
        self.config, self.interval_s = config, interval_s
        self.registry, self.metrics, self.directory = registry, metrics, directory
        self.models = models  # the served names, now
        self.state: dict[str, _Model] = {}

    def _total(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def sample(self) -> None:
        """The decode batch each stream of each model runs in, now."""
        for model in self.models():
            st, decode = self._model(model), self.directory.live("decode", model)
            st.batches.append(stream_batch(decode))
            st.streams.append(sum(w.running() for w in decode))

    def _model(self, model: str) -> _Model:
        if model not in self.state:
            live = {pool: len(self.directory.live(pool, model)) for pool in POOLS}
            self.state[model] = _Model(Planner(self.config, live["prefill"], live["decode"]))
        return self.state[model]

    def decide(self, now: float) -> None:
        """One decision per served model, exported."""
        for model in self.models():
            st = self._model(model)
            prompt = st.rates["prompt"].read(now, self._total("tandem_prompt_tokens_total",
                                                              model=model))
            cached = st.rates["cached"].read(now, sum(
                self._total("tandem_router_cached_tokens_total", medium=m, model=model)
                for m in MEDIA))
            plans = st.rates["plans"].read(now, sum(
                self._total("tandem_route_decisions_total", plan=p, model=model) for p in PLANS))
            output = st.rates["output"].read(now, self._total("tandem_completion_tokens_total",
                                                              model=model))
            itl = (self._total("tandem_inter_token_latency_seconds_sum", model=model),
                   self._total("tandem_inter_token_latency_seconds_count", model=model))
            (s0, c0), st.itl = st.itl, itl
            gaps_s, gaps = max(itl[0] - s0, 0.0), max(itl[1] - c0, 0.0)
            batch = sum(st.batches) / len(st.batches) if st.batches else 0.0
            streams = sum(st.streams) / len(st.streams) if st.streams else 0.0
            st.batches, st.streams = [], []
            if gaps and batch > 0:
                st.planner.observe_step(batch, gaps_s / gaps)
            prefill = self.directory.live("prefill", model)
            decode = self.directory.live("decode", model)
            rates = [w.prefill_tokens_per_s for w in prefill if w.prefill_tokens_per_s]
            line = st.planner.step_fit.line()
            for w in decode:  # what kv_aware prices a decode batch's growth on
                w.decode_step = line
            m = Measurements(now, max(prompt - cached, 0.0), plans,
                             streamed_tokens_per_s(streams, gaps_s, gaps, output),
                             streams_decoding=streams,
                             prefill_queued_tokens=sum(w.queued_tokens() for w in prefill),
                             prefill_tokens_per_s=max(rates) if rates else None,
                             num_prefill=len(prefill), num_decode=len(decode))
            self.metrics.planner.export(model, m, st.planner.update(m))

    async def run(self, errors: BackgroundErrors) -> None:
        next_decision = time.monotonic() + self.interval_s
        while not cancelling():
            try:
                self.sample()
                if time.monotonic() >= next_decision:
                    next_decision += self.interval_s
                    self.decide(time.monotonic())
            except Exception as e:  # noqa: BLE001 - a bad reading must not end the planner
                errors.record("planner", e, key=f"planner:{type(e).__name__}")
            await asyncio.sleep(1.0)


@contextlib.asynccontextmanager
async def planning(loop: PlannerLoop | None, errors: BackgroundErrors) -> AsyncIterator[None]:
    """Runs `loop` (None: the planner is off) while the router serves."""
    if loop is None:
        yield
        return
    task = asyncio.create_task(loop.run(errors))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
