"""A decode worker drained under streaming load, on a real CPU cluster (issue 42): its streams
are handed off (worker/handoff.py) and resume on the other decode worker, which pulls their
blocks from the drained one (`on`) or, with the router's `--no-peer-pulls`, recomputes prompt
and tokens so far (`off`).

    .venv/bin/python bench/drain.py                    # 6 streams (a few minutes)
    .venv/bin/python bench/drain.py --streams 2 --context-words 200   # a small run

Per arm a fresh cluster: one prefill and two decode workers (SmolLM2-135M, `tandem
prepare-model`; blocks of 16 tokens), Redis, a `kv_aware` router. --streams chat requests, each
on a distinct ~--context-words message, stream greedy tokens (--max-tokens, ignore_eos). Once
each has --drain-after tokens, the decode worker running the most of them gets SIGTERM.

Per handed-off stream: the resume gap (the longest wait between two tokens after the signal, as
the client saw it), what the drained worker held of it, what the resuming worker pulled and had
cached already (`tandem` field), so the tokens recomputed at the resume (held - pulled -
cached). Per arm: the gaps'
median and max, the drained worker's time to exit. Writes bench/results/drain.json (--out):
both arms, the ratio of the gaps on/off, and whether every stream's text is the same in both.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from fork import text  # noqa: E402
from provenance import write_result  # noqa: E402

from testing.cluster import Router, Worker  # noqa: E402

BLOCK_SIZE = 16


def stream(router: Router, model: str, content: str, max_tokens: int, seen: list[float]) -> dict:
    """One streamed chat answer: its text, `tandem` field and token arrival times (`seen`,
    appended as they come, is read by the drain trigger)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    parts, tandem = [], None
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body,
                      timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    parts.append(piece)
                    seen.append(time.perf_counter())
            tandem = chunk.get("tandem") or tandem
    return {"text": "".join(parts), "tandem": tandem}


def running(w: Worker) -> float:
    return w.metrics().get("tandem_worker_running_requests", 0.0)


def run_arm(pulls: bool, args, folder: Path, work: Path) -> dict:
    ns = f"bench-drain-{'on' if pulls else 'off'}-{uuid.uuid4().hex[:6]}"
    extra = ["--threads", str(args.threads), "--drain-timeout-s", "60"]
    procs: list = []
    try:
        kw = dict(cache_dir=work, namespace=ns, num_blocks=args.num_blocks,
                  block_size=BLOCK_SIZE, extra=extra)
        procs.append(Worker("prefill", str(folder), **kw))
        decode = [Worker("decode", str(folder), **kw) for _ in range(2)]
        procs += decode
        router = Router(folder, ns, cache_dir=work, block_size=BLOCK_SIZE,
                        extra=["--expose-worker-ids", *([] if pulls else ["--no-peer-pulls"]),
                               "--stream-stall-timeout-s", "600", "--prefill-timeout-s", "600"])
        procs.append(router)
        router.wait_workers(3)
        rng = random.Random(args.seed)
        contents = [f"Note {i}: " + text(rng, args.context_words) for i in range(args.streams)]
        seen: list[list[float]] = [[] for _ in contents]
        with cf.ThreadPoolExecutor(len(contents)) as pool:
            futures = [pool.submit(stream, router, folder.name, c, args.max_tokens, s)
                       for c, s in zip(contents, seen, strict=True)]
            deadline = time.monotonic() + 600
            while min(map(len, seen)) < args.drain_after:
                if time.monotonic() > deadline or any(f.done() for f in futures):
                    raise RuntimeError("the streams did not all reach --drain-after tokens")
                time.sleep(0.05)
            drained = max(decode, key=running)
            t_signal = time.perf_counter()
            drained.proc.send_signal(signal.SIGTERM)
            exited: dict = {}
            threading.Thread(target=lambda: exited.update(
                rc=drained.proc.wait(120), s=time.perf_counter() - t_signal)).start()
            answers = [f.result() for f in futures]
        deadline = time.monotonic() + 120
        while "s" not in exited and time.monotonic() < deadline:
            time.sleep(0.1)
        rows = []
        for a, times in zip(answers, seen, strict=True):
            t = a["tandem"]
            after = [x for x in times if x >= t_signal]
            gap = max((b - a_ for a_, b in zip([t_signal, *after], after, strict=False)),
                      default=None)
            rows.append({"handed_off": bool(t["handoff_held_tokens"]),
                         "held_tokens": t["handoff_held_tokens"],
                         "pulled_tokens": t["handoff_pulled_tokens"],
                         "cached_tokens": t["handoff_cached_tokens"],
                         "recomputed_tokens": max(t["handoff_held_tokens"]
                                                  - t["handoff_pulled_tokens"]
                                                  - t["handoff_cached_tokens"], 0),
                         "resume_gap_s": round(gap, 3) if gap is not None else None,
                         "resumed": t["resumed"], "text": a["text"]})
        handed = [r for r in rows if r["handed_off"]]
        gaps = [r["resume_gap_s"] for r in handed if r["resume_gap_s"] is not None]
        return {"handed_off": len(handed),
                "held_tokens": sum(r["held_tokens"] for r in handed),
                "pulled_tokens": sum(r["pulled_tokens"] for r in handed),
                "cached_tokens": sum(r["cached_tokens"] for r in handed),
                "recomputed_tokens": sum(r["recomputed_tokens"] for r in handed),
                "resume_gap_p50_s": round(statistics.median(gaps), 3) if gaps else None,
                "resume_gap_max_s": round(max(gaps), 3) if gaps else None,
                "drained_exit_code": exited.get("rc"),
                "drained_exit_s": round(exited["s"], 3) if "s" in exited else None,
                "streams": rows}
    finally:
        for p in reversed(procs):
            p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--context-words", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--drain-after", type=int, default=24)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "drain.json"))
    args = ap.parse_args()
    from engine.model_store import resolve_model

    folder = resolve_model(args.model)
    work = Path(f"/tmp/bench-drain-{uuid.uuid4().hex[:6]}")
    work.mkdir()
    arms = {"off": run_arm(False, args, folder, work), "on": run_arm(True, args, folder, work)}
    on, off = arms["on"], arms["off"]
    same = [r["text"] for r in on["streams"]] == [r["text"] for r in off["streams"]]
    ratio = (on["resume_gap_p50_s"] / off["resume_gap_p50_s"]
             if on["resume_gap_p50_s"] and off["resume_gap_p50_s"] else None)
    result = {"model": args.model, "config": vars(args), "arms": arms,
              "resume_gap_p50_on_over_off": ratio, "texts_identical": same,
              "goals": {"no_recomputed_tokens": on["recomputed_tokens"] == 0
                        and on["handed_off"] > 0, "texts_identical": same}}
    write_result(args.out, result)
    for name, arm in arms.items():
        print(f"{name:4} handed off {arm['handed_off']} held {arm['held_tokens']} pulled "
              f"{arm['pulled_tokens']} recomputed {arm['recomputed_tokens']} resume gap p50 "
              f"{arm['resume_gap_p50_s']} s max {arm['resume_gap_max_s']} s; drained worker "
              f"exited {arm['drained_exit_code']} after {arm['drained_exit_s']} s")
    print(f"gap on/off {ratio}; texts identical {same}")


if __name__ == "__main__":
    main()
