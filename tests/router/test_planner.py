"""The SLO planner's decisions (router/planner.py) on measurement sequences: steady load keeps
the fleet, a burst scales up within the step limit, a trough scales down only after the
cooldown, the bounds hold, noisy steady load (and streams) does not flap, a backed-up prefill
pool's spill onto decode workers sizes the decode pool too; and its estimators
(router/planner_inputs.py) and capacity models on known values."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from router.planner import Planner, PlannerConfig, PoolBounds
from router.planner_inputs import CounterRate, HoltForecast, Measurements, StepTimeFit, WindowMax
from router.queueing import erlang_c, prefill_replicas, target_batch

TICK = 10.0
# A GPU-like pool: 15,000 prefill tokens/s a worker, steps of 8 ms + 2.7 ms per sequence.
CONFIG = PlannerConfig(slo_ttft_s=2.0, slo_itl_s=0.06, prefill=PoolBounds(1, 12),
                       decode=PoolBounds(1, 12), default_prefill_tokens_per_s=15000,
                       decode_step_base_s=0.008, decode_step_per_seq_s=0.0027, cooldown_s=120,
                       max_step_up=2, max_step_down=1)


def load(t: float, prompt_tokens: float, output_tokens: float, streams: int = 0,
         queued: int = 0, num_prefill: int = 1, num_decode: int = 1) -> Measurements:
    """One tick: prompts of 2,000 uncached tokens, at 15,000 tokens/s a prefill worker."""
    return Measurements(t, prompt_tokens, prompt_tokens / 2000, output_tokens, streams, queued,
                        15000.0, num_prefill, num_decode)


def run(planner: Planner, ticks: list[Measurements]) -> list[tuple[int, int]]:
    out = []
    for m in ticks:
        d = planner.update(m)
        out.append((d.prefill.desired, d.decode.desired))
    return out


def steady(start: float, n: int, prompt: float, output: float, noise: float = 0.0,
           seed: int = 0) -> list[Measurements]:
    rng = random.Random(seed)
    return [load(start + i * TICK, prompt * (1 + rng.uniform(-noise, noise)),
                 output * (1 + rng.uniform(-noise, noise))) for i in range(n)]


def test_steady_load_gives_no_change_once_sized():
    planner = Planner(CONFIG, 1, 1)
    sizes = run(planner, steady(0, 30, 40_000, 1500))
    settled = sizes[10]
    assert settled[0] > 1 and settled[1] > 1  # it did scale to the load first
    assert sizes[10:] == [settled] * 20


def test_a_burst_scales_up_within_the_step_limit():
    planner = Planner(CONFIG, 1, 1)
    before = run(planner, steady(0, 30, 10_000, 600))[-1]
    burst = run(planner, steady(300, 12, 80_000, 600))
    prefill = [before[0]] + [p for p, _ in burst]
    assert prefill[-1] >= before[0] + 4  # eight times the prompt tokens: many more workers
    assert all(b - a <= CONFIG.max_step_up for a, b in zip(prefill, prefill[1:], strict=False))
    assert prefill[1] > prefill[0]  # from the first tick of the burst


def test_a_trough_scales_down_only_after_the_cooldown_and_one_step_at_a_time():
    planner = Planner(CONFIG, 1, 1)
    busy = steady(0, 30, 60_000, 2500)
    sizes = run(planner, busy)
    last_up = max(i for i in range(1, 30) if sizes[i] > sizes[i - 1]) * TICK
    trough = steady(300, 40, 2_000, 100)
    after = run(planner, trough)
    peak = sizes[-1]
    for m, size in zip(trough, after, strict=True):
        if m.now - last_up < CONFIG.cooldown_s:
            assert size == peak, (m.now, size)
    assert after[-1][0] < peak[0] and after[-1][1] < peak[1]  # it did come down
    for pool in (0, 1):
        series = [peak[pool]] + [s[pool] for s in after]
        assert all(a - b <= CONFIG.max_step_down for a, b in zip(series, series[1:],
                                                                strict=False))
        assert all(b <= a for a, b in zip(series, series[1:], strict=False))  # never back up


def test_the_cooldown_defaults_to_the_horizon_and_noisy_load_still_does_not_flap():
    cfg = replace(CONFIG, cooldown_s=None, horizon_s=70.0)
    assert cfg.cooldown_s == 70.0  # a worker let go too early is back within one start-up
    with pytest.raises(ValueError):
        replace(CONFIG, cooldown_s=-1.0)
    planner = Planner(cfg, 1, 1)
    sizes = run(planner, steady(0, 200, 40_000, 1500, noise=0.25, seed=3))
    changes = [i for i in range(30, 200) if sizes[i] != sizes[i - 1]]
    assert len(changes) <= 2, [(i, sizes[i]) for i in changes]
    # A trough: the busy load's need stays in the window for one horizon, then it comes down.
    planner = Planner(cfg, 1, 1)
    busy = run(planner, steady(0, 30, 60_000, 2500))
    trough = steady(300, 20, 2_000, 100)
    after = run(planner, trough)
    first_down = next(m.now for m, size in zip(trough, after, strict=True) if size != busy[-1])
    assert first_down == 300.0 + 70.0


def test_bounds_hold_at_any_load():
    cfg = PlannerConfig(prefill=PoolBounds(2, 5), decode=PoolBounds(1, 3), max_step_up=8,
                        default_prefill_tokens_per_s=1000)
    planner = Planner(cfg, 0, 0)
    assert planner.scalers["prefill"].current == 2  # a start below min is raised to it
    huge = run(planner, [load(i * TICK, 200_000, 20_000, streams=2000) for i in range(10)])
    assert max(p for p, _ in huge) == 5 and max(d for _, d in huge) == 3
    idle = run(planner, [load(100 + i * TICK, 0, 0) for i in range(100)])
    assert idle[-1] == (2, 1)


def test_noisy_steady_load_does_not_flap():
    planner = Planner(CONFIG, 1, 1)
    sizes = run(planner, steady(0, 200, 40_000, 1500, noise=0.25, seed=3))
    changes = [i for i in range(30, 200) if sizes[i] != sizes[i - 1]]
    assert len(changes) <= 2, [(i, sizes[i]) for i in changes]


def test_a_prefill_backlog_is_demand():
    # 3,000,000 queued tokens: the live worker (15,000/s) does 900,000 of them before a new
    # one has started (60 s): the rest, over 60 s, is 35,000 tokens/s more.
    planner = Planner(CONFIG, 1, 1)
    calm = planner.update(load(0, 1000, 100))
    backed_up = Planner(CONFIG, 1, 1).update(load(0, 1000, 100, queued=3_000_000))
    assert calm.prefill.desired == 1 and backed_up.prefill.desired > 1
    assert backed_up.uncached_prompt_tokens_per_s == pytest.approx(1000 + 35_000)


def test_a_backlog_the_live_pool_clears_before_a_new_worker_starts_is_no_demand():
    # 300,000 queued tokens: past the TTFT SLO (20 s of work), but done in 20 s, long before a
    # worker asked for now has started (60 s): a new worker would find none of it.
    d = Planner(CONFIG, 1, 1).update(load(0, 1000, 100, queued=300_000))
    assert d.prefill.desired == 1 and d.uncached_prompt_tokens_per_s == pytest.approx(1000)


def test_streams_decoding_drive_the_decode_pool():
    # Few tokens counted yet (long streams just began), but 120 streams already decoding.
    d = Planner(CONFIG, 1, 1).update(load(0, 0, 10, streams=120))
    assert d.max_batch == pytest.approx((0.06 - 0.008) / 0.0027)
    batch = target_batch(d.max_batch, 1.645)
    assert batch + 1.645 * math.sqrt(batch) == pytest.approx(d.max_batch, rel=1e-3)
    assert d.decode.needed == pytest.approx(120 / batch, rel=1e-3)


def test_prefill_spilled_on_decode_workers_while_the_prefill_pool_is_backed_up():
    # 60,000 uncached tokens/s on one prefill worker (15,000/s) with 300,000 queued: the router
    # prefills the 45,000/s beyond it on decode workers (local prefill around a backlog), three
    # decode workers' time at the prefill rate, on top of what the streams need.
    calm = Planner(CONFIG, 1, 1).update(load(0, 60_000, 100))
    backed_up = Planner(CONFIG, 1, 1).update(load(0, 60_000, 100, queued=300_000))
    assert backed_up.decode.needed == pytest.approx(calm.decode.needed + 3, rel=1e-6)
    # Not the demand measured now (what the static fleets are sized for).
    assert backed_up.decode.needed_now == pytest.approx(calm.decode.needed_now)
    # A queue the live pool clears within the TTFT SLO is no backlog: nothing spills.
    short = Planner(CONFIG, 1, 1).update(load(0, 60_000, 100, queued=20_000))
    assert short.decode.needed == pytest.approx(calm.decode.needed)
    # Two live prefill workers compute 30,000/s of it: half the spill.
    two = Planner(CONFIG, 2, 1).update(load(0, 60_000, 100, queued=300_000, num_prefill=2))
    assert two.decode.needed == pytest.approx(calm.decode.needed + 2, rel=1e-6)


def test_streams_stalled_behind_spilled_prefills_count_only_if_they_outlast_a_start_up():
    # 30 prompts/s, 150 streams on the decode workers: a stream stays 5 s (Little's law). With
    # the prefill pool backed up, they are stalled behind the prompts prefilled beside them (the
    # spill prices that): none will still run when a decode worker asked for now has started.
    calm = Planner(CONFIG, 1, 1).update(load(0, 60_000, 1500, streams=150))
    backed_up = Planner(CONFIG, 1, 1).update(load(0, 60_000, 1500, streams=150,
                                                  queued=300_000))
    per_worker = backed_up.decode.needed - 3  # the spill: three workers' time
    assert calm.decode.needed == pytest.approx(150 / target_batch(calm.max_batch, 1.645),
                                               rel=1e-3)
    assert per_worker == pytest.approx(1500 * (0.008 + 0.0027 * target_batch(
        backed_up.max_batch, 1.645)) / target_batch(backed_up.max_batch, 1.645), rel=1e-3)
    assert backed_up.decode.needed < calm.decode.needed
    # Streams that outlast a start-up (few prompts, long answers) still count.
    slow = Planner(CONFIG, 1, 1).update(Measurements(0, 60_000, 0.5, 1500, 150, 300_000,
                                                     15000.0, 1, 1))
    assert slow.decode.needed > calm.decode.needed


def test_a_step_in_the_load_is_not_extrapolated_over_a_whole_start_up():
    # Prompt tokens step from 10,000/s to 40,000/s and stay: Holt's trend reads the step as a
    # steep rise for a while. Damped (time constant: half the horizon), the forecast carries
    # that trend less than half a start-up ahead, not a whole one.
    planner = Planner(CONFIG, 1, 1)
    run(planner, steady(0, 30, 10_000, 600))
    for m in steady(300, 6, 40_000, 600):
        d = planner.update(m)
    f = planner.prompt_tokens
    trend_part = d.uncached_prompt_tokens_per_s - f.level - CONFIG.headroom * f.error_sd
    assert f.trend > 0 and 0 < trend_part <= f.trend * CONFIG.horizon_s / 2
    assert f.forecast(CONFIG.horizon_s) > f.forecast_damped(CONFIG.horizon_s, 30) > f.level


def test_noisy_steady_streams_do_not_flap():
    planner = Planner(CONFIG, 1, 1)
    rng = random.Random(5)
    ticks = [load(i * TICK, 40_000, 1500, streams=round(60 * (1 + rng.uniform(-0.25, 0.25))))
             for i in range(200)]
    sizes = run(planner, ticks)
    changes = [i for i in range(30, 200) if sizes[i] != sizes[i - 1]]
    assert len(changes) <= 2, [(i, sizes[i]) for i in changes]


def test_erlang_c_and_the_prefill_pool_size():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = utilization
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(4, 0.0) == 0.0
    # 10 prompts/s of 0.1 s each: one erlang; the SLO's tail, not the mean, sizes the pool.
    n = prefill_replicas(10, 0.1, 0.3, 0.95, 0.85)
    wait = erlang_c(n, 1.0) * math.exp(-(n - 1.0) * 0.2 / 0.1)
    assert wait <= 0.05 and n >= 2
    assert prefill_replicas(10, 0.1, 10.0, 0.95, 0.85) == 2  # a loose SLO: utilization bounds it
    assert prefill_replicas(0, 0.1, 1.0, 0.95, 0.85) == 0


def test_step_fit_learns_the_line_and_keeps_the_prior_slope_on_one_batch():
    fit = StepTimeFit(0.05, 0.01)
    for batch in (2, 8, 16, 32, 4, 24) * 20:
        fit.observe(batch, 0.008 + 0.0027 * batch)
    base, per_seq = fit.line()
    assert base == pytest.approx(0.008, abs=0.002) and per_seq == pytest.approx(0.0027, rel=0.1)
    one = StepTimeFit(0.008, 0.0027)
    for _ in range(50):
        one.observe(10, 0.04)  # slower than the prior says, always at batch 10
    assert one.step_s(10) == pytest.approx(0.04, rel=0.05)
    assert one.line()[1] == pytest.approx(0.0027, rel=0.3)


def test_holt_follows_a_trend_and_measures_its_error():
    f = HoltForecast()
    for i in range(60):
        f.update(i * TICK, 100 + 5 * i)  # +0.5 per second
    assert f.forecast(60) == pytest.approx(100 + 5 * 59 + 30, rel=0.02)
    assert f.error_sd < 2.0  # of a rate near 400
    noisy = HoltForecast()
    rng = random.Random(0)
    for i in range(200):
        noisy.update(i * TICK, 100 + rng.gauss(0, 10))
    assert 5 < noisy.error_sd < 20 and noisy.forecast(60) == pytest.approx(100, abs=15)


def test_counter_rate_and_a_reset():
    rate = CounterRate()
    assert rate.read(0.0, 100) == 0.0
    assert rate.read(10.0, 600) == 50.0
    assert rate.read(20.0, 50) == 0.0  # the counter went back: a restart, not a negative rate
    assert rate.read(30.0, 150) == 10.0


def test_config_refuses_nonsense():
    with pytest.raises(ValueError):
        PoolBounds(3, 2)
    with pytest.raises(ValueError):
        PlannerConfig(percentile=100)
    with pytest.raises(ValueError):
        PlannerConfig(max_step_up=0)


def test_window_max_forgets_what_left_the_window():
    w = WindowMax(60)
    assert w.update(0, None) is None
    assert w.update(0, 5.0) == 5.0 and w.update(10, 3.0) == 5.0 and w.update(30, None) == 5.0
    assert w.update(65, 4.0) == 4.0  # 5.0 (t=0) is gone; 3.0 < 4.0 was dropped
    assert w.update(200, None) is None
