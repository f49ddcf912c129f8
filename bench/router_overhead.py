"""Latency the router adds, against a fast fake worker process, at fixed request rates.

    .venv/bin/python bench/router_overhead.py [--rates 50,200,500] [--seconds 5]

One fake worker process serves both P/D protocols instantly (Tandem's /prefill + /generate and
vLLM's /v1/completions with kv_transfer_params), as a prefill and as a decode worker on two ports.
In the same run, open-loop Poisson arrivals of non-streaming /v1/completions go to:
  direct       the fake decode worker itself (baseline)
  python-floor the least a Python router can add: a raw-ASGI proxy (uvicorn + aiohttp, no
               validation, tokenizing or routing) making the same two hops as tandem
  tandem       `tandem router` (kv_aware, P/D plan, static workers, in-process index)
  vllm-router  `vllm-router --vllm-pd-disaggregation` (if installed)
  sglang-router `sglang-router launch --pd-disaggregation` (if installed)
and the added latency is p50/p99 of each minus the direct run's, plus each router process's CPU
time per request (/proc). JSON: bench/results/router_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpu_meter import cpu_seconds  # noqa: E402 - bench/ is on sys.path when run as a script
from provenance import write_result  # noqa: E402

from testing.processes import free_port  # noqa: E402

WARMUP = 20


def fake_app():
    app = FastAPI()
    kv = {"do_remote_prefill": True, "remote_engine_id": "fake", "remote_block_ids": [1],
          "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "x"}

    @app.get("/health")
    @app.get("/ready")
    async def health():
        return {"status": "ok"}

    @app.post("/prefill")
    async def prefill(request: Request):
        body = await request.json()
        return {"request_id": body["request_id"], "first_token_id": 42, "num_cached_tokens": 0,
                "kv_transfer_params": kv, "finish_reason": None}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        line = json.dumps({"request_id": body["request_id"], "token_ids": [43],
                           "finish_reason": "length"}) + "\n"
        # One NDJSON line, sent whole: a StreamingResponse over a sync iterator would add a
        # threadpool hop that the other routers' /v1/completions leg does not pay.
        return Response(line.encode(), media_type="application/x-ndjson")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        out = {"id": "x", "object": "text_completion", "created": 0, "model": body.get("model"),
               "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
               "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            out["kv_transfer_params"] = kv
        return JSONResponse(out)

    @app.get("/server_info")
    @app.get("/get_server_info")
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def info():  # sglang-router probes these
        return {"model_path": "tiny-random", "tokenizer_path": None, "is_generation": True}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny-random", "object": "model"}]}

    return app


def run_fake(port: int) -> None:
    import uvicorn

    uvicorn.run(fake_app(), host="127.0.0.1", port=port, log_level="error", access_log=False)


def floor_app(prefill_url: str, decode_url: str):
    """The same two hops as Tandem's router with nothing else: what the Python HTTP stack alone
    costs (uvicorn's server side plus aiohttp's client side)."""
    import aiohttp
    import orjson

    state: dict = {}
    json_header = {"Content-Type": "application/json"}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["http"] = aiohttp.ClientSession()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await state["http"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        req = {"request_id": os.urandom(8).hex(), "prompt_token_ids": [1, 2, 3],
               "max_tokens": orjson.loads(body).get("max_tokens")}
        http = state["http"]
        async with http.post(prefill_url, data=orjson.dumps(req), headers=json_header) as r:
            orjson.loads(await r.read())
        async with http.post(decode_url, data=orjson.dumps(req), headers=json_header) as r:
            token_ids = orjson.loads((await r.read()).splitlines()[-1])["token_ids"]
        out = {"id": req["request_id"], "object": "text_completion", "choices": [
            {"index": 0, "text": "ok", "token_ids": token_ids, "finish_reason": "length"}]}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": orjson.dumps(out)})

    return app


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {port}")


async def load(url: str, rate: float, seconds: float, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    body = {"model": "tiny-random", "prompt": "hello router", "max_tokens": 2, "temperature": 0}
    latencies: list[float] = []
    errors = 0
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=500)) as client:
        for _ in range(WARMUP):  # warm connections and caches
            await client.post(url, json=body)

        async def one() -> None:
            nonlocal errors
            t = time.perf_counter()
            try:
                r = await client.post(url, json=body)
                if r.status_code != 200:
                    errors += 1
                    return
            except httpx.HTTPError:
                errors += 1
                return
            latencies.append(time.perf_counter() - t)

        tasks = []
        start = time.perf_counter()
        next_at = start
        while next_at - start < seconds:
            next_at += rng.expovariate(rate)
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    latencies.sort()
    return {"requests": len(tasks), "errors": errors, "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": latencies[max(int(len(latencies) * 0.99) - 1, 0)] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,200,500")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--role", default="bench")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--prefill-port", type=int, default=0)
    ap.add_argument("--decode-port", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "router_overhead.json"))
    args = ap.parse_args()
    if args.role == "fake":
        run_fake(args.port)
        return 0
    if args.role == "floor":
        import uvicorn

        uvicorn.run(floor_app(f"http://127.0.0.1:{args.prefill_port}/prefill",
                              f"http://127.0.0.1:{args.decode_port}/generate"),
                    host="127.0.0.1", port=args.port, log_level="error", access_log=False)
        return 0
    from engine.tiny import build_tiny_random  # only to have a tokenizer folder

    logs = ROOT / "bench" / "results"
    logs.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_random(logs / "tiny-random")
    fp, fd = free_port(), free_port()
    procs = [spawn([sys.executable, __file__, "--role", "fake", "--port", str(p)],
                   logs / f"fake-{p}.log")
             for p in (fp, fd)]
    targets = {"direct": f"http://127.0.0.1:{fd}/v1/completions"}
    pids = {"direct": procs[1].pid}
    flp = free_port()
    procs.append(spawn([sys.executable, __file__, "--role", "floor", "--port", str(flp),
                        "--prefill-port", str(fp), "--decode-port", str(fd)], logs / "floor.log"))
    targets["python-floor"] = f"http://127.0.0.1:{flp}/v1/completions"
    pids["python-floor"] = procs[-1].pid
    tp = free_port()
    procs.append(spawn([sys.executable, "-m", "tandem.cli", "router", "--model", "tiny-random",
                        "--tokenizer", str(tok), "--block-size", "4", "--port", str(tp),
                        "--worker", f"prefill=http://127.0.0.1:{fp}",
                        "--worker", f"decode=http://127.0.0.1:{fd}"], logs / "tandem-router.log"))
    targets["tandem"] = f"http://127.0.0.1:{tp}/v1/completions"
    pids["tandem"] = procs[-1].pid
    vr = (shutil.which("vllm-router")
          or shutil.which("vllm-router", path=str(Path(sys.executable).parent)))
    if vr:
        vp = free_port()
        procs.append(spawn([vr, "--vllm-pd-disaggregation", "--prefill", f"http://127.0.0.1:{fp}",
                            "--decode", f"http://127.0.0.1:{fd}", "--policy", "round_robin",
                            "--host", "127.0.0.1", "--port", str(vp)], logs / "vllm-router.log"))
        targets["vllm-router"] = f"http://127.0.0.1:{vp}/v1/completions"
        pids["vllm-router"] = procs[-1].pid
    sr = (shutil.which("sglang-router")
          or shutil.which("sglang-router", path=str(Path(sys.executable).parent)))
    if sr:
        sp = free_port()
        # PD mode: sends the request to prefill and decode at once (bootstrap fields added); the
        # fake worker's /v1/completions answers both.
        procs.append(spawn([sr, "launch", "--pd-disaggregation", "--prefill", f"http://127.0.0.1:{fp}",
                            "--decode", f"http://127.0.0.1:{fd}", "--policy", "round_robin",
                            "--prometheus-port", str(free_port()),
                            "--host", "127.0.0.1", "--port", str(sp)],
                           logs / "sglang-router.log"))
        targets["sglang-router"] = f"http://127.0.0.1:{sp}/v1/completions"
        pids["sglang-router"] = procs[-1].pid
    result: dict = {"cpus": os.cpu_count(), "seconds_per_rate": args.seconds, "runs": {}}
    try:
        for url in targets.values():
            wait_port(int(url.split(":")[2].split("/")[0]))
        time.sleep(1.0)
        for rate in [float(r) for r in args.rates.split(",")]:
            row = {}
            for name, url in targets.items():
                cpu0 = cpu_seconds(pids[name])
                row[name] = asyncio.run(load(url, rate, args.seconds, seed=int(rate)))
                # The fake decode worker's own CPU for "direct"; the router process's otherwise.
                row[name]["cpu_ms_per_request"] = round(
                    (cpu_seconds(pids[name]) - cpu0) / (row[name]["requests"] + WARMUP) * 1e3, 3)
                print(json.dumps({"rate": rate, name: row[name]}), file=sys.stderr)
            base = row["direct"]
            for name in targets:
                if name != "direct":
                    row[name]["added_p50_ms"] = row[name]["p50_ms"] - base["p50_ms"]
                    row[name]["added_p99_ms"] = row[name]["p99_ms"] - base["p99_ms"]
            result["runs"][str(int(rate))] = row
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
