"""The vLLM backend's wire handling, against answers recorded from a real vLLM 0.32 CPU server
with the NixlConnector (tests/router/vllm_capture/; tests/router/test_vllm_backend.py runs the
real servers). One layer only: an aiohttp server replays the recorded bodies and records what
the backend sent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from common.protocol import KVTransferParams, SamplingOptions, TokenLogprob
from router.backend import RequestRejected, Timeouts, WorkerFailure
from router.backends import BACKENDS
from router.vllm_backend import VLLMBackend, _vllm_tokens
from router.worker_info import WorkerInfo
from router.workers import parse_static

CAPTURE = Path(__file__).parent / "vllm_capture"
PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2, 1, 9690, 198, 2683, 359, 253, 19484,
          11173, 30, 2, 198, 1]


def test_static_worker_entries():
    assert parse_static("prefill=http://h:1/") == ("tandem", "prefill", "http://h:1", None)
    assert parse_static("vllm:decode=http://h:2") == ("vllm", "decode", "http://h:2", None)
    assert (parse_static("tandem:colocated=http://h:3")
            == ("tandem", "colocated", "http://h:3", None))
    assert parse_static("vllm:prefill=http://h:1,model=qwen/qwen2.5-7b") == (
        "vllm", "prefill", "http://h:1", "qwen/qwen2.5-7b")
    with pytest.raises(ValueError):
        parse_static("decode=http://h:2,model=bad name")
    for bad in ("decode", "sglang:decode=http://h", "vllm:router=http://h", "=http://h"):
        with pytest.raises(ValueError, match="must look like"):
            parse_static(bad)
    assert set(BACKENDS) == {"tandem", "vllm"}


def test_token_ids_and_logprobs_from_vllm_logprobs():
    lp = {"tokens": ["token_id:4093", "token_id:198"], "token_logprobs": [-0.5, -0.25],
          "top_logprobs": [{"token_id:4093": -0.5, "token_id:520": -6.0}, {"token_id:198": -0.25}]}
    ids, lps = _vllm_tokens(lp, want_lp=True)
    assert ids == [4093, 198]
    assert lps[0] == TokenLogprob(token_id=4093, logprob=-0.5, top=[(4093, -0.5), (520, -6.0)])
    assert _vllm_tokens(lp, want_lp=False) == ([4093, 198], None)
    with pytest.raises(WorkerFailure, match="token_id:N"):
        _vllm_tokens({"tokens": ["hello"]}, want_lp=False)


class Replay:
    """An aiohttp app answering /v1/completions from the capture (or with a given failure)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.bodies: list[dict] = []
        self.headers: list[dict] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.mode == "400":
            return web.json_response({"error": {"message": "max_tokens is too large", "code": 400}},
                                     status=400)
        if self.mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if not body.get("stream"):
            return web.Response(body=(CAPTURE / "prefill.json").read_bytes(),
                                content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        lines = (CAPTURE / "decode.sse").read_bytes().split(b"\n\n")
        if self.mode == "cut":  # the server dies before the finish chunk
            lines = lines[:3]
        for i, chunk in enumerate(lines):
            if chunk.strip():
                await resp.write(chunk + b"\n\n")
            if self.mode == "stall" and i == 2:  # alive but silent past the stall timeout
                await asyncio.sleep(2.5)
        await resp.write_eof()
        return resp

    async def run(self, coro_fn):
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as http:
                backend = VLLMBackend(http, "secret", "smollm2-135m-instruct",
                                      Timeouts(prefill_s=5, stream_stall_s=1, total_s=10))
                w = WorkerInfo("v0", "decode", f"http://127.0.0.1:{port}", backend="vllm")
                return await coro_fn(backend, w)
        finally:
            await runner.cleanup()


def _collect(backend, w, sent=(), logprobs=None, kv=None):
    async def go():
        sampling = SamplingOptions(temperature=0, max_tokens=10, logprobs=logprobs, stop=["\n\n"])
        return [ev async for ev in backend.generate(w, "req-1", PROMPT, list(sent), sampling, kv)]
    return go()


def test_prefill_leg_asks_for_remote_decode_and_returns_vllms_params():
    replay = Replay()

    async def go(backend, w):
        return await backend.prefill(w, "req-1", PROMPT,
                                     SamplingOptions(temperature=0, max_tokens=50))

    out = asyncio.run(replay.run(go))
    recorded = json.loads((CAPTURE / "prefill.json").read_text())["kv_transfer_params"]
    assert out.first_token_id is None and out.num_cached_tokens == 0
    # vLLM's params go on to its decode side exactly as it sent them.
    assert (out.kv_transfer_params.model_dump(mode="json", exclude_unset=True, warnings=False)
            == recorded)
    body = replay.bodies[0]
    assert body["prompt"] == PROMPT and body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert body["return_token_ids"] is True
    assert replay.headers[0]["x-request-id"] == "req-1"
    assert replay.headers[0]["authorization"] == "Bearer secret"


def test_decode_leg_streams_token_ids_and_resumes_after_sent_tokens():
    replay = Replay()
    kv = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e"}
    params = KVTransferParams.model_construct(**kv)

    async def go(backend, w):
        evs = await _collect(backend, w, sent=[11, 12], logprobs=2, kv=params)
        return evs, w.inflight

    events, inflight = asyncio.run(replay.run(go))
    assert [t for ev in events for t in ev.token_ids] == [4093, 198, 57, 5248, 3012, 327]
    assert [ev.finish_reason for ev in events] == [None] * 5 + ["length"]
    assert events[0].logprobs[0].token_id == 4093
    assert events[0].logprobs[0].top[1] == (520, -6.164328098297119)
    assert inflight == 0
    body = replay.bodies[0]
    assert body["prompt"] == PROMPT + [11, 12]  # resume: prompt plus what the client has
    assert body["max_tokens"] == 8
    assert body["kv_transfer_params"] == kv
    assert body["stop"] == ["\n\n"] and body["include_stop_str_in_output"] is True
    assert body["return_tokens_as_token_ids"] is True


@pytest.mark.parametrize("mode,error", [("400", RequestRejected), ("500", WorkerFailure),
                                        ("cut", WorkerFailure), ("stall", WorkerFailure)])
def test_decode_failures_are_typed(mode, error):
    replay = Replay(mode)

    async def go(backend, w):
        with pytest.raises(error) as info:
            await _collect(backend, w)
        return info.value, w.inflight

    err, inflight = asyncio.run(replay.run(go))
    assert inflight == 0
    if mode == "400":
        assert err.status == 400 and "max_tokens is too large" in str(err)


def test_a_dead_vllm_server_is_a_worker_failure():
    async def go():
        async with aiohttp.ClientSession() as http:
            backend = VLLMBackend(http, None, "m", Timeouts(1, 1, 2))
            w = WorkerInfo("v0", "prefill", "http://127.0.0.1:9", backend="vllm")
            with pytest.raises(WorkerFailure):
                await backend.prefill(w, "r", PROMPT, SamplingOptions())
            with pytest.raises(WorkerFailure):
                await backend.probe(w)

    asyncio.run(go())
