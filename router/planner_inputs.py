"""What the SLO planner (router/planner.py) reads: one model's traffic and workers at one instant
(`Measurements`), and the estimators that turn raw observations into it: a rate from a running
total (`CounterRate`), Holt's linear-trend forecaster with its forecast error (`HoltForecast`),
and the decode step time against batch size, a linear fit (`StepTimeFit`).

Pure and synchronous: the router (router/planner_loop.py) and the simulator (sim/autoscale.py)
feed them the same observations from their own clocks."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Measurements:
    """One model's load at `now` (seconds on any monotonic clock)."""

    now: float
    # Traffic the router routed: prompt tokens left to compute after the prefix index (what
    # the prefill pool must do), the prompts they belong to, and the tokens streamed back.
    uncached_prompt_tokens_per_s: float
    prompts_per_s: float
    output_tokens_per_s: float
    streams_decoding: float  # requests running on the decode workers (the tick's mean)
    prefill_queued_tokens: int  # uncached prompt tokens queued or prefilling on prefill workers
    # One prefill worker's measured rate (router/dispatch.py learns it); None: none measured yet.
    prefill_tokens_per_s: float | None
    num_prefill: int  # live workers of each pool
    num_decode: int


def stream_batch(decode_workers: list) -> float:
    """The batch the average stream decodes in: its workers' running counts weighted by
    themselves (sum of squares over sum). A pool's plain mean would pair a busy worker's slow
    steps with the idle workers that just started."""
    running = [int(w.load.get("running", 0)) for w in decode_workers]
    total = sum(running)
    return sum(n * n for n in running) / total if total else 0.0


def streamed_tokens_per_s(mean_streams: float, gaps_s: float, num_gaps: float,
                          completed_tokens_per_s: float) -> float:
    """Tokens streamed per second now: the streams decoding over their inter-token latency
    (Little's law: smooth, and current where the tokens of finished requests lag by their
    length); the finished requests' tokens while no gap was observed."""
    if num_gaps > 0 and gaps_s > 0:
        return mean_streams * num_gaps / gaps_s
    return completed_tokens_per_s


class CounterRate:
    """A per-second rate from a running total (a Prometheus counter's value), over the time
    between two readings."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None

    def read(self, now: float, total: float) -> float:
        """The rate since the previous reading (0.0 at the first, or after the total went
        backwards: a counter reset)."""
        last, self._last = self._last, (now, total)
        if last is None or now <= last[0] or total < last[1]:
            return 0.0
        return (total - last[1]) / (now - last[0])


class WindowMax:
    """The largest value seen in the last `window_s` (None before any)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._values: deque[tuple[float, float]] = deque()  # (time, value), values decreasing

    def update(self, now: float, value: float | None) -> float | None:
        if value is not None:
            while self._values and self._values[-1][1] <= value:
                self._values.pop()
            self._values.append((now, value))
        while self._values and self._values[0][0] < now - self.window_s:
            self._values.popleft()
        return self._values[0][1] if self._values else None


class HoltForecast:
    """Holt's linear trend (double exponential smoothing) of one rate, with the mean absolute
    error of its one-step-ahead forecasts (an EWMA): what the planner adds as headroom."""

    def __init__(self, alpha: float = 0.3, beta: float = 0.05, error_gain: float = 0.2) -> None:
        self.alpha, self.beta, self.error_gain = alpha, beta, error_gain
        self.level: float | None = None
        self.trend = 0.0  # per second
        self.mean_abs_error = 0.0
        self._t = 0.0

    def update(self, now: float, value: float) -> None:
        if self.level is None:
            self.level, self._t = value, now
            return
        dt = now - self._t
        if dt <= 0:
            return
        predicted = self.level + self.trend * dt
        g = self.error_gain
        self.mean_abs_error = (1 - g) * self.mean_abs_error + g * abs(value - predicted)
        level = self.alpha * value + (1 - self.alpha) * predicted
        self.trend = self.beta * (level - self.level) / dt + (1 - self.beta) * self.trend
        self.level, self._t = level, now

    def forecast(self, horizon_s: float) -> float:
        """The rate `horizon_s` ahead (never below 0; 0 before any observation)."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.trend * horizon_s)

    def forecast_damped(self, horizon_s: float, damping_s: float) -> float:
        """The rate `horizon_s` ahead with the trend fading at the time constant `damping_s`
        (a continuous damped trend: level + trend * damping_s * (1 - exp(-horizon_s /
        damping_s)); never below 0)."""
        if self.level is None:
            return 0.0
        reach = damping_s * (1 - math.exp(-horizon_s / damping_s))
        return max(0.0, self.level + self.trend * reach)

    @property
    def error_sd(self) -> float:
        """The forecast error's standard deviation, from its mean absolute value (normal)."""
        return self.mean_abs_error * math.sqrt(math.pi / 2)


class StepTimeFit:
    """Decode step time = base + per_seq * batch, fitted by least squares over (batch, seconds)
    observations that fade with `half_life` observations. The slope is pulled towards a prior
    (ridge, as strong as `prior_weight` observations `prior_spread` batches apart): while every
    observation has about the same batch, the slope stays the prior's rather than being made
    up, and the line goes through what was observed."""

    def __init__(self, prior_base_s: float, prior_per_seq_s: float, prior_weight: float = 0.25,
                 prior_spread: float = 16.0, half_life: float = 60.0) -> None:
        self._decay = 0.5 ** (1 / half_life)
        self._prior = (prior_base_s, prior_per_seq_s)
        self._ridge = prior_weight * prior_spread ** 2
        self._sums = [0.0] * 6  # weight, x, y, xx, xy, yy of the observations
        self.num_observations = 0

    def observe(self, batch: float, step_s: float) -> None:
        if batch <= 0 or step_s <= 0 or not math.isfinite(step_s):
            return
        s = [v * self._decay for v in self._sums]
        for i, v in enumerate((1.0, batch, step_s, batch * batch, batch * step_s,
                               step_s * step_s)):
            s[i] += v
        self._sums = s
        self.num_observations += 1

    def line(self) -> tuple[float, float]:
        """(base_s, per_seq_s), neither below zero; the prior's until observed."""
        w, x, y, xx, xy, _ = self._sums
        base0, slope0 = self._prior
        if w < 1e-9:
            return base0, slope0
        sxx, sxy = xx - x * x / w, xy - x * y / w  # centred
        per_seq = max((sxy + self._ridge * slope0) / (sxx + self._ridge), 0.0)
        return max((y - per_seq * x) / w, 0.0), per_seq

    def residual_sd(self) -> float:
        """The observations' spread around the line (0 with fewer than 3)."""
        w, x, y, xx, xy, yy = self._sums
        if w <= 0 or self.num_observations < 3:
            return 0.0
        a, b = self.line()
        sse = yy - 2 * a * y - 2 * b * xy + a * a * w + 2 * a * b * x + b * b * xx
        return math.sqrt(max(sse, 0.0) / w)

    def step_s(self, batch: float) -> float:
        base, per_seq = self.line()
        return base + per_seq * batch
