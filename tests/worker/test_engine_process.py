"""Workers with `--engine-process` (the default for colocated CPU workers): the engine core
steps in its own process, the API process serves HTTP and runs the KV transfer over the shared
KV mapping. Real processes, real Redis, real NIXL (or TCP) between a prefill and a decode
worker. Every colocated worker in the suite runs this way by default; the thread engine (the
default for prefill and decode) is tested in tests/worker/test_pd.py and here."""

import concurrent.futures as cf
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import redis

from common.registry import RedisKeys
from engine import SamplingParams
from testing.cluster import Worker, expected_tokens, pd_generate, pd_pair
from testing.redis_server import REDIS_URL

pytestmark = pytest.mark.redis

GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 5, "max_tokens": 16, "ignore_eos": True}
PROC = ["--engine-process"]


def prompts(n, vocab=256):
    return [[(11 * (i + 2) * (j + 3)) % vocab for j in range(7 + 8 * i)] for i in range(n)]


def core_pid(worker: Worker) -> int:
    """The engine-core child of a worker (not multiprocessing's resource tracker)."""
    pid = worker.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return int(child)
    raise AssertionError(f"worker {pid} has no engine-core child among {children}")


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            status = Path(f"/proc/{pid}/stat").read_text().split()[2]
            if status == "Z":  # exited, waiting for its parent to reap it
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def pd(tiny_folder, workdir, namespace):
    with pd_pair(str(tiny_folder), workdir, namespace, PROC) as pair:
        yield pair


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_pd_tokens_equal_one_process_engine(pd, reference, sampling):
    p, d = pd
    for i, prompt in enumerate(prompts(3)):
        tokens, last = pd_generate(p, d, f"proc-{sampling['temperature']}-{i}", prompt, sampling)
        assert tokens == expected_tokens(reference, prompt, sampling)
        # The blocks crossed over the transport, from and into the shared KV mappings.
        assert last["timing"]["transfer_s"] > 0 and last["timing"]["transfer_bytes"] > 0


def test_concurrent_requests_and_every_block_returns(pd, reference):
    p, d = pd
    ps = [[(5 * i + 3 * j) % 256 for j in range(6 + (i % 5) * 4)] for i in range(12)]
    with cf.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda a: pd_generate(p, d, f"pconc-{a[0]}", a[1], GREEDY)[0],
                                enumerate(ps)))
    assert results == [w.token_ids for w in reference.generate(ps, SamplingParams(**GREEDY))]
    time.sleep(0.3)
    end_p, end_d = p.metrics(), d.metrics()
    # The gauges come from the core's stats, carried over the pipe with each step and call.
    assert end_p["tandem_worker_held_requests"] == 0 and end_p["tandem_kv_leased_blocks"] == 0
    assert end_p["tandem_worker_free_blocks"] == 256 and end_d["tandem_worker_free_blocks"] == 256
    assert end_d["tandem_worker_running_requests"] == 0


def test_abort_and_errors_cross_the_process_boundary(pd):
    p, d = pd
    p.prefill("pab-1", prompts(2)[1], GREEDY)
    assert p.metrics()["tandem_worker_held_requests"] == 1
    assert p.client.post("/abort/pab-1").json()["aborted"]
    assert p.metrics()["tandem_worker_held_requests"] == 0
    # A ValueError raised in the core reaches the client as a 400, and the worker stays up.
    r = p.client.post("/prefill", json={"request_id": "bad", "prompt_token_ids": [1, 999999]})
    assert r.status_code == 400 and "token ids must be in" in r.json()["error"]["message"]
    assert p.client.get("/health").status_code == 200


def test_block_events_reach_redis_from_the_core(pd, namespace):
    p, _ = pd
    r = redis.Redis.from_url(REDIS_URL)
    key = RedisKeys(namespace).blocks(p.worker_id)
    before = r.scard(key)
    prompt = [(3 * j + 1) % 256 for j in range(40)]  # ten new full blocks
    p.prefill("pev-1", prompt, GREEDY)
    p.client.post("/abort/pev-1")
    deadline = time.monotonic() + 5
    while r.scard(key) < before + 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.scard(key) == before + 10


def test_no_shared_kv_file_is_left_behind(pd):
    # Both processes map the cache; the file itself is unlinked once they have.
    p, d = pd
    for w in (p, d):
        maps = Path(f"/proc/{core_pid(w)}/maps").read_text()
        assert "tandem-kv-" in maps and "(deleted)" in maps


def test_openai_stream_reports_usage(pd):
    p, _ = pd  # a prefill worker serves plain OpenAI requests too
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with p.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert len(tokens) == 5 and chunks[-1]["choices"] == []
    assert (chunks[-1]["usage"]["completion_tokens"] == 5
            and chunks[-1]["usage"]["prompt_tokens"] > 0)


@pytest.mark.parametrize("mode", [PROC, ["--no-engine-process"]], ids=["process", "thread"])
def test_a_fault_in_the_engine_ends_streams_deregisters_and_exits(tiny_folder, workdir, mode):
    ns = f"test-{uuid.uuid4().hex[:8]}"
    w = Worker("colocated", str(tiny_folder), cache_dir=workdir, namespace=ns,
               extra=[*mode, "--enable-fault-injection"])
    try:
        core = core_pid(w) if mode == PROC else None
        r = redis.Redis.from_url(REDIS_URL)
        assert r.exists(RedisKeys(ns).worker(w.worker_id))
        body = {"prompt": [1, 2, 3], "max_tokens": 100000, "ignore_eos": True, "stream": True}
        with w.client.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert w.client.post("/debug/engine-fault").status_code == 200
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        # Headers were sent: the stream ends with an OpenAI error event, not a cut connection.
        assert rest and json.loads(rest[-1])["error"]["code"] == 503
        assert w.proc.wait(20) == 1
        assert core is None or gone(core, 10)
        assert not r.exists(RedisKeys(ns).worker(w.worker_id), RedisKeys(ns).blocks(w.worker_id))
    finally:
        w.close()


def test_killed_core_takes_the_worker_down(tiny_folder, workdir):
    w = Worker("colocated", str(tiny_folder), cache_dir=workdir)  # a process by default
    try:
        os.kill(core_pid(w), signal.SIGKILL)
        # Not a zombie that answers 503 forever: the worker exits for its supervisor.
        assert w.proc.wait(20) == 1
    finally:
        w.close()


def test_killed_worker_leaves_no_orphan_core(tiny_folder, workdir):
    w = Worker("colocated", str(tiny_folder), cache_dir=workdir, extra=PROC)
    try:
        core = core_pid(w)
        w.kill(signal.SIGKILL)
        assert gone(core, 10)  # its end of the pipe closed: the core exits by itself
    finally:
        w.close()
