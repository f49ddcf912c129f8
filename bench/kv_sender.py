"""The exporting side of bench/kv_transfer.py, a process of its own: it holds a cache of one
layout, serves the cache's KV metadata over HTTP and exports blocks on request. Its protocol is
one JSON line each way on stdin/stdout (answers marked with MARK): first the URL and the cache's
address, then per request the first staged slot of the export (or null).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kv_transfer.connector import KVConnector  # noqa: E402
from kv_transfer.layout import KVLayout  # noqa: E402
from kv_transfer.transport import TransportConfig  # noqa: E402

LAYOUTS = {
    "smollm2": dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float16"),
    "llama3-8b": dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
}
MARK = "@@ "


def make_cache(layout: str, num_blocks: int, device: str) -> torch.Tensor:
    s = LAYOUTS[layout]
    shape = (num_blocks, s["num_layers"], 2, s["block_size"], s["num_kv_heads"], s["head_dim"])
    return torch.ones(shape, dtype=getattr(torch, s["dtype"]), device=device)  # touched: resident


def block_bytes(layout: str) -> int:
    return KVLayout.of_cache(make_cache(layout, 1, "cpu"), layout).bytes_per_block


def transport_config(engine_id: str, staging_blocks: int, layout: str) -> TransportConfig:
    return TransportConfig(engine_id, pull_timeout_s=60,
                           staging_bytes=staging_blocks * block_bytes(layout))


async def sender_main(args) -> None:
    import uvicorn
    from fastapi import FastAPI

    from kv_transfer.metadata_api import metadata_router

    cache = make_cache(args.layout, args.num_blocks, args.device)
    connector = KVConnector(cache, KVLayout.of_cache(cache, args.layout),
                            transport_config(f"bench-{args.transports}-P", args.staging_blocks,
                                             args.layout),
                            args.transports, release=lambda rid: None, watch_interval_s=0.0005,
                            idle_interval_s=0.0005)  # raw reads hold no lease but need progress too
    await connector.start()
    app = FastAPI()
    app.include_router(metadata_router(connector, None))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(MARK + json.dumps({"url": f"http://127.0.0.1:{port}", "base": cache.data_ptr()}),
          flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            break
        cmd = json.loads(line)
        fields = connector.export(cmd["request_id"], cmd["block_ids"], 60)
        print(MARK + json.dumps({"staged_at": fields.get("remote_staging_start")}), flush=True)
    server.should_exit = True
    await task
    await connector.close()


class Sender:
    def __init__(self, transport: str, layout: str, device: str, num_blocks: int,
                 staging_blocks: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--transports", transport, "--layout", layout,
             "--device", device, "--num-blocks", str(num_blocks),
             "--staging-blocks", str(staging_blocks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:  # EOF (the sender died) ends the loop
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError("sender exited")

    def export(self, request_id: str, block_ids: list[int]) -> int | None:
        self.proc.stdin.write(json.dumps({"request_id": request_id, "block_ids": block_ids}) + "\n")
        self.proc.stdin.flush()
        return self._read()["staged_at"]

    def close(self) -> None:
        try:
            self.proc.communicate("\n", timeout=30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="nixl")
    ap.add_argument("--layout", default="smollm2", choices=sorted(LAYOUTS))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--num-blocks", type=int, required=True)
    ap.add_argument("--staging-blocks", type=int, default=0)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(sender_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
