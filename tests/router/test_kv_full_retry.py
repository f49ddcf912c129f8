"""A decode worker whose KV cache is full refuses a prompt's import with 503 `out_of_kv_blocks`
(and Retry-After): the router tries another decode worker, else the same one after the
Retry-After, a bounded number of times, instead of failing the request; with no tries left the
client gets a 503 `out_of_kv_blocks` with Retry-After, and neither worker keeps a lease or a
block for it (router/kv_full_retry.py, router/dispatch.py)."""

import asyncio
import concurrent.futures as cf
import random
import signal
import threading
import time
import uuid

import pytest

from common.errors import OUT_OF_KV_BLOCKS
from engine import SamplingParams
from router.backend import KVCacheFull, WorkerFailure
from router.kv_full_retry import KVFullRetry, refused_for_kv
from router.trace import Trace
from router.worker_http import check
from router.worker_info import WorkerInfo
from testing.cluster import Router, Worker
from testing.metrics import series_sum
from tests.polling import wait_for

GREEDY = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
BODY = b'{"error": {"message": "not enough free KV blocks", "code": "out_of_kv_blocks"}}'


def worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, url="http://127.0.0.1:1", role="decode")


# ---- the decision (one layer, its inputs by hand) ---------------------------------------------


def test_a_refusal_carries_its_code_and_retry_after():
    with pytest.raises(WorkerFailure) as e:
        check(worker("d"), 503, BODY, "2")
    assert refused_for_kv(e.value) and e.value.retry_after_s == 2.0
    with pytest.raises(WorkerFailure) as e:
        check(worker("d"), 503, b'{"error": {"code": "draining"}}', None)
    assert not refused_for_kv(e.value) and e.value.retry_after_s is None
    with pytest.raises(WorkerFailure) as e:
        check(worker("d"), 500, b"[1, 2]", "soon")  # not an error object, no number
    assert e.value.code is None and e.value.retry_after_s is None


def full(retry_after_s=0.01):
    return WorkerFailure("d: HTTP 503", 503, OUT_OF_KV_BLOCKS, retry_after_s)


def run(coro):
    return asyncio.run(coro)


def test_another_decode_worker_is_tried_at_once_then_all_after_the_retry_after():
    d1, d2 = worker("d1"), worker("d2")
    live = [d1, d2]

    def next_decoder(tried, model):
        return next((w for w in live if w.worker_id not in tried), None)

    retry, trace = KVFullRetry(next_decoder, max_waits=2, request_timeout_s=60), Trace("disagg")
    t0 = time.monotonic()
    nxt, tried = run(retry.next_try(full(retry_after_s=30), {"d1"}, trace))
    assert nxt is d2 and tried == {"d1"} and time.monotonic() - t0 < 1  # no wait for it
    assert (trace.kv_full_retries, trace.kv_full_waits) == (1, 0)
    nxt, tried = run(retry.next_try(full(), {"d1", "d2"}, trace))  # both refused: wait
    assert nxt is d1 and tried == set()
    assert (trace.kv_full_retries, trace.kv_full_waits) == (2, 1)
    run(retry.next_try(full(), {"d1", "d2"}, trace))
    with pytest.raises(KVCacheFull) as e:  # two waits spent
        run(retry.next_try(full(), {"d1", "d2"}, trace))
    assert e.value.code == OUT_OF_KV_BLOCKS and trace.kv_full_waits == 2


