"""Traces for `python -m sim autoscale`: seeded sessions and their start times under a load that
moves (`TRACES`).

- `ramp`: low, up to the peak, held, back down (a launch, a working day's morning and evening);
- `burst`: steady chat at a third of the peak, and for `burst_s` a burst of agent sessions on
  long, uncached contexts (RAG, tool results): a prefill surge;
- `diurnal`: a day compressed into the trace, a cosine from a trough at 15% of the peak.

Chat sessions share one of `shared_prefixes` system prompts; burst sessions bring contexts of
their own. Start times are a non-homogeneous Poisson process (thinning), so runs with the same
seed see the same sessions at the same times whatever the cluster does. The trace proper begins
after `warmup_s` of its opening load (`Trace.start_s`): a cluster that was already serving, its
caches warm and its fleet sized (an autoscaler started from one worker a pool has settled);
what happens before is not scored.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from sim.workload import SimSession, multi_turn

TRACES = ("ramp", "burst", "diurnal")


@dataclass(frozen=True)
class TraceShape:
    duration_s: float = 2400.0
    warmup_s: float = 600.0
    peak_sessions_per_s: float = 4.0  # chat sessions starting per second at the peak
    turns: int = 4
    system_tokens: int = 2000
    shared_prefixes: int = 32
    user_tokens: int = 150
    answer_tokens: int = 200
    think_s: float = 8.0
    trough: float = 0.15  # the lowest load, as a share of the peak (ramp, diurnal)
    # burst: long-context agent sessions on top of chat at `burst_base` of the peak
    burst_base: float = 0.35
    burst_at: float = 0.4  # share of the duration
    burst_s: float = 240.0
    burst_share: float = 0.75  # burst sessions per second, as a share of the chat peak's
    burst_context_tokens: int = 12000
    burst_turns: int = 2
    burst_answer_tokens: int = 120


@dataclass
class Trace:
    name: str
    shape: TraceShape
    sessions: list[SimSession]
    arrivals: list[float]  # each session's start, sorted (the warm-up's first)

    @property
    def start_s(self) -> float:
        return self.shape.warmup_s

    @property
    def end_s(self) -> float:
        return self.shape.warmup_s + self.shape.duration_s

    def summary(self) -> dict:
        return {"trace": self.name, "sessions": len(self.sessions),
                "sessions_in_warmup": sum(t < self.start_s for t in self.arrivals),
                **vars(self.shape)}


def _rate(name: str, shape: TraceShape) -> Callable[[float], float]:
    """Chat sessions per second at time t."""
    peak, low, d = shape.peak_sessions_per_s, shape.trough * shape.peak_sessions_per_s, \
        shape.duration_s
    if name == "ramp":
        def ramp(t: float) -> float:
            x = t / d  # up over 10-50%, held to 70%, down by 90%
            up = min(max((x - 0.1) / 0.4, 0.0), 1.0) * min(max((0.9 - x) / 0.2, 0.0), 1.0)
            return low + (peak - low) * up
        return ramp
    if name == "diurnal":
        return lambda t: low + (peak - low) * (1 - math.cos(2 * math.pi * t / d)) / 2
    if name == "burst":
        return lambda t: shape.burst_base * peak
    raise ValueError(f"unknown trace {name!r}; choose from {', '.join(TRACES)}")


def _poisson(rng: random.Random, rate: Callable[[float], float], peak: float, start: float,
             end: float) -> list[float]:
    """Arrival times in [start, end) of a Poisson process of rate `rate(t)` <= `peak`."""
    out, t = [], start
    if peak <= 0:
        return out
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            return out
        if rng.random() * peak < rate(t):
            out.append(t)


def make_trace(name: str, seed: int = 0, shape: TraceShape | None = None) -> Trace:
    shape = shape or TraceShape()
    rng = random.Random(seed)
    rate = _rate(name, shape)
    w = shape.warmup_s
    times = _poisson(rng, lambda t: rate(max(t - w, 0.0)), shape.peak_sessions_per_s, 0.0,
                     w + shape.duration_s)
    sessions = multi_turn(len(times), turns=shape.turns, seed=seed + 1,
                          system_tokens=shape.system_tokens, user_tokens=shape.user_tokens,
                          answer_tokens=shape.answer_tokens, think_s=shape.think_s,
                          shared_prefixes=shape.shared_prefixes)
    tagged = [(t, s) for t, s in zip(times, sessions, strict=True)]
    if name == "burst":
        start = w + shape.burst_at * shape.duration_s
        rate_b = shape.burst_share * shape.peak_sessions_per_s
        burst = _poisson(rng, lambda t: rate_b, rate_b, start, start + shape.burst_s)
        agents = multi_turn(len(burst), turns=shape.burst_turns, seed=seed + 2,
                            system_tokens=shape.burst_context_tokens,
                            user_tokens=shape.user_tokens,
                            answer_tokens=shape.burst_answer_tokens, think_s=shape.think_s)
        tagged = sorted(tagged + list(zip(burst, agents, strict=True)), key=lambda ts: ts[0])
    return Trace(name, shape, [s for _, s in tagged], [t for t, _ in tagged])
