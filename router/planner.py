"""The SLO planner: each model's desired prefill and decode replicas, from the traffic the router
sees, what the workers measure and the SLOs (docs/planner.md).

- **Prefill** is a queue in front of n workers: prompts arrive at the forecast rate, each takes
  its mean uncached tokens at the measured prefill rate. The pool needs the fewest n whose
  M/M/n (Erlang C) waiting time keeps `percentile` of first tokens within `slo_ttft_s`, at no
  more than `max_utilization`. A backlog the live pool cannot clear within the SLO adds to the
  demand what of it the live pool will not have done by the time a new worker has started
  (`horizon_s`), spread over `horizon_s`. The rate is the best measured in `rate_window_s`
  (the router's measure of a prefill includes its wait in the queue: a busy pool would look
  slow and ask for more).
- **Decode** is continuous batching: a step takes base + per_seq * batch (fitted on observed
  inter-token latency against the batch, router/planner_inputs.py `StepTimeFit`). The largest
  batch whose step stays within `slo_itl_s` (less the fit's spread at `percentile`) bounds the
  `percentile` of a worker's batch, its streams counted as Poisson (`target_batch`); a
  worker's tokens/s at that mean batch, and the batch itself, give the workers the forecast
  output tokens/s and the streams decoding now need. While the prefill pool is backed up (a
  backlog it cannot clear within the TTFT SLO), the router prefills what arrives beyond the
  live prefill pool's rate on decode workers (local prefill around a backlog, router/policy.py):
  that prefill time is decode-worker time too, added at the prefill rate. The streams stalled
  behind those prefills are priced by it: while it lasts, only the streams still running when a
  new worker has started count (a stream's mean stay is streams / prompts per second, Little's
  law; memoryless: a share exp(-horizon_s / stay) of them).
- **Forecast**: Holt's trend of each rate, damped (Gardner): it fades with a time constant of
  `trend_damping` times `horizon_s` (a new worker's start-up and a tick), looked that far ahead
  while it rises (a falling one is not anticipated), plus `headroom` standard deviations of its
  one-step forecast error. A step in the load reads as a steep trend for a while: undamped,
  extrapolated over a whole start-up, it asks for a fleet the step never needs.
- **Damping** (`PoolScaler`): up by at most `max_step_up` a decision, at once past
  `1 + hysteresis` times the fleet, else once two decisions in a row need it; down only
  `cooldown_s` (by default `horizon_s`) after the last scale-up, to the highest need of the
  last `cooldown_s` at `1 + hysteresis` times the load, by at most `max_step_down` a decision;
  always within [min, max].

Pure and synchronous: `Planner.update(measurements)` is the whole decision.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist

from router.planner_inputs import HoltForecast, Measurements, StepTimeFit, WindowMax
from router.queueing import prefill_replicas, target_batch

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PoolBounds:
    min_replicas: int = 1
    max_replicas: int = 16

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"pool bounds need 0 <= min <= max, got {self.min_replicas}, "
                             f"{self.max_replicas}")


@dataclass(frozen=True)
class PlannerConfig:
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.1
    percentile: float = 95.0  # share of requests each SLO must hold for
    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    horizon_s: float = 60.0  # forecast this far ahead: a new worker's start-up plus a tick
    headroom: float = 0.5  # forecast-error standard deviations added to the forecast
    trend_damping: float = 0.5  # the trend fades with this time constant, a share of horizon_s
    max_utilization: float = 0.85
    # No scale-down sooner than this after a scale-up. Default: `horizon_s`. A worker let go
    # too early is back within one start-up; holding it longer pays for a whole start-up's
    # worth of its hours against a risk no larger (docs/planner.md, "Cooldown").
    cooldown_s: float | None = None
    hysteresis: float = 0.05
    max_step_up: int = 4
    max_step_down: int = 2
    # Until measured: one prefill worker's tokens/s, and the decode step time's line.
    default_prefill_tokens_per_s: float = 1000.0
    decode_step_base_s: float = 0.066
    decode_step_per_seq_s: float = 0.0064
    max_batch: int = 256  # the most sequences one decode worker runs (max_num_seqs)
    # A worker's prefill rate as measured includes its queue: the best of this window stands.
    rate_window_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.percentile < 100:
            raise ValueError(f"percentile must be in (0, 100), got {self.percentile}")
        if self.slo_ttft_s <= 0 or self.slo_itl_s <= 0:
            raise ValueError("the SLOs must be positive")
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization must be in (0, 1], got {self.max_utilization}")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("step limits must be at least 1")
        if self.trend_damping <= 0:
            raise ValueError(f"trend_damping must be positive, got {self.trend_damping}")
        if self.cooldown_s is None:
            object.__setattr__(self, "cooldown_s", self.horizon_s)
        elif self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")


@dataclass(frozen=True)
class PoolDecision:
    needed: float  # the replicas the forecast load needs (before damping and bounds)
    desired: int
    # ... and the demand measured now: its rates, without forecast, headroom, a prefill
    # backlog or the streams piled up on decode workers (what a fleet sized for it needs)
    needed_now: float


@dataclass(frozen=True)
class Decision:
    prefill: PoolDecision
    decode: PoolDecision
    uncached_prompt_tokens_per_s: float  # forecast, with headroom
    output_tokens_per_s: float  # forecast, with headroom
    prefill_tokens_per_s: float  # one prefill worker's, as used
    decode_step: tuple[float, float]  # (base_s, per_seq_s) as fitted
    max_batch: float  # the largest decode batch within the ITL SLO

    def pool(self, name: str) -> PoolDecision:
        return self.prefill if name == "prefill" else self.decode


class PoolScaler:
    """One pool's replicas from its need over time: the damping described above."""

    def __init__(self, bounds: PoolBounds, current: int) -> None:
        self.bounds = bounds
        self.current = self._clamp(current)
        self.last_up = -math.inf
        self._last_needed = 0.0
        self._window: deque[tuple[float, int]] = deque()  # (time, down target)

    def _clamp(self, n: int) -> int:
        return min(max(n, self.bounds.min_replicas), self.bounds.max_replicas)

    def step(self, now: float, needed: float, needed_above: float, cfg: PlannerConfig) -> int:
        """`needed` at the forecast load, `needed_above` at `1 + hysteresis` times it."""
        # Up at once past `1 + hysteresis` times the fleet; a smaller excess must hold for two
        # decisions (one noisy forecast is not a trend).
        last, self._last_needed = self._last_needed, needed
        if needed <= self.current * (1 + cfg.hysteresis):
            needed = min(needed, last)
        up_to = math.ceil(needed - 1e-9)
        self._window.append((now, math.ceil(needed_above - 1e-9)))
        while self._window and self._window[0][0] < now - cfg.cooldown_s:
            self._window.popleft()
        current = self.current
        if up_to > current:
            current = min(up_to, current + cfg.max_step_up)
            self.last_up = now
        elif now - self.last_up >= cfg.cooldown_s:
            down_to = max(t for _, t in self._window)
            if down_to < current:
                current = max(down_to, current - cfg.max_step_down)
        self.current = self._clamp(current)
        return self.current


