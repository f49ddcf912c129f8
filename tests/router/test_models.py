"""Many models behind one router (issue 17): SmolLM2 and tiny-random workers (a prefill and a
decode worker each) register in one Redis namespace; one `tandem router` with no --model serves
both, routes each request only among its model's workers, and refuses a worker that claims a
served name with another model's identity."""

from __future__ import annotations

import shutil
import time
import uuid

import httpx
import pytest

from testing.cluster import Router, Worker
from testing.metrics import scrape, series_sum

SMOL = "smollm2-135m-instruct"
TINY = "tiny-random"
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def fleet(tiny_folder, smollm2_folder, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fleet")
    ns = f"models-{uuid.uuid4().hex[:8]}"
    started: list = []
    try:
        for role in ("prefill", "decode"):
            started.append(Worker(role, str(smollm2_folder), cache_dir=workdir, namespace=ns,
                                  block_size=16, num_blocks=128, extra=["--threads", "1"]))
            started.append(Worker(role, str(tiny_folder), cache_dir=workdir, namespace=ns))
        router = Router(None, ns, cache_dir=workdir, extra=["--expose-worker-ids"])
        started.append(router)
        router.wait_workers(4, timeout=60, models=2)
        workers = {w.worker_id: w for w in started if isinstance(w, Worker)}
        by_model = {SMOL: {w.worker_id for w in started[0:4:2]},
                    TINY: {w.worker_id for w in started[1:4:2]}}
        yield router, workers, by_model, workdir, ns
    finally:
        for p in reversed(started):
            p.close()


def test_models_lists_every_model_with_live_workers(fleet):
    router, *_ = fleet
    data = router.client.get("/v1/models").json()["data"]
    assert sorted(m["id"] for m in data) == [SMOL, TINY]
    assert all(m["max_model_len"] > 0 and m["object"] == "model" for m in data)
    one = router.client.get(f"/v1/models/{TINY}")
    assert one.status_code == 200 and one.json()["id"] == TINY
    missing = router.client.get("/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    r = router.client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and SMOL in r.json()["error"]["message"]


def test_each_request_reaches_only_its_models_workers(fleet):
    router, workers, by_model, *_ = fleet
    for model, n in ((SMOL, 2), (TINY, 3)):
        for i in range(n):
            r = router.client.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": f"hello {i}"}],
                "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == model
            t = body["tandem"]
            assert (t["plan"] == "disagg"
                    and {t["prefill_worker"], t["decode_worker"]} <= by_model[model])
    # The workers' own counters agree: each model's workers served exactly its requests.
    for model, n in ((SMOL, 2), (TINY, 3)):
        for wid in by_model[model]:
            m = workers[wid].metrics()
            endpoint = "prefill" if wid.startswith("prefill") else "generate"
            key = (f'tandem_worker_requests_total{{endpoint="{endpoint}",model="{model}",'
                   'status="200"}')
            assert m.get(key) == n, (wid, {k: v for k, v in m.items() if "worker_requests" in k})
            assert any(k.startswith("vllm:num_requests_running") and f'model_name="{model}"' in k
                       for k in m)
    m = router.metrics()
    assert m[f'tandem_requests_total{{model="{SMOL}",status="200"}}'] >= 2
    assert m[f'tandem_requests_total{{model="{TINY}",status="200"}}'] >= 3
    assert m[f'tandem_route_decisions_total{{model="{TINY}",plan="disagg"}}'] >= 3


def test_smollm2_greedy_answers_equal_the_engine(fleet, smollm2_folder):
    from engine import LLM, SamplingParams

    router, *_ = fleet
    r = router.client.post("/v1/chat/completions", json={
        "model": SMOL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    llm = LLM(str(smollm2_folder), num_blocks=64, block_size=16)
    want = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24))[0].text
    assert r.json()["choices"][0]["message"]["content"] == want


def test_a_worker_with_another_identity_under_a_served_name_is_refused(fleet, tiny_folder):
    router, workers, by_model, workdir, ns = fleet
    # Same weights, another config file: another model identity claiming the name tiny-random.
    other = workdir / "tiny-random-v2"
    shutil.copytree(tiny_folder, other)
    (other / "generation_config.json").write_text('{"temperature": 0.5}')
    before = router.metrics().get(
        'tandem_worker_registrations_refused_total{reason="model_identity"}', 0)
    impostor = Worker("decode", str(other), cache_dir=workdir, namespace=ns,
                      extra=["--served-model-name", TINY])
    try:
        for _ in range(50):
            m = router.metrics()
            if (m.get('tandem_worker_registrations_refused_total{reason="model_identity"}', 0)
                    > before):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the router never refused the impostor")
        assert impostor.worker_id not in router.client.get("/ready").json()["workers"]
        for i in range(4):
            r = router.client.post("/v1/completions", json={
                "model": TINY, "prompt": f"impostor {i}", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["tandem"]["decode_worker"] in by_model[TINY]
        assert ("refused for model 'tiny-random'"
                in (workdir / f"router-{router.port}.log").read_text())
        assert scrape(impostor.client).get(
            f'tandem_worker_requests_total{{endpoint="generate",model="{TINY}",status="200"}}',
            0) == 0
    finally:
        impostor.close()


def test_workers_export_vllm_metric_names(fleet):
    _, workers, by_model, *_ = fleet
    for wid in by_model[TINY]:
        m = workers[wid].metrics()
        label = {"model_name": TINY}
        assert series_sum(m, "vllm:kv_cache_usage_perc", **label) >= 0
        assert any(k.startswith("vllm:num_requests_waiting") for k in m)
        if wid.startswith("prefill"):
            assert series_sum(m, "vllm:time_to_first_token_seconds_count", **label) >= 3
            assert series_sum(m, "vllm:prefix_cache_queries_total", **label) > 0
        else:  # the decode leg streams the tokens after the first and ends the requests
            assert series_sum(m, "vllm:inter_token_latency_seconds_count", **label) > 0
            assert series_sum(m, "vllm:request_success_total", **label) >= 3
            assert not any(f'model_name="{SMOL}"' in k for k in m)


def test_every_status_the_router_answers_is_counted(tiny_folder, tmp_path):
    # No Redis, one static decode worker that is down: every request ends in an error.
    r = Router(tiny_folder, None, cache_dir=tmp_path, redis_url=None, extra=[
        "--api-key", "k", "--rate-limit-rpm", "5", "--max-body-bytes", "4096",
        "--worker", "decode=http://127.0.0.1:1"])
    try:
        for _ in range(100):
            try:
                if r.client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        auth = {"Authorization": "Bearer k"}
        ok_body = {"model": TINY, "prompt": "hello", "max_tokens": 2}
        want = [(401, {}, ok_body), (413, auth, {"model": TINY, "prompt": "x" * 5000}),
                (400, auth, {"model": TINY, "prompt": "hi", "max_tokens": -1}),
                (404, auth, {**ok_body, "model": "nope"}),
                (503, auth, ok_body), (503, auth, ok_body), (503, auth, ok_body),
                (429, auth, ok_body)]
        for status, headers, body in want:
            resp = r.client.post("/v1/completions", headers=headers, json=body)
            assert resp.status_code == status, (status, resp.text)
            assert "error" in resp.json()
        m = r.metrics()
        for status, model, n in (("401", "", 1), ("413", "", 1), ("400", "", 1), ("404", "", 1),
                                 ("429", "", 1), ("503", TINY, 3), ("500", "", 0),
                                 ("200", TINY, 0)):
            key = f'tandem_requests_total{{model="{model}",status="{status}"}}'
            assert m.get(key) == n, (key, {k: v for k, v in m.items() if "requests_total" in k})
    finally:
        r.close()
