"""KV transfer bandwidth between two processes, on CPU or GPU caches, for two layouts:
`smollm2` (30 layers, 3 KV heads, head_dim 64, block 16, float16: 368,640-byte blocks) and
`llama3-8b` (32 layers, 8 KV heads, head_dim 128, block 16, bfloat16: 2 MiB blocks).

    .venv/bin/python bench/kv_transfer.py --device cuda --out bench/results/kv_transfer_cuda.json
    .venv/bin/python bench/kv_transfer.py --device cpu --quick --out /tmp/kv.json   # end to end

Each layout, transport and size (1/16/256/4096 blocks) pulls scattered and contiguous blocks
through the real `KVConnector` (each row names its plan, UCX lane and NIXL phases) beside a raw
one-descriptor READ and WRITE; on `cuda` TCP also runs from a CPU cache. Each combination runs
in its own process under the `--timeout` left, the exporting side in another (bench/kv_sender.py).
Goals (issue 30) are in `goals`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kv_sender import LAYOUTS, Sender, block_bytes, make_cache, transport_config  # noqa: E402
from provenance import write_result  # noqa: E402

from kv_transfer.connector import KVConnector  # noqa: E402
from kv_transfer.layout import KVLayout  # noqa: E402


def raw_nixl(connector: KVConnector, peer, nbytes: int, op: str) -> float:
    """One descriptor covering `nbytes` of both regions, READ or WRITE: NIXL's best case."""
    t = connector.transport
    agent, name = t._agent, t._peer(peer).agent_name
    mem = "VRAM" if t.kv_cache.is_cuda else "DRAM"
    dev = (t.kv_cache.device.index or 0) if t.kv_cache.is_cuda else 0
    remote = np.array([[int(peer.params["base_address"]), nbytes, int(peer.params["device_id"])]],
                      dtype=np.uint64)
    local = np.array([[t.kv_cache.data_ptr(), nbytes, dev]], dtype=np.uint64)
    start = time.perf_counter()
    handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, mem),
                                   agent.get_xfer_descs(remote, mem), name, b"")
    state = agent.transfer(handle)
    deadline = time.monotonic() + 60
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"raw {op} ended in state {state}")
    return time.perf_counter() - start


def repeats_for(n: int, transport: str, quick: bool) -> int:
    small, mid, big = (10, 5, 2) if transport == "tcp" else (20, 9, 3)
    return 2 if quick else (small if n <= 16 else (mid if n <= 256 else big))


async def bench_combo(layout: str, transport: str, device: str, sizes: list[int],
                      quick: bool) -> dict:
    num_blocks = max(sizes) + 64
    # the next export before the last is freed
    staging = 2 * max(sizes) if transport == "nixl" else 0
    sender = Sender(transport, layout, device, num_blocks, staging)
    cache = make_cache(layout, num_blocks, device)
    lay = KVLayout.of_cache(cache, layout)
    connector = KVConnector(cache, lay, transport_config(f"bench-{transport}-D", staging, layout),
                            transport, release=lambda rid: None)
    await connector.start()
    rng = np.random.default_rng(0)
    out: dict = {"device": device, "transport": transport, "sizes": {}}
    try:
        peer = await connector.peer(f"bench-{transport}-P", sender.info["url"])
        counter = 0
        for n in sizes:
            nbytes = n * lay.bytes_per_block
            times: dict = {"scattered": [], "contiguous": [], "raw_read": [], "raw_write": []}
            seen: dict = {}
            phases: dict = {"scattered": [], "contiguous": []}  # where a pull's time went (NIXL)
            # Interleaved, so the machine's noise falls on every pattern alike; the first round
            # warms the path up and is dropped.
            for _ in range(repeats_for(n, transport, quick) + 1):
                for pattern in ("scattered", "contiguous"):
                    ids = (rng.permutation(num_blocks)[:n].tolist() if pattern == "scattered"
                           else list(range(n)))
                    local = (rng.permutation(num_blocks)[:n].tolist()
                             if pattern == "scattered" else ids)
                    counter, rid = counter + 1, f"b{counter + 1}"
                    staged_at = sender.export(rid, ids)
                    slots = None if staged_at is None else list(range(staged_at, staged_at + n))
                    stats = await connector.fetch(peer, rid, ids, local, staged_slots=slots)
                    times[pattern].append(stats.seconds)
                    await asyncio.sleep(0)  # a turn of the loop: the done notification goes out
                    phases[pattern].append(stats.extra.get("phases_us") or {})
                    seen[pattern] = {"descriptors": stats.num_descriptors,
                                     "label": stats.transport_label,
                                     "plan": stats.extra.get("plan", "direct"),
                                     "staged_export": slots is not None}
                if transport == "nixl":
                    times["raw_read"].append(raw_nixl(connector, peer, nbytes, "READ"))
                    times["raw_write"].append(raw_nixl(connector, peer, nbytes, "WRITE"))
            row: dict = {"bytes": nbytes}
            for kind, series in times.items():
                if series:
                    t = statistics.median(series[1:])
                    row[kind] = {"seconds": t, "GBps": nbytes / t / 1e9, **seen.get(kind, {})}
                    if kept := [p for p in phases.get(kind, [])[1:] if p]:
                        row[kind]["phases_us"] = {k: statistics.median(p[k] for p in kept)
                                                  for k in kept[0]}
            if transport == "nixl":
                for pattern in ("scattered", "contiguous"):
                    row[pattern]["over_raw_read"] = row[pattern]["GBps"] / row["raw_read"]["GBps"]
            out["sizes"][str(n)] = row
        out["label"] = connector.transport.label
    finally:
        await connector.close()
        sender.close()
    return out


