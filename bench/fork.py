"""A fork on a real CPU cluster (issue 42): one long context answered once, then many requests
extending it, all at once, with peer prefix pulls on and off.

    .venv/bin/python bench/fork.py                     # 3 decode workers, 12 forks (minutes)
    .venv/bin/python bench/fork.py --forks 4 --context-words 300   # a small run

Per arm a fresh cluster: --decode decode workers (no prefill pool, so each computes its own
prompts: `decode_local`), --num-blocks device blocks each, blocks of 16 tokens, SmolLM2-135M
(`tandem prepare-model`), Redis, a `kv_aware` router (`--expose-worker-ids`; the `off` arm with
`--no-peer-pulls`). The context (a system prompt and a ~--context-words user message) is
answered once (greedy, --context-max-tokens); then --forks requests append that answer and a
distinct ~--fork-words user message each, sent at once (greedy, --max-tokens).

Per arm, from each answer's `tandem` field: prompt tokens, cached where computed, pulled from a
peer, prefilled (prompt - cached - pulled) and the context's tokens recomputed (prefilled minus
the fork's own tokens past the shared, block-aligned context), the workers and source, and
client latency p50/p90/max. Writes bench/results/fork.json (--out): both arms, the ratios
on/off and whether the greedy answers are identical.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from provenance import write_result  # noqa: E402

from testing.cluster import Router, Worker  # noqa: E402

BLOCK_SIZE = 16
WORDS = ("river mountain signal harbor lantern copper meadow violet engine quartz orbit "
         "canyon falcon ember glacier hollow island jasper kernel lagoon marble nectar "
         "oasis prairie quiver rapids summit timber umbra valley willow yonder zephyr").split()


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat(router: Router, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = httpx.post(f"{router.url}/v1/chat/completions", timeout=900, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    body = r.json()
    body["latency_s"] = time.perf_counter() - t0
    return body


def render(worker: Worker, model: str, messages: list[dict]) -> list[int]:
    r = worker.client.post("/v1/chat/completions/render", json={
        "model": model, "messages": messages, "add_generation_prompt": True})
    r.raise_for_status()
    return r.json()["prompt_token_ids"]


def shared_prefix(prompts: list[list[int]]) -> int:
    n = min(map(len, prompts))
    for i in range(n):
        if len({p[i] for p in prompts}) > 1:
            return i
    return n


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_arm(pulls: bool, args, folder: Path, work: Path) -> dict:
    ns = f"bench-fork-{'on' if pulls else 'off'}-{uuid.uuid4().hex[:6]}"
    workers: list[Worker] = []
    router = None
    model = folder.name
    try:
        for _ in range(args.decode):
            workers.append(Worker("decode", str(folder), cache_dir=work, namespace=ns,
                                  num_blocks=args.num_blocks, block_size=BLOCK_SIZE,
                                  extra=["--threads", str(args.threads)]))
        router = Router(folder, ns, cache_dir=work, block_size=BLOCK_SIZE,
                        extra=["--expose-worker-ids", *([] if pulls else ["--no-peer-pulls"]),
                               # a shared 2-core machine: slow prefills are not failures here
                               "--stream-stall-timeout-s", "600", "--prefill-timeout-s", "600"])
        router.wait_workers(args.decode)
        rng = random.Random(args.seed)
        system = {"role": "system", "content": "You are a careful assistant. " +
                  text(rng, 40)}
        user = {"role": "user", "content": "Read these notes: " + text(rng, args.context_words)}
        first = chat(router, model, [system, user], args.context_max_tokens)
        answer = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
        forks = [[system, user, answer,
                  {"role": "user", "content": f"Task {i}: " + text(rng, args.fork_words)}]
                 for i in range(args.forks)]
        prompts = [render(workers[0], model, m) for m in forks]
        time.sleep(args.settle_s)  # the holder's blocks reach the router's index
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(len(forks)) as pool:
            answers = list(pool.map(lambda m: chat(router, model, m, args.max_tokens), forks))
        wall = time.perf_counter() - t0
        shared = shared_prefix(prompts) // BLOCK_SIZE * BLOCK_SIZE
        rows = []
        for prompt, a in zip(prompts, answers, strict=True):
            t = a["tandem"]
            n_prompt = a["usage"]["prompt_tokens"]
            assert n_prompt == len(prompt), (n_prompt, len(prompt))
            prefilled = n_prompt - t["num_cached_tokens"] - t["num_pulled_tokens"]
            rows.append({"prompt_tokens": n_prompt, "cached": t["num_cached_tokens"],
                         "pulled": t["num_pulled_tokens"], "prefilled": prefilled,
                         "context_recomputed": max(prefilled - (n_prompt - shared), 0),
                         "worker": t["decode_worker"], "kv_source": t["kv_source"],
                         "latency_s": round(a["latency_s"], 3),
                         "text": a["choices"][0]["message"]["content"]})
        lat = [r["latency_s"] for r in rows]
        return {"context_prompt_tokens": first["usage"]["prompt_tokens"],
                "shared_context_tokens": shared,
                "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                "prefilled_tokens": sum(r["prefilled"] for r in rows),
                "context_recomputed_tokens": sum(r["context_recomputed"] for r in rows),
                "pulled_tokens": sum(r["pulled"] for r in rows),
                "cached_tokens": sum(r["cached"] for r in rows),
                "latency_p50_s": round(statistics.median(lat), 3),
                "latency_p90_s": round(pct(lat, 0.9), 3), "latency_max_s": round(max(lat), 3),
                "wall_s": round(wall, 3),
                "requests_per_worker": {w: sum(r["worker"] == w for r in rows)
                                        for w in sorted({r["worker"] for r in rows})},
                "requests": rows}
    finally:
        for p in [router, *workers]:
            if p is not None:
                p.close()


def compare(arms: dict) -> dict:
    """Ratios on/off (None where the off arm had none to compare with: nothing recomputed means
    nothing spilled, and the goal is then not shown either way) and the issue's goals."""
    on, off = arms["on"], arms["off"]
    same = [a["text"] for a in on["requests"]] == [a["text"] for a in off["requests"]]

    def ratio(key):
        return on[key] / off[key] if off[key] else None

    ratios = {"context_recomputed_on_over_off": ratio("context_recomputed_tokens"),
              "prefilled_on_over_off": ratio("prefilled_tokens"),
              "latency_p90_on_over_off": ratio("latency_p90_s")}
    r, lat = ratios["context_recomputed_on_over_off"], ratios["latency_p90_on_over_off"]
    return {"ratios": ratios, "greedy_answers_identical": same,
            "goals": {"recomputed_at_most_0.3x": None if r is None else r <= 0.3,
                      "latency_p90_at_most_0.7x": None if lat is None else lat <= 0.7,
                      "greedy_identical": same}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--forks", type=int, default=12)
    ap.add_argument("--context-words", type=int, default=1000)
    ap.add_argument("--fork-words", type=int, default=380)
    ap.add_argument("--context-max-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--settle-s", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fork.json"))
    args = ap.parse_args()
    from engine.model_store import resolve_model

    folder = resolve_model(args.model)
    work = Path(f"/tmp/bench-fork-{uuid.uuid4().hex[:6]}")
    work.mkdir()
    arms = {"off": run_arm(False, args, folder, work), "on": run_arm(True, args, folder, work)}
    result = {"model": args.model, "config": vars(args), "arms": arms, **compare(arms)}
    write_result(args.out, result)
    for name, arm in arms.items():
        print(f"{name:4} prompt {arm['prompt_tokens']} prefilled {arm['prefilled_tokens']} "
              f"context recomputed {arm['context_recomputed_tokens']} pulled "
              f"{arm['pulled_tokens']} p50 {arm['latency_p50_s']} s p90 {arm['latency_p90_s']} s"
              f" per worker {arm['requests_per_worker']}")
    print(f"ratios {result['ratios']}; goals {result['goals']}")


if __name__ == "__main__":
    main()
