"""Reloads from the disk tier off the engine's step (issue 41): while a long prefix is reloaded
from a worker's disk tier into its device blocks, the streams already running keep decoding.

    .venv/bin/python bench/kv_tier_loads.py                      # SmolLM2-135M, 1,024 tokens
    .venv/bin/python bench/kv_tier_loads.py --prefix-tokens 2048 --repeats 5

One engine (blocks of 16 tokens, a disk tier in a temporary folder over the 16 staging slots of
host memory), on this machine's CPU. Per repeat:

1. a prefix of `--prefix-tokens` is computed, written through to the disk tier, and dropped from
   the device pool and the host slots: only the disk holds it; its files are flushed and
   dropped from the OS page cache (`posix_fadvise(DONTNEED)`, those files only), so the reload
   reads the disk (`--warm`: leave them cached: a read, a checksum and a copy in memory);
2. a stream decodes; a request whose prompt is the prefix (and one token more) arrives; the
   engine steps until the stream ends. Per step: the time, the stream's tokens so far, whether
   the request is loading (the scheduler's loading state);
3. the same blocks dropped again, their reload is timed on the caller's thread: what admission
   did before this change, a stall every running stream waited through.

Writes bench/results/kv_tier_loads.json (--out): per repeat the load's seconds, the stream's
tokens and steps during it, its inter-token latency p50 during the load and before it, and the
synchronous reload's seconds; medians over the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.sequence import SequenceStatus  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def drop_to_disk(llm: LLM, seed: int) -> None:
    """Push every block out of the host slots (a new filler prompt's 17 blocks take its 16) and
    forget the device pool's: what was computed before is on disk only."""
    engine = llm.engine
    llm.generate([[(i * 104729 + seed * 7907) % 250 + 3 for i in range(16 * 17)]], GREEDY)
    assert engine.tiers.wait_idle(120)
    assert engine.pool.reset_prefix_cache()


def uncache(folder: Path) -> None:
    """Flush the block files and drop them from the page cache: the next read is the disk's."""
    for path in folder.glob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_run(llm: LLM, prefix: list[int], stream_tokens: int, rep: int, cold: bool) -> dict:
    engine, bs = llm.engine, llm.engine.block_size
    hashes = engine.hasher(prefix)[:len(prefix) // bs]
    drop_to_disk(llm, 2 * rep)
    media = engine.tiers.lookup(hashes)
    assert media == ["disk"] * len(hashes), media
    if cold:
        uncache(engine.tiers.disk.folder)
    stream = SamplingParams(temperature=0, max_tokens=stream_tokens, ignore_eos=True)
    engine.add_request(f"stream-{rep}", [5 + rep, 6, 7, 8] * 4, stream)
    steps: list[tuple[float, int, bool]] = []  # (time, stream tokens so far, loading)
    tokens = 0
    added = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == f"stream-{rep}":
                tokens += len(out.new_token_ids)
        loading = f"prefix-{rep}" in engine.requests and \
            engine.requests[f"prefix-{rep}"].status == SequenceStatus.LOADING
        steps.append((time.perf_counter(), tokens, loading))
        if added is None and tokens >= 16:  # the stream decodes: the prefix's request comes
            engine.add_request(f"prefix-{rep}", prefix + [9], GREEDY)
            added = len(steps)
    during = [i for i, (_, _, loading) in enumerate(steps) if loading]
    assert during, "the request never loaded"
    first, last = during[0], during[-1] + 1  # the load: from its first step to the one after
    load_s = steps[last][0] - steps[first - 1][0]

    def itl(lo: int, hi: int) -> float:
        gaps = [steps[i][0] - steps[i - 1][0] for i in range(max(lo, 1), hi)
                if steps[i][1] > steps[i - 1][1]]
        return round(statistics.median(gaps) * 1000, 3) if gaps else float("nan")

    # The same reload on this thread, as admission ran it before the loading state.
    drop_to_disk(llm, 2 * rep + 1)
    if cold:
        uncache(engine.tiers.disk.folder)
    block_ids = engine.pool.allocate(len(hashes))
    t0 = time.perf_counter()
    num = engine.tiers.reload(hashes, engine.tiers.lookup(hashes), block_ids)
    sync_s = time.perf_counter() - t0
    engine.pool.free(block_ids)
    assert num == len(hashes)
    return {"load_s": round(load_s, 4), "load_steps": last - first,
            "stream_tokens_during_load": steps[last - 1][1] - steps[first - 1][1],
            "stream_itl_ms_p50_during_load": itl(first, last),
            "stream_itl_ms_p50_before": itl(1, added),
            "sync_reload_s": round(sync_s, 4), "num_blocks_reloaded": len(hashes)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="leave the block files page-cached")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_tier_loads.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kv-tier-loads-") as folder:
        llm = LLM(args.model, num_blocks=4 * args.prefix_tokens // 16 + 64, block_size=16,
                  disk_kv_dir=str(Path(folder) / "disk"), disk_kv_bytes=8 << 30,
                  num_threads=args.threads, inline_load_s=0)  # every load off the step
        try:
            engine = llm.engine
            prefix = [(i * 7919) % 250 + 3 for i in range(args.prefix_tokens)]
            llm.generate([prefix + [9]], GREEDY)  # computed once, written through to disk
            runs = [one_run(llm, prefix, args.stream_tokens, r, not args.warm)
                    for r in range(args.repeats)]
            block_bytes = engine.tiers.host.block_bytes
        finally:
            llm.engine.close()
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result = {"model": args.model, "prefix_tokens": args.prefix_tokens, "block_size": 16,
              "block_bytes": block_bytes, "threads": args.threads, "cold": not args.warm,
              "stream_tokens": args.stream_tokens, "runs": runs, "median": medians}
    write_result(Path(args.out), result)
    m = medians
    print(f"disk reload of {m['num_blocks_reloaded']} blocks ({args.prefix_tokens} tokens): "
          f"{m['load_s']:.3f} s in the loading state, the stream decoded "
          f"{m['stream_tokens_during_load']} tokens meanwhile (ITL p50 "
          f"{m['stream_itl_ms_p50_during_load']} ms, {m['stream_itl_ms_p50_before']} ms "
          f"before); on the engine's thread the same reload stalls every stream "
          f"{m['sync_reload_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
