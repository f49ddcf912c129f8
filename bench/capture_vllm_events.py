"""Golden KV events from a real vLLM CPU server, for vllm_bridge's tests (CI needs no vLLM).

    .venv/bin/python bench/capture_vllm_events.py [--out tests/vllm_bridge/golden]

Starts one vLLM server from .venv-vllm (`bash bench/setup_vllm_cpu.sh`; ~2 min to healthy on two
cores) with SmolLM2 (`tandem prepare-model`), KV events on a ZMQ PUB socket and the replay ROUTER
socket, block size 32 and 68 blocks so that eviction is reachable, and subscribes with pyzmq.
Then, greedy, one at a time:

    r1      chat: a system prompt and a question (return_token_ids)
    r2      the follow-up turn: r1's messages, r1's answer, a new question (a prefix hit)
    r3      r2 again, 1 token, `vllm_xargs: {"kv_cache_report_mode": "full"}` (re-reports r2's
            whole cached prefix with parent None)
    r4      a completion of 2000 unrelated token ids, 1 token: needs 63 of the 68 blocks, so
            vLLM evicts
    reset   POST /reset_prefix_cache (a dev route: VLLM_SERVER_DEV_MODE=1), then
    r5      a 5-token completion: vLLM publishes the AllBlocksCleared queued by the reset only
            at its next engine step

Written to the output folder (each a few KB to ~60 KB):
    events.jsonl     one line per batch as it arrived: seq, topic, payload (base64)
    requests.jsonl   one line per request: its body (token prompts in full), the prompt and
                     output token ids vLLM returned, usage (with prompt_tokens_details)
    replay.json      what the replay socket answered for a start seq of 0, one in the middle,
                     and one past the end: every message's frames (base64)
    server.json      the vLLM version, the flags, `vllm:cache_config_info`'s labels from
                     /metrics, GET /kv_event_sources, and the prefix cache counters
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.model_store import prepare_smollm2  # noqa: E402
from testing.processes import free_port, wait_http_ok  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("TANDEM_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
MODEL = "smollm2-135m-instruct"
TOPIC = f"kv@vllm0@{MODEL}"
BLOCK_SIZE = 32
NUM_BLOCKS = 68
LONG_PROMPT_TOKENS = 2000  # 63 blocks of 32 with the one token it generates: forces eviction
END_SEQ = (-1).to_bytes(8, "big", signed=True)

SYSTEM = ("You are the station assistant of a small railway. Answer in one or two sentences. "
          "Trains leave every twenty minutes from platform two; bicycles travel free outside "
          "rush hour; dogs need a half-price ticket; the last train leaves at 23:40.")
QUESTION_1 = "Can I bring my dog on the train, and what does it cost?"
QUESTION_2 = "And my bicycle, at eight in the morning?"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Subscriber(threading.Thread):
    """Every (topic, seq, payload) vLLM publishes, as it arrives."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(100):
                continue
            frames = self.sock.recv_multipart()
            topic, seq, payload = frames if len(frames) == 3 else (b"", b"", b"")
            self.batches.append({"seq": int.from_bytes(seq, "big"), "topic": topic.decode(),
                                 "payload": b64(payload), "num_frames": len(frames),
                                 "received": time.time()})
        self.sock.close(linger=0)