def goals(layouts: dict, device: str) -> dict:
    out = {}
    for name, combos in layouts.items():
        nixl = combos.get(f"nixl@{device}", {}).get("sizes", {})
        if "256" in nixl:
            r = nixl["256"]
            out[f"{name}_nixl_scattered_256_GBps"] = {"value": r["scattered"]["GBps"],
                                                      "goal": ">= 500",
                                                      "met": r["scattered"]["GBps"] >= 500}
            for pattern, goal in (("scattered", 0.5), ("contiguous", 0.8)):
                v = r[pattern]["over_raw_read"]
                out[f"{name}_nixl_{pattern}_256_over_raw"] = {"value": v, "goal": f">= {goal}",
                                                              "met": v >= goal}
        if "1" in nixl:
            us = nixl["1"]["scattered"]["seconds"] * 1e6
            out[f"{name}_nixl_one_block_us"] = {"value": us, "goal": "<= 50", "met": us <= 50}
        gpu, cpu = (combos.get("tcp@cuda", {}).get("sizes", {}),
                    combos.get("tcp@cpu", {}).get("sizes", {}))
        for n in ("256", "4096"):
            if n in gpu and n in cpu:
                v = gpu[n]["scattered"]["GBps"] / cpu[n]["scattered"]["GBps"]
                out[f"{name}_tcp_cuda_over_cpu_{n}"] = {"value": v, "goal": ">= 0.9",
                                                        "met": v >= 0.9}
    return out


def run_combo(name: str, transport: str, device: str, sizes: list[int], quick: bool,
              timeout: float) -> dict:
    """One (layout, transport, device) in a fresh receiver process: UCX opens its log once per
    process (the lane label of a second transport in one process would stay unknown), and a
    combination that hangs is killed at `timeout` without losing the others."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "combo.json"
        cmd = [sys.executable, __file__, "--role", "combo", "--layout", name,
               "--transports", transport, "--device", device, "--sizes", ",".join(map(str, sizes)),
               "--out", str(out)]
        if quick:
            cmd.append("--quick")
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s",
                    "seconds": time.perf_counter() - started}
        if proc.returncode != 0 or not out.is_file():
            return {"error": f"exit status {proc.returncode}",
                    "seconds": time.perf_counter() - started}
        combo = json.loads(out.read_text())
        combo["seconds"] = time.perf_counter() - started
        return combo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layouts", default=None,
                    help="default: both (cpu: smollm2; 8 GiB a Llama cache)")
    ap.add_argument("--layout", default="smollm2", help=argparse.SUPPRESS)  # the combo role
    ap.add_argument("--sizes", default="1,16,256,4096")
    ap.add_argument("--transports", default="nixl,tcp")
    ap.add_argument("--tcp-max-bytes", type=int, default=2 << 30,
                    help="TCP sizes above this are skipped")
    ap.add_argument("--quick", action="store_true", help="sizes 1,16,64 and 2 repeats (CPU check)")
    ap.add_argument("--timeout", type=float, default=300, help="the whole run, seconds")
    ap.add_argument("--role", default="bench", choices=["bench", "combo"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_transfer.json"))
    args = ap.parse_args()
    if args.role == "combo":
        sizes = [int(x) for x in args.sizes.split(",")]
        Path(args.out).write_text(json.dumps(asyncio.run(
            bench_combo(args.layout, args.transports, args.device, sizes, args.quick))))
        return 0
    sizes = [1, 16, 64] if args.quick else [int(x) for x in args.sizes.split(",")]
    transports = args.transports.split(",")
    combos = [(t, args.device) for t in transports]
    if args.device == "cuda" and "tcp" in transports:
        combos.append(("tcp", "cpu"))  # TCP from a CPU cache beside TCP from the CUDA cache
    result: dict = {"device": args.device, "cpus": os.cpu_count(), "sizes": sizes, "layouts": {},
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    layouts = (args.layouts
               or ("smollm2,llama3-8b" if args.device == "cuda" or args.quick else "smollm2"))
    for name in layouts.split(","):
        layout_bytes = block_bytes(name)
        result["layouts"][name] = {"bytes_per_block": layout_bytes, **LAYOUTS[name]}
        for transport, device in combos:
            use = (sizes if transport == "nixl"
                   else [n for n in sizes if n * layout_bytes <= args.tcp_max_bytes])
            left = args.timeout - (time.perf_counter() - t0)
            combo = (run_combo(name, transport, device, use, args.quick, left) if left > 1
                     else {"error": "no time left"})
            result["layouts"][name][f"{transport}@{device}"] = combo
            print(json.dumps({name: {f"{transport}@{device}": combo.get("sizes", combo)}}),
                  file=sys.stderr)
            result["goals"] = goals(result["layouts"], args.device)
            result["seconds"] = time.perf_counter() - t0
            write_result(out, result)  # what was measured, so far
    errors = [f"{name} {key}: {c['error']}" for name, combos_ in result["layouts"].items()
              for key, c in combos_.items() if isinstance(c, dict) and "error" in c]
    result["errors"] = errors
    write_result(out, result)
    print(json.dumps(result, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
