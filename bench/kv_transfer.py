"""KV transfer bandwidth between two processes on the SmolLM2 layout (30 layers, 3 KV heads,
head_dim 64, block_size 16, float16: 368,640 bytes a block).

    .venv/bin/python bench/kv_transfer.py [--sizes 1,16,256,4096] [--transports nixl,tcp]

For each size it pulls scattered (random) and contiguous block ids through the real
`KVConnector` (descriptor lists, notifications, leases) and compares with, in the same run, a raw
single-descriptor NIXL READ of the same number of bytes (no notification: NIXL's best case)
and a local `tensor.copy_`. The fixed cost per transfer is the intercept of a least-squares fit
time = fixed + bytes / bandwidth. `--rounds 3` repeats everything three times (fresh processes)
and reports each round's ratios. Prints JSON and writes bench/results/kv_transfer.json.

Goals (issue 19): NIXL fixed cost < 0.5 ms; scattered >= 90% of raw at 256 blocks in every
round; TCP >= 1.5 GB/s at 256+ blocks; 16 scattered blocks within 2x of 16 contiguous on TCP.
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
                                       agent.get_xfer_descs(src, "DRAM"), name, b"")
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
        raw: dict = {}
        for n in sizes:
            repeats = 20 if n <= 16 else (9 if n <= 256 else 3)
            nbytes = n * layout.bytes_per_block
            times: dict = {"scattered": [], "contiguous": [], "raw": []}
            descriptors = {}
            # Interleaved, so the machine's noise falls on every pattern alike; the first round
            # warms the path up and is dropped.
            for _ in range(repeats + 1):
                for pattern in ("scattered", "contiguous"):
                    ids = (rng.permutation(num_blocks)[:n].tolist() if pattern == "scattered"
                           else list(range(n)))
                    counter += 1
                    rid = f"b{counter}"
                    sender.export(rid, ids)
                    stats = await connector.fetch(peer, rid, ids, ids)
                    times[pattern].append(stats.seconds)
                    descriptors[pattern] = (stats.num_descriptors, stats.transport_label)
                if transport == "nixl":
                    times["raw"].append(await raw_nixl(connector, peer, nbytes, 1))
            row = {}
            for pattern in ("scattered", "contiguous"):
                t = statistics.median(times[pattern][1:])
                row[pattern] = {"seconds": t, "GBps": nbytes / t / 1e9,
                                "descriptors": descriptors[pattern][0], "label": descriptors[pattern][1]}
            points.append((nbytes, row["scattered"]["seconds"]))
            if transport == "nixl":
                t = statistics.median(times["raw"][1:])
                # Each scattered pull against the raw read right after it: the pair shares the
                # machine's load of the moment, which the medians of whole series do not.
                paired = statistics.median(r / s for r, s in zip(times["raw"][1:], times["scattered"][1:],
                                                                 strict=True))
                raw[str(n)] = {"seconds": t, "GBps": nbytes / t / 1e9, "scattered_over_raw_paired": paired}
            row["bytes"] = nbytes
            out["sizes"][str(n)] = row
        out["fit_scattered"] = fit_fixed_cost(points)
        out["label"] = connector.transport.label
        if transport == "nixl":
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


def ratios(one: dict, sizes: list[int], transports: list[str]) -> dict:
    out = {}
    if "nixl" in one:
        for n in sizes:
            raw = one["nixl"]["raw_single_buffer"][str(n)]["GBps"]
            for pattern in ("scattered", "contiguous"):
                out[f"nixl_{pattern}_over_raw_{n}"] = one["nixl"]["sizes"][str(n)][pattern]["GBps"] / raw
    for t in transports:
        for n in sizes:
            row = one[t]["sizes"][str(n)]
            out[f"{t}_scattered_over_local_copy_{n}"] = row["scattered"]["GBps"] / one["local_copy"][str(n)]["GBps"]
            out[f"{t}_scattered_time_over_contiguous_{n}"] = row["scattered"]["seconds"] / row["contiguous"]["seconds"]
    return out


def goals(rounds: list[dict], sizes: list[int], transports: list[str]) -> dict:
    """Each goal of issue 19 with the worst value over the rounds."""
    out = {}
    if "nixl" in transports:
        # A 1-block pull bounds the fixed cost from above (its 360 KB take ~0.06 ms); the fit's
        # intercept is reported beside it, but large pulls' noise moves it by tenths of a ms.
        if 1 in sizes:
            one = max(r["nixl"]["sizes"]["1"]["scattered"]["seconds"] for r in rounds)
            out["nixl_one_block_pull_ms"] = {"worst": one * 1e3, "goal": "< 0.5", "met": one < 0.5e-3}
        fixed = max(r["nixl"]["fit_scattered"]["fixed_cost_s"] for r in rounds)
        out["nixl_fit_intercept_ms"] = {"worst": fixed * 1e3}
        if 256 in sizes:
            low = min(r["nixl"]["raw_single_buffer"]["256"]["scattered_over_raw_paired"] for r in rounds)
            out["nixl_scattered_over_raw_256_paired"] = {"worst": low, "goal": ">= 0.9", "met": low >= 0.9}
            low = min(r["ratios"]["nixl_scattered_over_raw_256"] for r in rounds)
            out["nixl_scattered_over_raw_256_medians"] = {"worst": low}
    if "tcp" in transports:
        big = [n for n in sizes if n >= 256]
        if big:
            gbps = min(r["tcp"]["sizes"][str(n)]["scattered"]["GBps"] for r in rounds for n in big)
            out["tcp_GBps_256_plus"] = {"worst": gbps, "goal": ">= 1.5", "met": gbps >= 1.5}
        if 16 in sizes:
            worst = max(r["ratios"]["tcp_scattered_time_over_contiguous_16"] for r in rounds)
            out["tcp_16_scattered_over_contiguous"] = {"worst": worst, "goal": "<= 2", "met": worst <= 2}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16,256,4096")
    ap.add_argument("--transports", default="nixl,tcp")
    ap.add_argument("--role", default="bench", choices=["bench", "sender"])
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_transfer.json"))
    args = ap.parse_args()
    if args.role == "sender":
        asyncio.run(sender_main(args.transports, args.num_blocks))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    num_blocks = args.num_blocks or max(sizes) + 64
    layout_bytes = KVLayout.of_cache(make_cache(1), "m").bytes_per_block
    result: dict = {"layout": {**SMOLLM2, "dtype": "float16", "bytes_per_block": layout_bytes},
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "rounds": []}
    transports = args.transports.split(",")
    for _ in range(args.rounds):
        one: dict = {}
        for transport in transports:
            one[transport] = asyncio.run(bench_transport(transport, sizes, num_blocks))
            print(json.dumps({transport: one[transport]["sizes"]}), file=sys.stderr)
        one["local_copy"] = bench_local_copy(sizes, layout_bytes)
        one["ratios"] = ratios(one, sizes, transports)
        result["rounds"].append(one)
    result["goals"] = goals(result["rounds"], sizes, transports)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
