"""`tandem bench` against real processes (router, prefill and decode workers, Redis), and the
report's arithmetic on hand-made records."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import pytest

from loadgen import workload
from loadgen.bench import run
from loadgen.report import SLO, percentiles, summarize
from loadgen.runner import RequestRecord, RunConfig, Runner
from testing.cluster import Router, Worker
from testing.processes import ROOT


def test_workloads_are_seeded_and_shaped():
    a, b = workload.multi_turn(3, turns=4, seed=7), workload.multi_turn(3, turns=4, seed=7)
    assert [t.user for s in a for t in s.turns] == [t.user for s in b for t in s.turns]
    assert ([t.user for s in workload.multi_turn(3, seed=8) for t in s.turns]
            != [t.user for s in a for t in s.turns])
    shared = workload.shared_system(5)
    assert len({s.system for s in shared}) == 1 and len({s.turns[0].user for s in shared}) == 5
    mix = workload.mixed(40, seed=1)
    long_prompt = [s for s in mix if s.turns[0].max_tokens == 4]
    assert 0 < len(long_prompt) < 40
    assert all(len(s.turns[0].user) > 5 * len(m.turns[0].user) for s in long_prompt for m in mix
               if m.turns[0].max_tokens == 64)
    with pytest.raises(ValueError, match="unknown workload"):
        workload.build("nope", 1)


def test_summary_percentiles_goodput_and_hit_ratio():
    recs = [RequestRecord(0, i, 0.0, ttft_s=0.1 * (i + 1), e2e_s=1.0,
                          itl_s=[0.05, 0.3 if i == 3 else 0.05], completion_tokens=3)
            for i in range(4)]
    recs.append(RequestRecord(1, 0, 0.0, error="HTTP 503"))
    before = {'tandem_prefix_cache_hit_tokens_total{pool="prefill"}': 10.0,
              "tandem_prompt_tokens_total": 100.0}
    after = {'tandem_prefix_cache_hit_tokens_total{pool="prefill"}': 40.0,
             "tandem_prompt_tokens_total": 200.0,
             'tandem_route_decisions_total{plan="disagg"}': 4.0}
    s = summarize(recs, 2.0, SLO(ttft_s=0.25, itl_s=0.2), before, after)
    assert s["ok"] == 4 and s["errors"] == {"HTTP 503": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.3) and s["ttft_s"]["p99"] == pytest.approx(0.4)
    assert s["goodput_requests_per_s"] == pytest.approx(1.0)  # turns 0, 1 meet both targets
    assert s["output_tokens_per_s"] == pytest.approx(6.0)
    assert s["prefix_hit_ratio"] == pytest.approx(0.3)
    assert s["route_plans"] == {"disagg": 4.0}
    assert percentiles([])["p50"] is None


@pytest.mark.redis
def test_bench_drives_a_real_cluster_and_reads_its_counters(tiny_folder, tmp_path):
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    p = Worker("prefill", str(tiny_folder), cache_dir=tmp_path, namespace=ns, num_blocks=1024)
    d = Worker("decode", str(tiny_folder), cache_dir=tmp_path, namespace=ns, num_blocks=1024)
    r = Router(tiny_folder, ns, cache_dir=tmp_path)
    try:
        r.wait_workers(2)
        sessions = workload.multi_turn(3, turns=4, system_words=12, user_words=6, max_tokens=8)
        s = run(f"{r.url}/v1", "tiny-random", "multi-turn", 3, concurrency=2,
                out_dir=tmp_path / "out", name="mt", sessions=sessions)
        assert s["requests"] == s["ok"] == 12 and not s["errors"], s
        assert 0 < s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]
        # The router had each first token no later than the client saw text.
        assert 0 < s["server_ttft_s"]["p50"] <= s["ttft_s"]["p50"]
        assert s["itl_s"]["p50"] is not None and s["output_tokens_per_s"] > 0
        assert 0.2 < s["prefix_hit_ratio"] < 1  # later turns reuse earlier turns' blocks
        assert sum(s["route_plans"].values()) == 12
        # Each record keeps the router's whole timing field (bench/sim_profile.py fits from it).
        recs = asyncio.run(Runner(RunConfig(f"{r.url}/v1", "tiny-random",
                                            concurrency=1)).run(sessions[:1]))
        assert [rec.timing["plan"] for rec in recs] == [rec.plan for rec in recs] and len(recs) == 4
        assert all(rec.timing["first_token_s"] == rec.server_ttft_s > 0 for rec in recs)
        assert all(rec.timing["num_cached_tokens"] >= 0 and rec.timing["total_s"] > 0
                   for rec in recs)
        assert json.loads((tmp_path / "out" / "mt.json").read_text())["ok"] == 12
        assert "| TTFT |" in (tmp_path / "out" / "mt.md").read_text()
        # latency CDFs
        assert (tmp_path / "out" / "mt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # A rate sweep through the CLI: one run per rate, then throughput/goodput/TTFT vs rate.
        ok = subprocess.run([sys.executable, "-m", "tandem.cli", "bench", "--url", f"{r.url}/v1",
                             "--model", "tiny-random", "--workload", "shared-system", "--size", "4",
                             "--rate", "5,20", "--out", str(tmp_path / "out"), "--name", "sweep"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        runs = json.loads((tmp_path / "out" / "sweep.json").read_text())["runs"]
        assert [x["rate"] for x in runs] == [5.0, 20.0] and all(x["ok"] == 4 for x in runs)
        assert (tmp_path / "out" / "sweep.png").read_bytes()[:4] == b"\x89PNG"
        # Open loop through the CLI; a wrong model is counted as errors and the exit code says so.
        cli = subprocess.run([sys.executable, "-m", "tandem.cli", "bench", "--url", f"{r.url}/v1",
                              "--model", "no-such-model", "--workload", "shared-system",
                              "--size", "3", "--rate", "20", "--out", str(tmp_path / "out"),
                              "--name", "bad"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert cli.returncode == 1
        bad = json.loads((tmp_path / "out" / "bad.json").read_text())
        assert bad["errors"] == {"HTTP 404 model_not_found": 3} and bad["ok"] == 0
    finally:
        r.close()
        p.close()
        d.close()


def test_scrape_reads_prometheus_and_tolerates_anything_else():
    """`tandem bench` against vllm-router died on its /metrics answer ("Only POST requests are
    supported for transparent proxy") before reporting anything; counters are optional."""
    import http.server
    import threading

    answers = {
        "/a/metrics": (200, '# TYPE tandem_route_decisions counter\n'
                            'tandem_route_decisions_total{plan="disagg"} 4.0\n'
                            'tandem_prompt_tokens_total 100.0\n'),
        "/b/metrics": (200, "Only POST requests are supported for transparent proxy"),
        "/c/metrics": (404, "not found"),
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status, body = answers.get(self.path, (500, "?"))
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        from loadgen.report import scrape

        got = scrape(f"{base}/a/v1")
        assert got['tandem_route_decisions_total{plan="disagg"}'] == 4.0
        assert got["tandem_prompt_tokens_total"] == 100.0
        assert scrape(f"{base}/b/v1") == {} and scrape(f"{base}/c/v1") == {}
        assert scrape("http://127.0.0.1:1/v1") == {}
        # A report from counters that are missing still has every field.
        s = summarize([RequestRecord(0, 0, 0.0, ttft_s=0.1, e2e_s=0.2, completion_tokens=2)], 1.0,
                      SLO(), {}, {})
        assert s["ok"] == 1 and s["prefix_hit_ratio"] is None and s["route_plans"] == {}
    finally:
        server.shutdown()
