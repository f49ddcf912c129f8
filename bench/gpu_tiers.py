"""The host KV tier on a GPU (issue 44): offload and reload through the engine's own tier
(engine/kv_tiers.py, engine/host_tier.py: pinned slab, the tiers' thread) against a plain pinned
copy of the same bytes, and decode step times while the tier offloads.

    python bench/gpu_tiers.py --device cuda [--shape smollm2-1.7b] [--blocks 256] --out t.json
    .venv/bin/python bench/gpu_tiers.py --device cpu --smoke      # the script, tiny, on CPU

One engine of a real shape with random weights (engine/shapes.py, no download), a host tier of
`--blocks` slots, CUDA graphs and overlapped steps as served. Blocks the decode batch never
gets (the top of the block ids; checked) are filled with random bytes, then:

- offload: `--blocks` blocks queued with `KVTiers.offload` until `wait_idle`: ms, GB/s, and the
  tier's own offload seconds; against the same bytes copied into a pinned tensor by one
  `copy_` a block (the tier's unit) and by one `copy_` of the whole contiguous range;
- reload: `KVTiers.reload` of those blocks into other free blocks, against pinned -> device
  copies a block and whole; every reloaded block is checked bit-exact;
- ITL: a greedy batch (`--batch`, 128-token prompts) decoding `--steps` steps, each step's
  wall time (an overlapped step returns the one before it: a stream's inter-token latency),
  idle and then while the tier offloads 4 x `--blocks` blocks queued at the start; p50, p99,
  mean, and the blocks the tier copied during the steps (4 x `--blocks` must stay under half
  of `--num-blocks`: the batch's blocks come from the bottom).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def rate(num_bytes: int, seconds: float) -> dict:
    return {"ms": round(1e3 * seconds, 3), "gb_s": round(num_bytes / seconds / 1e9, 3)}


def build(args, workdir: Path):
    """The engine, its host tier holding `--blocks` blocks (and one to spare)."""
    from engine import LLM, EngineConfig
    from engine.config import ModelConfig
    from engine.shapes import write_shape_folder

    folder = write_shape_folder(args.shape, workdir / args.shape)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = EngineConfig(model=str(folder), device=args.device, load_format="dummy",
                          dtype=str(dtype).removeprefix("torch."), num_blocks=args.num_blocks,
                          max_num_seqs=args.batch, max_model_len=1024,
                          attention_backend="triton" if cuda else None, async_scheduling=True)
    mc = ModelConfig.from_folder(folder)
    block_bytes = (mc.num_layers * 2 * config.block_size * mc.num_kv_heads * mc.head_dim
                   * dtype.itemsize)
    config.host_kv_bytes = (args.blocks + 1) * block_bytes
    return LLM(config)


def offload_and_reload(engine, blocks: int, device: torch.device) -> dict:
    """The tier's offload and reload of `blocks` blocks against plain pinned copies."""
    kv, tiers = engine.kv_cache, engine.tiers
    tiers.wait_idle(120)  # the warm-up's finished blocks are copied first
    n_all = kv.shape[0]
    src = list(range(n_all - blocks, n_all))  # the pool hands these out last
    dst = list(range(n_all - 2 * blocks, n_all - blocks))
    block_bytes = kv[0].numel() * kv.element_size()
    num_bytes = blocks * block_bytes
    g = torch.Generator(device=device).manual_seed(0)
    kv[src[0]: src[-1] + 1] = torch.randn(kv[src[0]: src[-1] + 1].shape, generator=g,
                                          device=device).to(kv.dtype)
    hashes = random.Random(0).sample(range(1, 1 << 62), blocks)
    out: dict = {"blocks": blocks, "block_bytes": block_bytes}

    def offload() -> None:
        for b, h in zip(src, hashes, strict=True):
            tiers.offload(b, h)
        if not tiers.wait_idle(120):
            raise RuntimeError("the tier did not finish its offloads in 120 s")

    before = tiers.stats()["kv_tiers"]["host"]
    out["offload"] = rate(num_bytes, timed(offload, device))
    after = tiers.stats()["kv_tiers"]["host"]
    out["offload"]["tier_seconds"] = round(after["offload_seconds"]
                                           - before["offload_seconds"], 4)
    out["offload"]["blocks_offloaded"] = after["offload_blocks"] - before["offload_blocks"]
    pinned = torch.empty((blocks, *kv.shape[1:]), dtype=kv.dtype,
                         pin_memory=device.type == "cuda")

    def per_block_down() -> None:
        for i, b in enumerate(src):
            pinned[i].copy_(kv[b])

    out["pinned_copy_per_block"] = rate(num_bytes, timed(per_block_down, device))
    out["pinned_copy_whole"] = rate(num_bytes, timed(
        lambda: pinned.copy_(kv[src[0]: src[-1] + 1]), device))
    media = tiers.lookup(hashes)
    if media != ["host"] * blocks:
        raise RuntimeError(f"{media.count('host')} of {blocks} offloaded blocks in the host tier")
    reloaded = []
    out["reload"] = rate(num_bytes, timed(
        lambda: reloaded.append(tiers.reload(hashes, media, dst)), device))
    out["reload"]["blocks"] = reloaded[0]
    out["reload"]["bit_exact"] = bool(torch.equal(kv[dst[0]: dst[-1] + 1],
                                                  kv[src[0]: src[-1] + 1]))

    def per_block_up() -> None:
        for i, b in enumerate(dst):
            kv[b].copy_(pinned[i])

    out["pinned_reload_per_block"] = rate(num_bytes, timed(per_block_up, device))
    out["pinned_reload_whole"] = rate(num_bytes, timed(
        lambda: kv[dst[0]: dst[-1] + 1].copy_(pinned), device))
    for what in ("offload", "reload"):
        base = out[f"pinned_{'copy' if what == 'offload' else 'reload'}_per_block"]["gb_s"]
        whole = out[f"pinned_{'copy' if what == 'offload' else 'reload'}_whole"]["gb_s"]
        out[f"{what}_over_pinned_per_block"] = round(out[what]["gb_s"] / base, 3)
        out[f"{what}_over_pinned_whole"] = round(out[what]["gb_s"] / whole, 3)
    out["source_blocks"] = [src[0], src[-1]]
    return out


