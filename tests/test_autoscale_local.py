"""`tandem up --autoscale` (tandem/autoscaler.py): the router's planner bounds on its command
line, the planner's metric read back, and a real cluster (router, workers, Redis) that starts a
prefill worker when the planner asks for two and drains it when one is wanted again, with
requests flowing throughout and none failing."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tandem.autoscaler import LocalAutoscaler, desired_replicas, read_router
from tandem.cli import build_parser
from tandem.settings import local_cluster
from testing.metrics import scrape, series_sum
from testing.redis_server import REDIS_URL


def test_the_planners_bounds_reach_the_router_and_redis_is_required():
    args = build_parser().parse_args(["up", "--model", "m", "--autoscale", "--min-prefill", "2",
                                      "--max-prefill", "3", "--max-decode", "5"])
    router = local_cluster(args).extra_router_args
    assert {"--planner-min-prefill=2", "--planner-max-prefill=3", "--planner-min-decode=1",
            "--planner-max-decode=5"} <= set(router)
    parsed = build_parser().parse_args(["router", *router])
    assert parsed.planner_max_decode == 5
    with pytest.raises(SystemExit, match="needs Redis"):
        local_cluster(build_parser().parse_args(["up", "--model", "m", "--autoscale",
                                                 "--no-redis"]))
    assert not any(a.startswith("--planner") for a in local_cluster(build_parser().parse_args(
        ["up", "--model", "m"])).extra_router_args)


def test_desired_replicas_are_read_from_the_routers_metrics():
    text = ("# HELP tandem_planner_desired_replicas ...\n"
            'tandem_planner_desired_replicas{model="a",pool="prefill"} 3.0\n'
            'tandem_planner_desired_replicas{model="b",pool="prefill"} 2.0\n'
            'tandem_planner_desired_replicas{model="a",pool="decode"} 1.0\n'
            'tandem_planner_needed_replicas{model="a",pool="decode"} 7.0\n')
    assert desired_replicas(text) == {"prefill": 3, "decode": 1}
    assert desired_replicas("") == {}


@pytest.mark.redis
def test_a_local_cluster_follows_the_planner_up_and_down_without_failing_a_request(
        tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_ROUTER_PLANNER_INTERVAL_S", "1")
    args = build_parser().parse_args([
        "up", "--model", str(tiny_folder), "--port", "0", "--redis-url", REDIS_URL,
        "--autoscale", "--min-prefill", "2", "--max-prefill", "2", "--max-decode", "1"])
    cluster = local_cluster(args)
    cluster.log_dir = tmp_path / "logs"
    url = cluster.up()
    failures, done, stop = [], [], threading.Event()

    def load() -> None:  # a request every 0.2 s throughout
        with httpx.Client(base_url=url, timeout=60) as client:
            i = 0
            while not stop.is_set():
                r = client.post("/v1/completions", json={
                    "model": tiny_folder.name, "prompt": f"{i} " + "word " * 60,
                    "max_tokens": 8})
                (done if r.status_code == 200 else failures).append(r.status_code)
                i += 1
                time.sleep(0.2)

    def live(client: httpx.Client, role: str) -> float:
        return series_sum(scrape(client), "tandem_live_workers", role=role)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        # The router's planner asks for two prefill workers (its floor): one is started.
        scaler = LocalAutoscaler(cluster, {"prefill": (1, 2), "decode": (1, 1)},
                                 read_router(url), interval_s=1.0, say=lambda _: None)
        with httpx.Client(base_url=url, timeout=10) as client:
            deadline = time.monotonic() + 120
            while live(client, "prefill") < 2 and time.monotonic() < deadline:
                scaler.tick()
                time.sleep(0.5)
            assert live(client, "prefill") == 2 and cluster.pool("prefill") == ["prefill-0",
                                                                                "prefill-1"]
            time.sleep(2)  # requests reach the new worker too
            # One wanted again: the newest drains and goes, the router stops routing there.
            scaler.read = lambda: {"prefill": 1, "decode": 1}
            scaler._last = -float("inf")
            scaler.tick()
            assert cluster.retiring == {"prefill-1"} and cluster.pool("prefill") == ["prefill-0"]
            proc = dict(cluster.procs)["prefill-1"]
            proc.wait(60)
            deadline = time.monotonic() + 30
            while live(client, "prefill") > 1 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert live(client, "prefill") == 1
            time.sleep(2)
    finally:
        stop.set()
        thread.join(60)
        cluster.down()
    assert failures == [] and len(done) > 20
