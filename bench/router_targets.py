"""What bench/router_overhead.py measures against, each a process in its own session: a fake
worker process per port that serves both P/D protocols instantly (Tandem's /prefill + /generate
and vLLM's /v1/completions with kv_transfer_params), one as a prefill and one as a decode worker,
the decode one called directly (the baseline), and in front of the pair the python-floor proxy,
`tandem router`, and vllm-router and sglang-router where installed. The fake and the proxy are
this script's roles:

    python bench/router_targets.py fake --port P
    python bench/router_targets.py floor --port P --prefill-port P1 --decode-port P2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
sys.path.insert(0, str(ROOT))

from tandem.ports import wait_open  # noqa: E402
from testing.processes import free_port  # noqa: E402


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
    if not wait_open("127.0.0.1", port, timeout, interval_s=0.1):
        raise TimeoutError(f"nothing listening on {port}")


class Targets:
    """The fake prefill and decode workers and each router in front of them: `urls` (each
    target's /v1/completions) and `pids` (the process whose CPU a request costs: the fake decode
    worker's for "direct", the router's otherwise), by name."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen] = []
        self.urls: dict[str, str] = {}
        self.pids: dict[str, int] = {}

    def start(self, tokenizer: Path) -> None:
        """Every target, the routers' with `tokenizer` (a folder), none waited for."""
        logs = self.logs
        fp, fd = free_port(), free_port()
        for p in (fp, fd):
            self.procs.append(spawn([sys.executable, str(SCRIPT), "fake", "--port", str(p)],
                                    logs / f"fake-{p}.log"))
        self.urls["direct"] = f"http://127.0.0.1:{fd}/v1/completions"
        self.pids["direct"] = self.procs[1].pid
        prefill, decode = f"http://127.0.0.1:{fp}", f"http://127.0.0.1:{fd}"
        self._start("python-floor", lambda port: [
            sys.executable, str(SCRIPT), "floor", "--port", str(port), "--prefill-port", str(fp),
            "--decode-port", str(fd)], "floor.log")
        self._start("tandem", lambda port: [
            sys.executable, "-m", "tandem.cli", "router", "--model", "tiny-random",
            "--tokenizer", str(tokenizer), "--block-size", "4", "--port", str(port),
            "--worker", f"prefill={prefill}", "--worker", f"decode={decode}"],
            "tandem-router.log")
        vr = _which("vllm-router")
        if vr:
            self._start("vllm-router", lambda port: [
                vr, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port)])
        sr = _which("sglang-router")
        if sr:
            # PD mode: sends the request to prefill and decode at once (bootstrap fields added);
            # the fake worker's /v1/completions answers both.
            self._start("sglang-router", lambda port: [
                sr, "launch", "--pd-disaggregation", "--prefill", prefill, "--decode", decode,
                "--policy", "round_robin", "--prometheus-port", str(free_port()),
                "--host", "127.0.0.1", "--port", str(port)])

    def _start(self, name: str, cmd, log: str | None = None) -> None:
        port = free_port()
        self.procs.append(spawn(cmd(port), self.logs / (log or f"{name}.log")))
        self.urls[name] = f"http://127.0.0.1:{port}/v1/completions"
        self.pids[name] = self.procs[-1].pid

    def wait_ready(self) -> None:
        for url in self.urls.values():
            wait_port(int(url.split(":")[2].split("/")[0]))
        time.sleep(1.0)

    def stop(self) -> None:
        for p in self.procs:
            os.killpg(p.pid, signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["fake", "floor"])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill-port", type=int, default=0)
    ap.add_argument("--decode-port", type=int, default=0)
    args = ap.parse_args()
    import uvicorn

    app = fake_app() if args.role == "fake" else floor_app(
        f"http://127.0.0.1:{args.prefill_port}/prefill",
        f"http://127.0.0.1:{args.decode_port}/generate")
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="error", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
