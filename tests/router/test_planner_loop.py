"""The SLO planner inside the router (router/planner_loop.py): what it reads of the router's own
metrics and worker directory, and what it exports; then a real router, workers and Redis
exporting `tandem_planner_desired_replicas` for the traffic it served."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from prometheus_client import CollectorRegistry

from common.background import BackgroundErrors
from common.registry import RedisKeys
from router.metrics import RouterMetrics
from router.planner_loop import PlannerLoop, planner_config
from router.settings import RouterSettings
from router.workers import WorkerDirectory
from testing.cluster import Router, Worker
from testing.metrics import series_sum

SETTINGS = RouterSettings(slo_ttft=2.0, slo_itl=0.06, default_prefill_tokens_per_s=15000,
                          planner_decode_step_base_s=0.008, planner_decode_step_per_seq_s=0.0027,
                          planner_max_prefill=8, planner_max_decode=8)


def loop_over(workers: list[str]) -> tuple[PlannerLoop, RouterMetrics, WorkerDirectory,
                                           CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    metrics.add_model("m")
    directory = WorkerDirectory(RedisKeys("t"), workers, static_model="m")
    for w in directory.workers.values():
        w.accepted = frozenset({"m"})
    loop = PlannerLoop(planner_config(SETTINGS), 10.0, registry, metrics, directory,
                       lambda: ["m"])
    return loop, metrics, directory, registry


def gauge(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model": "m", **labels})


def test_the_loop_reads_the_routers_counters_and_workers_and_exports_a_decision():
    loop, metrics, directory, registry = loop_over(
        ["prefill=http://127.0.0.1:1", "decode=http://127.0.0.1:2", "decode=http://127.0.0.1:3"])
    p, d1, d2 = directory.workers.values()
    p.prefill_tokens_per_s = 15000.0
    p.inflight_tokens = 20_000  # within the TTFT SLO (2 s at 15,000/s): no backlog
    d1.load, d2.load = {"running": 30}, {"running": 10}
    loop.sample()
    loop.decide(0.0)  # the first reading: rates start from here
    # 10 s of traffic: 400,000 prompt tokens of which 100,000 cached, 200 plans, 30,000
    # tokens out, and inter-token latencies of 80 ms.
    metrics.prompt_tokens.labels("m").inc(400_000)
    metrics.cached_tokens.labels("device", "m").inc(60_000)
    metrics.cached_tokens.labels("host", "m").inc(40_000)
    metrics.route.labels("disagg", "m").inc(150)
    metrics.route.labels("decode_local", "m").inc(50)
    metrics.completion_tokens.labels("m").inc(30_000)
    for _ in range(100):
        metrics.itl.labels("m").observe(0.08)
    loop.sample()
    loop.decide(10.0)
    measured = gauge(registry, "tandem_planner_tokens_per_second", kind="uncached_prompt",
                     basis="measured")
    assert measured == pytest.approx(30_000)
    # Output: 40 streams at 80 ms a token (Little's law), not the 3,000 tokens/s of the
    # requests that finished (they lag by their length).
    assert gauge(registry, "tandem_planner_tokens_per_second", kind="output",
                 basis="measured") == pytest.approx(500)
    assert gauge(registry, "tandem_planner_streams_decoding") == 40
    assert gauge(registry, "tandem_planner_prefill_queued_tokens") == 20_000
    assert gauge(registry, "tandem_planner_prefill_worker_tokens_per_second") == 15000
    # 30,000 uncached tokens/s at 15,000 a worker: more than one prefill worker (from the first
    # tick on the smoothed forecast); 40 streams: more than the two decode workers.
    assert gauge(registry, "tandem_planner_desired_replicas", pool="prefill") >= 2
    assert gauge(registry, "tandem_planner_desired_replicas", pool="decode") >= 3
    assert gauge(registry, "tandem_planner_needed_replicas", pool="decode") > 2
    # The step fit took the observation: 80 ms at the batch the average stream ran in
    # ((30^2 + 10^2) / 40 = 25), above the prior line's 8 + 2.7 * 25 = 75.5 ms.
    base = gauge(registry, "tandem_planner_decode_step_seconds", term="base")
    per_seq = gauge(registry, "tandem_planner_decode_step_seconds", term="per_sequence")
    assert base + per_seq * 25 == pytest.approx(0.08, rel=0.01)
    # ... and it is what kv_aware prices a decode batch's growth on (router/decode_growth.py).
    assert d1.decode_step == d2.decode_step == pytest.approx((base, per_seq))
    assert p.decode_step is None
    # A tick without a stream observed: the tokens of the requests that finished.
    metrics.completion_tokens.labels("m").inc(2000)
    loop.decide(20.0)
    assert gauge(registry, "tandem_planner_tokens_per_second", kind="output",
                 basis="measured") == pytest.approx(200)


def test_no_model_no_series_and_a_failing_read_is_counted_not_fatal():
    import asyncio

    loop, _, _, registry = loop_over(["decode=http://127.0.0.1:2"])
    loop.models = lambda: []
    loop.decide(0.0)
    assert registry.get_sample_value("tandem_planner_desired_replicas",
                                     {"model": "m", "pool": "decode"}) is None

    def broken() -> list[str]:
        raise RuntimeError("boom")

    loop.models = broken
    errors = BackgroundErrors(CollectorRegistry())

    async def run_briefly() -> None:
        task = asyncio.create_task(loop.run(errors))
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(run_briefly())
    assert errors.counter.labels("planner")._value.get() == 1


@pytest.mark.redis
def test_a_real_router_exports_the_planners_decision(tiny_folder, tmp_path):
    ns = f"plan-{uuid.uuid4().hex[:6]}"
    p = Worker("prefill", str(tiny_folder), cache_dir=tmp_path, namespace=ns)
    d = Worker("decode", str(tiny_folder), cache_dir=tmp_path, namespace=ns)
    r = Router(tiny_folder, ns, cache_dir=tmp_path,
               extra=["--planner-interval-s", "1", "--slo-itl", "0.5"])
    try:
        r.wait_workers(2)
        deadline, i = time.monotonic() + 60, 0
        with httpx.Client(base_url=r.url, timeout=60) as client:
            while time.monotonic() < deadline:  # traffic until a decision has seen some
                client.post("/v1/completions", json={
                    "model": "tiny-random", "prompt": f"request {i}: " + "word " * 200,
                    "max_tokens": 8}).raise_for_status()
                i += 1
                m = r.metrics()
                if series_sum(m, "tandem_planner_tokens_per_second", kind="uncached_prompt",
                              basis="forecast") > 0:
                    break
        for pool in ("prefill", "decode"):
            assert series_sum(m, "tandem_planner_desired_replicas", pool=pool) >= 1
        assert series_sum(m, "tandem_planner_prefill_worker_tokens_per_second") > 0
        assert series_sum(m, "tandem_planner_tokens_per_second", kind="uncached_prompt",
                          basis="forecast") > 0
    finally:
        r.close()
        p.close()
        d.close()