def replay(ctx: zmq.Context, endpoint: str, start: int, timeout_s: float = 10.0) -> list[list[str]]:
    """What the replay ROUTER sends a DEALER for `start`: each message's frames (after the
    empty delimiter), up to and including the end marker (seq -1)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(200):
                continue
            frames = sock.recv_multipart()
            out.append([b64(f) for f in frames])
            if END_SEQ in frames:
                return out
        raise TimeoutError(f"no end marker from the replay socket for start {start}: {out}")
    finally:
        sock.close(linger=0)


def post(client: httpx.Client, path: str, body: dict, name: str, log: list[dict]) -> dict:
    t0 = time.time()
    r = client.post(path, json=body)
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    log.append({"name": name, "path": path, "body": body, "started": t0, "ended": time.time(),
                "prompt_token_ids": out.get("prompt_token_ids") or choice.get("prompt_token_ids"),
                "output_token_ids": choice.get("token_ids"),
                "text": choice.get("message", {}).get("content") if "message" in choice
                else choice.get("text"),
                "usage": out.get("usage")})
    print(f"{name}: {len(log[-1]['prompt_token_ids'] or [])} prompt tokens, usage "
          f"{out.get('usage')}", flush=True)
    return out


def drive(client: httpx.Client) -> list[dict]:
    log: list[dict] = []
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION_1}]
    chat = {"model": MODEL, "temperature": 0, "return_token_ids": True}
    r1 = post(client, "/v1/chat/completions", {**chat, "messages": messages, "max_tokens": 40},
              "r1", log)
    messages = [*messages, {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                {"role": "user", "content": QUESTION_2}]
    post(client, "/v1/chat/completions", {**chat, "messages": messages, "max_tokens": 20},
         "r2", log)
    post(client, "/v1/chat/completions",
         {**chat, "messages": messages, "max_tokens": 1,
          "vllm_xargs": {"kv_cache_report_mode": "full"}}, "r3", log)
    long_ids = [(1000 + 7919 * i) % 49152 for i in range(LONG_PROMPT_TOKENS)]
    post(client, "/v1/completions", {"model": MODEL, "prompt": long_ids, "max_tokens": 1,
                                     "temperature": 0, "return_token_ids": True}, "r4", log)
    reset = client.post("/reset_prefix_cache")
    log.append({"name": "reset", "path": "/reset_prefix_cache", "status": reset.status_code,
                "answer": reset.text, "started": time.time()})
    post(client, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 1,
                                     "temperature": 0, "return_token_ids": True}, "r5", log)
    return log


def server_facts(client: httpx.Client) -> dict:
    metrics = client.get("/metrics").text
    info = next((line for line in metrics.splitlines()
                 if line.startswith("vllm:cache_config_info{")), None)
    labels = dict(re.findall(r'([a-zA-Z_]+)="([^"]*)"', info)) if info else None
    counters = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
                for line in metrics.splitlines()
                if line.startswith(("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"))}
    sources = client.get("/kv_event_sources")
    return {"cache_config_info": labels, "cache_config_info_line": info,
            "kv_event_sources": {"status": sources.status_code, "body": sources.text},
            "prefix_cache_counters": counters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "vllm_bridge" / "golden")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for vLLM to start")
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit(f"no vLLM venv at {VLLM_PYTHON}: run `bash bench/setup_vllm_cpu.sh`")
    folder = prepare_smollm2()
    port, pub, rep = free_port(), free_port(), free_port()
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://*:{pub}",  # vLLM binds only on a wildcard (or ipc)
                     "replay_endpoint": f"tcp://*:{rep}", "topic": TOPIC, "buffer_steps": 1000}
    flags = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
             "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
             "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
             "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events_config)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_SERVER_DEV_MODE": "1"}
    version = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, env=env).stdout.strip()
    log_path = Path(tempfile.mkdtemp(prefix="vllm-capture-")) / "vllm.log"
    print(f"vLLM {version} on :{port}, events :{pub}, replay :{rep}; log {log_path}", flush=True)
    ctx = zmq.Context()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                                 "--model", str(folder), *flags], env=env, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            t0 = time.monotonic()
            url = f"http://127.0.0.1:{port}"
            wait_http_ok(proc, log_path, lambda: httpx.get(f"{url}/health", timeout=2), "vLLM",
                         args.timeout, interval=1)
            print(f"healthy after {time.monotonic() - t0:.0f} s", flush=True)
            sub = Subscriber(ctx, f"tcp://127.0.0.1:{pub}")
            sub.start()
            time.sleep(0.5)  # the SUB's subscription reaches the PUB before the first event
            with httpx.Client(base_url=url, timeout=300) as client:
                requests = drive(client)
                facts = server_facts(client)
            replays = {"0": replay(ctx, f"tcp://127.0.0.1:{rep}", 0)}
            last = len(replays["0"]) - 2  # every batch, then the end marker
            deadline = time.monotonic() + 10
            while (not sub.batches or sub.batches[-1]["seq"] < last) and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            sub.stop.set()
            sub.join(5)
            replays[str(last // 2)] = replay(ctx, f"tcp://127.0.0.1:{rep}", last // 2)
            replays[str(last + 1)] = replay(ctx, f"tcp://127.0.0.1:{rep}", last + 1)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            ctx.destroy(linger=0)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "events.jsonl", "w") as f:
        f.writelines(json.dumps(b) + "\n" for b in sub.batches)
    with open(args.out / "requests.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in requests)
    (args.out / "replay.json").write_text(json.dumps(replays, indent=1) + "\n")
    server = {"vllm_version": version, "model": MODEL, "topic": TOPIC, "block_size": BLOCK_SIZE,
              "num_gpu_blocks_override": NUM_BLOCKS, "flags": flags,
              "env": {k: env[k] for k in ("HF_HUB_OFFLINE", "VLLM_CPU_KVCACHE_SPACE",
                                          "VLLM_SERVER_DEV_MODE")}, **facts}
    (args.out / "server.json").write_text(json.dumps(server, indent=1) + "\n")
    print(f"{len(sub.batches)} batches (replay from 0: {len(replays['0']) - 1}) -> {args.out}")


if __name__ == "__main__":
    main()