def test_no_wait_runs_past_the_request_deadline():
    retry = KVFullRetry(lambda tried, model: None, max_waits=5, request_timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(KVCacheFull):
        run(retry.next_try(full(retry_after_s=3), set(), Trace("disagg")))
    assert time.monotonic() - t0 < 1  # given up at once: the wait would pass the deadline


# ---- real processes: one decode worker whose cache another import holds ----------------------


def prompts(n, length=41, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def burst(router: Router, batch: list[list[int]]) -> list[cf.Future]:
    """The router's answers to `batch`, asked at once."""
    def ask(prompt):
        return router.client.post("/v1/completions", json={
            "model": "tiny-random", "prompt": prompt, **GREEDY}, timeout=120)

    pool = cf.ThreadPoolExecutor(len(batch))
    futures = [pool.submit(ask, prompt) for prompt in batch]
    pool.shutdown(wait=False)  # they run on; the caller waits for them
    return futures


def answers_of(futures: list[cf.Future]) -> list:
    return [f.result(60) for f in futures]


class Hog:
    """An import into the decode worker that holds 25 of its 32 blocks while its pull stalls:
    the prefill worker it pulls from (registered nowhere: the router never routes to it) is
    stopped (SIGSTOP) until `release`."""

    def __init__(self, src: Worker, d: Worker) -> None:
        self.src, self.d = src, d
        short, long = prompts(1, length=9, seed=3)[0], prompts(1, length=100, seed=4)[0]
        few = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
        pre = src.prefill("warm", short, few)  # a first pull: the peers' handshake is done
        d.generate("warm", short, few, [pre["first_token_id"]], pre["kv_transfer_params"])
        pre = src.prefill("hog", long, few, lease_seconds=60)
        src.proc.send_signal(signal.SIGSTOP)
        self.thread = threading.Thread(target=d.generate, args=(
            "hog", long, few, [pre["first_token_id"]], pre["kv_transfer_params"]))
        self.thread.start()
        wait_for(lambda: series_sum(d.metrics(), "tandem_worker_free_blocks") <= 7, 10,
                 "the hog's blocks")

    def release(self) -> None:
        self.src.proc.send_signal(signal.SIGCONT)
        self.thread.join(30)


@pytest.fixture
def cluster(tiny_folder, tmp_path):
    """Start a router (its extra env), a prefill worker, one decode worker of 32 blocks, and a
    hog on it."""
    started, hogs = [], []

    def start(router_env: dict[str, str]):
        ns, tcp = f"kvfull-{uuid.uuid4().hex[:6]}", ["--transport", "tcp"]
        for role, n, blocks in [("prefill", ns, 256), ("decode", ns, 32), ("prefill", None, 256)]:
            started.append(Worker(role, str(tiny_folder), cache_dir=tmp_path, namespace=n,
                                  num_blocks=blocks, extra=tcp))
        p, d, src = started
        # Every prompt is prefilled on P and imported on D.
        r = Router(tiny_folder, ns, cache_dir=tmp_path,
                   env={"TANDEM_ROUTER_CONDITIONAL_DISAGG": "false", **router_env})
        started.append(r)
        r.wait_workers(2)
        hogs.append(Hog(src, d))
        return r, p, d, hogs[0]

    yield start
    for hog in hogs:
        hog.release()
    for proc in reversed(started):
        proc.close()


def refusals(d: Worker) -> float:
    return series_sum(d.metrics(), "tandem_worker_requests_total", endpoint="generate",
                      status="503")


@pytest.mark.redis
def test_a_full_decode_cache_is_waited_for_not_failed(cluster, reference):
    router, _, d, hog = cluster({})
    batch = prompts(2, seed=1)
    futures = burst(router, batch)
    wait_for(lambda: refusals(d) >= 2, 10, "the imports refused")  # both, at first
    hog.release()  # the hog's pull goes on, it finishes, its blocks are free again
    answers = answers_of(futures)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    for prompt, a in zip(batch, answers, strict=True):
        want = reference.generate(prompt, SamplingParams(**GREEDY))[0].text
        assert a.json()["choices"][0]["text"] == want
    assert series_sum(router.metrics(), "tandem_retries_total", kind="kv_full") >= 2


@pytest.mark.redis
def test_no_tries_left_answers_503_and_frees_everything(cluster):
    router, p, d, hog = cluster({"TANDEM_ROUTER_KV_FULL_WAITS": "0"})
    answers = answers_of(burst(router, prompts(2, seed=2)))
    for a in answers:
        assert a.status_code == 503, a.text
        assert a.headers["Retry-After"] == "1"
        err = a.json()["error"]
        assert err["code"] == OUT_OF_KV_BLOCKS and err["type"] == "service_unavailable"
        assert "KV cache is full" in err["message"]
    assert refusals(d) == 2
    # The prefill worker's leases for the refused imports are cancelled, well before they would
    # run out (30 s); once the hog is done, the decode worker holds nothing.
    wait_for(lambda: series_sum(p.metrics(), "tandem_kv_leased_blocks") == 0, 10, "P's leases")
    assert series_sum(p.metrics(), "tandem_kv_leases_total", outcome="cancelled") == 2
    assert series_sum(p.metrics(), "tandem_worker_held_requests") == 0
    hog.release()
    wait_for(lambda: series_sum(d.metrics(), "tandem_worker_free_blocks") == 32, 10, "D blocks")
