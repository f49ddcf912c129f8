"""A KV-transfer peer process for the tests: a seeded KV cache, a KVConnector, the real
`GET /kv/metadata` endpoint over uvicorn, driven by JSON lines on stdin / stdout so it also works
inside a network namespace the test process cannot reach.

    python -m tests.kv_transfer.peer --transport nixl --engine-id P --host 127.0.0.1 --port 0 ...

Commands: export, cancel, pull, state, digest, netdev, quit (see `handle`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys

import torch
import uvicorn
import xxhash
from fastapi import FastAPI

from kv_transfer.connector import KVConnector
from kv_transfer.layout import KVLayout
from kv_transfer.metadata_api import metadata_router
from kv_transfer.transport import TransferError, TransportConfig

# Replies are marked: NIXL and UCX write their own log lines to stdout too.
PREFIX = "@@ "
SHAPE = dict(num_layers=4, block_size=16, num_kv_heads=3, head_dim=64)


def make_cache(num_blocks: int, seed: int, dtype=torch.float16,
               block_size: int | None = None) -> torch.Tensor:
    """Seeded cache content; the tests rebuild it to know every expected byte."""
    s = SHAPE
    g = torch.Generator().manual_seed(seed)
    bs = block_size or s["block_size"]
    shape = (num_blocks, s["num_layers"], 2, bs, s["num_kv_heads"], s["head_dim"])
    return torch.randn(shape, generator=g).to(dtype)


def block_digests(cache: torch.Tensor) -> list[str]:
    cache = cache.cpu()
    out = []
    for b in range(cache.shape[0]):
        out.append(xxhash.xxh3_64_hexdigest(cache[b].contiguous().view(torch.uint8).numpy().tobytes()))
    return out


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token", default=None)
    ap.add_argument("--lease-seconds", type=float, default=30.0)
    ap.add_argument("--model-id", default="test-model")
    ap.add_argument("--block-size", type=int, default=SHAPE["block_size"])
    ap.add_argument("--pull-timeout", type=float, default=10.0)
    ap.add_argument("--ucx-proto-log", default=None)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--chunk-bytes", type=int, default=16 << 20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--staging", default="auto")
    ap.add_argument("--staging-bytes", type=int, default=512 << 20)
    ap.add_argument("--pipeline-part-bytes", type=int, default=0,
                    help="nixl: READ parts (0: default)")
    args = ap.parse_args()
    cache = make_cache(args.num_blocks, args.seed, block_size=args.block_size).to(args.device)
    layout = KVLayout.of_cache(cache, args.model_id)
    released: list[str] = []
    config = TransportConfig(engine_id=args.engine_id, token=args.token, listen_host=args.host,
                             pull_timeout_s=args.pull_timeout, ucx_proto_log=args.ucx_proto_log,
                             fp8=args.fp8, chunk_bytes=args.chunk_bytes, staging=args.staging,
                             staging_bytes=args.staging_bytes)
    connector = KVConnector(cache, layout, config, args.transport, released.append,
                            lease_seconds=args.lease_seconds)
    await connector.start()
    if args.pipeline_part_bytes:
        connector.transport.pipeline_part_bytes = args.pipeline_part_bytes
    app = FastAPI()
    app.include_router(metadata_router(connector, args.token))
    port = args.port or free_port(args.host)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="warning"))
    serve_task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)

    async def handle(cmd: dict) -> dict:
        op = cmd["cmd"]
        if op == "export":
            return connector.export(cmd["request_id"], cmd["block_ids"], cmd.get("lease_seconds"))
        if op == "cancel":
            return {"cancelled": connector.cancel_export(cmd["request_id"])}
        if op == "pull":
            try:
                peer = await connector.peer(cmd.get("engine_id"), cmd["url"])
                stats = await connector.fetch(peer, cmd["request_id"], cmd["remote_block_ids"],
                                              cmd["local_block_ids"], cmd.get("staged_slots"))
            except (TransferError, ValueError) as e:
                return {"error": type(e).__name__, "message": str(e)}
            return {"num_bytes": stats.num_bytes, "seconds": stats.seconds,
                    "num_descriptors": stats.num_descriptors, "label": stats.transport_label,
                    "plan": stats.extra.get("plan"), "phases_us": stats.extra.get("phases_us")}
        if op == "state":
            lt = connector.leases
            staging = getattr(connector.transport, "staging", None)
            return {"leases": len(lt), "released": released, "granted": lt.num_granted,
                    "notified": lt.num_notified, "expired": lt.num_expired,
                    "label": connector.transport.label,
                    "staging_slots": None if staging is None else staging.num_leased_slots,
                    "staging_leases": None if staging is None else staging.num_leases}
        if op == "digest":
            return {"digests": block_digests(cache)}
        if op == "blocks":  # raw values of a few blocks, for lossy (fp8) comparisons
            return {"values": cache[cmd["block_ids"]].float().cpu().tolist()}
        if op == "netdev":
            return {"netdev": open("/proc/net/dev").read()}
        raise ValueError(f"unknown command {op}")

    print(PREFIX + json.dumps({"ready": True, "url": f"http://{args.host}:{port}", "port": port}),
          flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or json.loads(line)["cmd"] == "quit":
            break
        try:
            reply = await handle(json.loads(line))
        except Exception as e:  # noqa: BLE001 - report, keep serving
            reply = {"error": type(e).__name__, "message": str(e)}
        print(PREFIX + json.dumps(reply), flush=True)
    server.should_exit = True
    await serve_task
    await connector.close()


if __name__ == "__main__":
    asyncio.run(main())
