"""KV transfer bandwidth between two processes on the SmolLM2 layout (30 layers, 3 KV heads,
head_dim 64, block_size 16, float16: 368,640 bytes a block).

    .venv/bin/python bench/kv_transfer.py [--sizes 1,16,256,4096] [--transports nixl,tcp]

For each size it pulls scattered (random) and contiguous block ids through the real
`KVConnector` (descriptor lists, notifications, leases) and compares with, in the same run, a raw
single-descriptor NIXL READ of the same number of bytes and a local `tensor.copy_`. The fixed
cost per transfer is the intercept of a least-squares fit time = fixed + bytes / bandwidth.
Prints JSON and writes bench/results/kv_transfer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kv_transfer.connector import KVConnector  # noqa: E402
from kv_transfer.layout import KVLayout  # noqa: E402
from kv_transfer.transport import TransportConfig  # noqa: E402

SMOLLM2 = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
MARK = "@@ "


def make_cache(num_blocks: int) -> torch.Tensor:
    s = SMOLLM2
    shape = (num_blocks, s["num_layers"], 2, s["block_size"], s["num_kv_heads"], s["head_dim"])
    return torch.ones(shape, dtype=torch.float16)  # touched, so pages are resident


async def sender_main(transport: str, num_blocks: int) -> None:
    import uvicorn
    from fastapi import FastAPI

    from kv_transfer.metadata_api import metadata_router

    cache = make_cache(num_blocks)
    connector = KVConnector(cache, KVLayout.of_cache(cache, "smollm2-135m-instruct"),
                            TransportConfig(engine_id=f"bench-{transport}-P"), transport,
                            release=lambda rid: None, watch_interval_s=0.0005,
                            idle_interval_s=0.0005)  # raw reads hold no lease but need progress too
    await connector.start()
    app = FastAPI()
    app.include_router(metadata_router(connector, None))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(MARK + json.dumps({"url": f"http://127.0.0.1:{port}", "base": cache.data_ptr()}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            break
        cmd = json.loads(line)
        connector.export(cmd["request_id"], cmd["block_ids"], 60)
        print(MARK + json.dumps({"ok": True}), flush=True)
    server.should_exit = True
    await task
    await connector.close()


class Sender:
    def __init__(self, transport: str, num_blocks: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--role", "sender", "--transports", transport,
             "--num-blocks", str(num_blocks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError("sender exited")

    def export(self, request_id: str, block_ids: list[int]) -> None:
        self.proc.stdin.write(json.dumps({"request_id": request_id, "block_ids": block_ids}) + "\n")
        self.proc.stdin.flush()
        self._read()

    def close(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait(30)


def fit_fixed_cost(points: list[tuple[int, float]]) -> dict:
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    return {"fixed_cost_s": float(intercept), "bandwidth_GBps": float(1 / slope / 1e9)}


async def raw_nixl(connector: KVConnector, peer, nbytes: int, repeats: int) -> float:
    """One descriptor covering `nbytes` of the peer's region: NIXL's best case."""
    agent = connector.transport._agent
    name = connector.transport._agent_for(peer)
    src = np.array([[int(peer.params["base_address"]), nbytes, 0]], dtype=np.uint64)
    dst = np.array([[connector.transport.kv_cache.data_ptr(), nbytes, 0]], dtype=np.uint64)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(dst, "DRAM"),
                                       agent.get_xfer_descs(src, "DRAM"), name, b"raw")
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        assert state == "DONE"
        agent.release_xfer_handle(handle)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def bench_transport(transport: str, sizes: list[int], num_blocks: int) -> dict:
    sender = Sender(transport, num_blocks)
    cache = make_cache(num_blocks)
    layout = KVLayout.of_cache(cache, "smollm2-135m-instruct")
    connector = KVConnector(cache, layout, TransportConfig(engine_id=f"bench-{transport}-D",
                                                           pull_timeout_s=120), transport,
                            release=lambda rid: None)
    await connector.start()
    rng = np.random.default_rng(0)
    out: dict = {"sizes": {}}
    try:
        peer = await connector.peer(f"bench-{transport}-P", sender.info["url"])
        counter = 0
        points = []
        for n in sizes:
            repeats = 20 if n <= 16 else (5 if n <= 256 else 3)
            row = {}
            for pattern in ("scattered", "contiguous"):
                times = []
                for _ in range(repeats + 1):  # first one warms the path up
                    if pattern == "scattered":
                        ids = rng.permutation(num_blocks)[:n].tolist()
                    else:
                        ids = list(range(n))
                    counter += 1
                    rid = f"b{counter}"
                    sender.export(rid, ids)
                    stats = await connector.fetch(peer, rid, ids, ids)
                    times.append(stats.seconds)
                t = statistics.median(times[1:])
                nbytes = n * layout.bytes_per_block
                row[pattern] = {"seconds": t, "GBps": nbytes / t / 1e9,
                                "descriptors": stats.num_descriptors, "label": stats.transport_label}
                if pattern == "scattered":
                    points.append((nbytes, t))
            row["bytes"] = n * layout.bytes_per_block
            out["sizes"][str(n)] = row
        out["fit_scattered"] = fit_fixed_cost(points)
        out["label"] = connector.transport.label
        if transport == "nixl":
            raw = {}
            for n in sizes:
                nbytes = n * layout.bytes_per_block
                t = await raw_nixl(connector, peer, nbytes, 20 if n <= 16 else 5)
                raw[str(n)] = {"seconds": t, "GBps": nbytes / t / 1e9}
            out["raw_single_buffer"] = raw
    finally:
        await connector.close()
        sender.close()
    return out


def bench_local_copy(sizes: list[int], bytes_per_block: int) -> dict:
    out = {}
    for n in sizes:
        nbytes = n * bytes_per_block
        src = torch.ones(nbytes // 2, dtype=torch.float16)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(10 if n <= 256 else 3):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        t = statistics.median(times)
        out[str(n)] = {"seconds": t, "GBps": nbytes / t / 1e9}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16,256,4096")
    ap.add_argument("--transports", default="nixl,tcp")
    ap.add_argument("--role", default="bench", choices=["bench", "sender"])
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_transfer.json"))
    args = ap.parse_args()
    if args.role == "sender":
        asyncio.run(sender_main(args.transports, args.num_blocks))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    num_blocks = args.num_blocks or max(sizes) + 64
    layout_bytes = KVLayout.of_cache(make_cache(1), "m").bytes_per_block
    result: dict = {"layout": {**SMOLLM2, "dtype": "float16", "bytes_per_block": layout_bytes},
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    for transport in args.transports.split(","):
        result[transport] = asyncio.run(bench_transport(transport, sizes, num_blocks))
        print(json.dumps({transport: result[transport]["sizes"]}), file=sys.stderr)
    result["local_copy"] = bench_local_copy(sizes, layout_bytes)
    ratios = {}
    if "nixl" in result:
        for n in sizes:
            raw = result["nixl"]["raw_single_buffer"][str(n)]["GBps"]
            for pattern in ("scattered", "contiguous"):
                ratios[f"nixl_{pattern}_over_raw_{n}"] = result["nixl"]["sizes"][str(n)][pattern]["GBps"] / raw
    for t in args.transports.split(","):
        for n in sizes:
            ratios[f"{t}_scattered_over_local_copy_{n}"] = (
                result[t]["sizes"][str(n)]["scattered"]["GBps"] / result["local_copy"][str(n)]["GBps"])
    result["ratios"] = ratios
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