class Planner:
    """One model's planner: feed it `Measurements` each tick, and the decode step observations
    (`observe_step`) as they come."""

    def __init__(self, config: PlannerConfig, num_prefill: int, num_decode: int) -> None:
        self.config = config
        self.scalers = {"prefill": PoolScaler(config.prefill, num_prefill),
                        "decode": PoolScaler(config.decode, num_decode)}
        self.prompt_tokens = HoltForecast()
        self.prompts = HoltForecast()
        self.output_tokens = HoltForecast()
        self.step_fit = StepTimeFit(config.decode_step_base_s, config.decode_step_per_seq_s)
        self.prefill_rate = WindowMax(config.rate_window_s)
        self._z = NormalDist().inv_cdf(config.percentile / 100)

    def observe_step(self, batch: float, step_s: float) -> None:
        """A decode step (or the mean inter-token latency) observed at this mean batch."""
        self.step_fit.observe(batch, step_s)

    def _ahead(self, f: HoltForecast) -> float:
        # A rising trend is met ahead of time (a new worker takes `horizon_s`), damped; a
        # falling one is not anticipated: a worker goes at once when the load has gone.
        cfg = self.config
        ahead = f.forecast_damped(cfg.horizon_s, cfg.trend_damping * cfg.horizon_s)
        return max(ahead, f.forecast(0.0)) + cfg.headroom * f.error_sd

    def update(self, m: Measurements) -> Decision:
        cfg = self.config
        self.prompt_tokens.update(m.now, m.uncached_prompt_tokens_per_s)
        self.prompts.update(m.now, m.prompts_per_s)
        self.output_tokens.update(m.now, m.output_tokens_per_s)
        rate = self.prefill_rate.update(m.now, m.prefill_tokens_per_s) \
            or cfg.default_prefill_tokens_per_s
        backlog, spilled = self._backlog(m, rate)
        tokens = self._ahead(self.prompt_tokens) + backlog
        prompts = self._ahead(self.prompts)
        out = self._ahead(self.output_tokens)
        base, per_seq = self.step_fit.line()
        max_batch = self._max_batch(base, per_seq)
        batch = target_batch(max_batch, self._z)  # where a worker should run
        per_worker = batch / (base + per_seq * batch)  # tokens/s at that batch

        # The demand measured now: its rates alone, not a backlog, the prefills it spills on
        # decode workers or streams piled up.
        now = (m.uncached_prompt_tokens_per_s, m.prompts_per_s, m.output_tokens_per_s, 0.0, 0.0)
        ahead = (tokens, prompts, out, self._streams_ahead(m, spilled), spilled)

        def prefill(load: float, demand=ahead) -> float:
            return self._prefill_needed(demand[0] * load, demand[1] * load, rate)

        def decode(load: float, demand=ahead) -> float:
            # A decode worker's time goes to its steps and to the prefills spilled on it.
            return max(demand[2] * load / per_worker, demand[3] * load / batch) \
                + demand[4] * load / rate

        pools = {}
        for pool, need in (("prefill", prefill), ("decode", decode)):
            needed = need(1.0)
            desired = self.scalers[pool].step(m.now, needed, need(1 + cfg.hysteresis), cfg)
            pools[pool] = PoolDecision(needed, desired, need(1.0, now))
        return Decision(pools["prefill"], pools["decode"], tokens, out, rate, (base, per_seq),
                        max_batch)

    def _streams_ahead(self, m: Measurements, spilled: float) -> float:
        """The streams decoding that the decode pool is sized for. While prompts are prefilled
        on decode workers (`spilled`), streams pile up behind them: that time is counted as the
        spill, and of the streams only those still running when a new worker has started
        (`horizon_s`) count, their mean stay streams / prompts per second (Little's law)."""
        streams = m.streams_decoding
        if spilled <= 0 or streams <= 0 or m.prompts_per_s <= 0:
            return streams
        return streams * math.exp(-self.config.horizon_s * m.prompts_per_s / streams)

    def _backlog(self, m: Measurements, rate: float) -> tuple[float, float]:
        """(tokens/s, tokens/s) while the live prefill pool cannot clear its queue within the
        TTFT SLO: what of the queue it will not have done by the time a new worker has started
        (`horizon_s`), spread over `horizon_s` (demand on the prefill pool), and what arrives
        beyond what it computes: the router prefills that on decode workers (local prefill
        while the prefill pool is backed up) until new prefill workers have started. No
        backlog, neither: noisy steady load does not reach them."""
        cfg = self.config
        live = m.num_prefill * rate
        if m.prefill_queued_tokens <= live * cfg.slo_ttft_s:
            return 0.0, 0.0
        left = max(0.0, m.prefill_queued_tokens - live * cfg.horizon_s)
        return left / cfg.horizon_s, max(0.0, m.uncached_prompt_tokens_per_s - live)

    def _prefill_needed(self, tokens_per_s: float, prompts_per_s: float, rate: float) -> float:
        if tokens_per_s <= 0:
            return 0.0
        cfg = self.config
        prompts = max(prompts_per_s, 1e-9)
        return float(prefill_replicas(prompts, tokens_per_s / prompts / rate, cfg.slo_ttft_s,
                                      cfg.percentile / 100, cfg.max_utilization))

    def _max_batch(self, base: float, per_seq: float) -> float:
        cfg = self.config
        # The fit's spread at the percentile comes off the budget, but at most half of it:
        # noisy observations must not drive the batch (and the pool's need) to extremes.
        budget = cfg.slo_itl_s - base
        budget -= min(self._z * self.step_fit.residual_sd(), budget / 2)
        if per_seq <= 0:
            return float(cfg.max_batch)
        return min(max(budget / per_seq, 1.0), float(cfg.max_batch))