def decode_steps(llm, args, rep: str, num_offloads: int) -> dict:
    """Step times of a greedy batch, with `num_offloads` blocks (the top block ids, which the
    batch never gets: checked) queued for the host tier just before the timed steps."""
    from engine import SamplingParams

    engine, tiers = llm.engine, llm.engine.tiers
    tiers.wait_idle(120)  # what earlier runs left (their finished blocks) is copied first
    rng = random.Random(rep)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    ids = [f"itl-{rep}-{i}" for i in range(args.batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(min(args.vocab_size, 30000)) for _ in range(128)],
                           params)
    n_all = engine.kv_cache.shape[0]
    sources = range(n_all - num_offloads, n_all)
    try:
        seqs = [engine.requests[r] for r in ids]
        while any(not s.output_token_ids for s in seqs):
            engine.step()
        engine.step()
        before = tiers.stats()["kv_tiers"]["host"]["offload_blocks"]
        for b in sources:  # fresh hashes: each is a new block to the tier
            tiers.offload(b, rng.randrange(1, 1 << 62))
        times = []
        sync(engine.kv_cache.device)
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(1e3 * (time.perf_counter() - t))
        sync(engine.kv_cache.device)
        during = tiers.stats()["kv_tiers"]["host"]["offload_blocks"] - before
        used = {b for s in seqs for b in s.block_table}
        ms = sorted(times)
        return {"steps": len(ms), "p50_ms": round(statistics.median(ms), 3),
                "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3),
                "mean_ms": round(statistics.fmean(ms), 3), "queued_offloads": num_offloads,
                "offloaded_during_steps": during,
                "batch_blocks_among_offloaded": len(used & set(sources))}
    finally:
        for rid in ids:
            engine.abort_request(rid)
        tiers.wait_idle(120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="engine/shapes.py (default smollm2-1.7b; tiny "
                    "with --smoke)")
    ap.add_argument("--blocks", type=int, default=256, help="blocks offloaded and reloaded")
    ap.add_argument("--num-blocks", type=int, default=2048, help="the device cache's blocks")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: the script on CPU")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_tiers.json"))
    args = ap.parse_args()
    if args.smoke:
        args.shape = args.shape or "tiny"
        args.blocks, args.num_blocks, args.batch, args.steps = 8, 96, 2, 8
    if 8 * args.blocks > args.num_blocks:
        ap.error("--blocks: 4 x blocks are offloaded from the top half of --num-blocks")
    args.shape = args.shape or "smollm2-1.7b"
    from engine.shapes import SHAPES

    args.vocab_size = SHAPES[args.shape]["vocab_size"]
    device = torch.device(args.device)
    result: dict = {"device": args.device, "shape": args.shape, "blocks": args.blocks,
                    "num_blocks": args.num_blocks, "batch": args.batch, "steps": args.steps,
                    "machine": {"torch": torch.__version__,
                                "gpu": torch.cuda.get_device_name(0)
                                if device.type == "cuda" else None}}
    t0 = time.perf_counter()

    def measure(name: str, fn) -> None:
        t = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - one GPU run: keep every other figure
            result[name] = {"error": repr(e)[:2000]}
        result[name]["seconds"] = round(time.perf_counter() - t, 1)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        write_result(args.out, result)

    with tempfile.TemporaryDirectory(prefix="tandem-tiers-bench-") as workdir:
        llm = build(args, Path(workdir))
        result["build_s"] = round(time.perf_counter() - t0, 1)
        decode_steps(llm, args, "warm", 0)  # every shape the timed runs take, compiled
        measure("copies", lambda: offload_and_reload(llm.engine, args.blocks, device))
        measure("itl_idle", lambda: decode_steps(llm, args, "idle", 0))
        measure("itl_offloading", lambda: decode_steps(llm, args, "busy", 4 * args.blocks))
        idle, busy = result["itl_idle"], result["itl_offloading"]
        if "p50_ms" in idle and "p50_ms" in busy:
            result["itl_offloading_over_idle"] = {
                k: round(busy[k] / idle[k], 3) for k in ("p50_ms", "p99_ms", "mean_ms")}
        llm.engine.tiers.close()
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    failed = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed or not result["copies"].get("reload", {}).get("bit_exact") else 0


if __name__ == "__main__":
    sys.exit(main())
