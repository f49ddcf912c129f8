"""A skewed multi-turn load on a real CPU cluster (issue 42): a few hot conversations whose
requests overflow their home worker, many cold ones; `kv_aware` with peer prefix pulls off and
on, and `round_robin` beside them.

    .venv/bin/python bench/skewed.py                   # 3 arms, 3 rounds (minutes)
    .venv/bin/python bench/skewed.py --rounds 1 --cold 4 --hot-words 300   # a small run

Per arm a fresh cluster: --workers decode workers (no prefill pool: each computes its own
prompts), --num-blocks blocks of 16 tokens each, SmolLM2-135M (`tandem prepare-model`), Redis, a
router (`--expose-worker-ids`). Each of --hot hot conversations has a ~--hot-words context;
each of --cold cold conversations a ~--cold-words first message. Per round, all at once: every
hot conversation gets --forks requests extending its context with a distinct ~--fork-words task
(sub-agents; the first one's answer becomes the context's next turn) and every cold conversation
its next ~--turn-words turn. Greedy, --max-tokens each. A round before them (not measured)
answers each hot context and each cold first message once: each conversation has a home.
With --spread-s S a round's requests arrive over S seconds instead (evenly, in a seeded order
that is the same in every arm): the same offered load for each arm, so the arms' latencies are
compared at equal throughput, and the cluster is not saturated when S is long enough.

Per request, from its `tandem` field: prompt tokens, cached where computed, pulled, prefilled
(prompt - cached - pulled), recomputed (prefilled beyond what is new to the conversation: the
tokens past its previous prompt, block-aligned; a lower bound, as the previous answer is not
counted as held) and the router's time to first token. Per arm: those sums, TTFT p50/p99,
requests per second over the rounds. Writes bench/results/skewed.json (--out).
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

from fork import BLOCK_SIZE, chat, pct, render, shared_prefix, text  # noqa: E402
from provenance import write_result  # noqa: E402

from testing.cluster import Router, Worker  # noqa: E402

ARMS = {"kv_aware_off": ("kv_aware", False), "kv_aware_on": ("kv_aware", True),
        "round_robin": ("round_robin", False)}


def arrive(at: float, call):
    """`call()` once the clock reaches `at` (perf_counter seconds)."""
    time.sleep(max(0.0, at - time.perf_counter()))
    return call()


def run_arm(policy: str, pulls: bool, args, folder: Path, work: Path) -> dict:
    ns = f"bench-skew-{policy}-{'on' if pulls else 'off'}-{uuid.uuid4().hex[:6]}"
    procs: list = []
    model = folder.name
    try:
        workers = [Worker("decode", str(folder), cache_dir=work, namespace=ns,
                          num_blocks=args.num_blocks, block_size=BLOCK_SIZE,
                          extra=["--threads", str(args.threads)]) for _ in range(args.workers)]
        procs += workers
        router = Router(folder, ns, cache_dir=work, block_size=BLOCK_SIZE, policy=policy,
                        extra=["--expose-worker-ids", *([] if pulls else ["--no-peer-pulls"]),
                               "--stream-stall-timeout-s", "600", "--prefill-timeout-s", "600"])
        procs.append(router)
        router.wait_workers(args.workers)
        rng = random.Random(args.seed)
        system = {"role": "system", "content": "You are a careful assistant."}
        hot = [[system, {"role": "user", "content": f"Project {i} notes: "
                         + text(rng, args.hot_words)}] for i in range(args.hot)]
        cold = [[system, {"role": "user", "content": f"Question {i}: "
                          + text(rng, args.cold_words)}] for i in range(args.cold)]
        previous: dict[int, list[int]] = {}  # conversation -> its last prompt's tokens
        rows: list[dict] = []
        for rnd in range(-1, args.rounds):  # round -1 warms up: every conversation's start
            jobs = []  # (conversation key, messages, whether its answer moves it on)
            for i, conv in enumerate(hot):
                if rnd < 0:
                    jobs.append((("hot", i), conv, False))
                    continue
                for f in range(args.forks):
                    task = {"role": "user", "content": f"Round {rnd} task {f}: "
                            + text(rng, args.fork_words)}
                    jobs.append((("hot", i), conv + [task], f == 0))
            for i, conv in enumerate(cold):
                turn = conv if rnd < 0 else conv + [{"role": "user", "content": f"Then {rnd}: "
                                                     + text(rng, args.turn_words)}]
                jobs.append((("cold", i), turn, True))
            prompts = [render(workers[0], model, m) for _, m, _ in jobs]
            if rnd == 0:
                t0 = time.perf_counter()
            order = list(range(len(jobs)))
            random.Random(args.seed * 1000 + rnd).shuffle(order)
            gap = args.spread_s / len(jobs) if rnd >= 0 else 0.0
            start = time.perf_counter()
            with cf.ThreadPoolExecutor(len(jobs)) as pool:
                answers = list(pool.map(
                    lambda job, at: arrive(at, lambda: chat(router, model, job[1],
                                                            args.max_tokens)),
                    jobs, [start + order.index(k) * gap for k in range(len(jobs))]))
            for (key, _, _), prompt, a in zip(jobs, prompts, answers, strict=True):
                if rnd < 0:
                    previous[key] = prompt
                    continue
                t = a["tandem"]
                n = a["usage"]["prompt_tokens"]
                prefilled = n - t["num_cached_tokens"] - t["num_pulled_tokens"]
                known = shared_prefix([prompt, previous.get(key, [])]) // BLOCK_SIZE * BLOCK_SIZE
                rows.append({"round": rnd, "conversation": f"{key[0]}-{key[1]}",
                             "prompt_tokens": n, "cached": t["num_cached_tokens"],
                             "pulled": t["num_pulled_tokens"], "prefilled": prefilled,
                             "recomputed": max(prefilled - (n - known), 0),
                             "ttft_s": round(t["first_token_s"], 3),
                             "worker": t["decode_worker"], "kv_source": t["kv_source"],
                             "text": a["choices"][0]["message"]["content"]})
            # Each conversation moves on: a hot context by its first fork's answer, a cold one
            # by its turn's answer.
            for (key, messages, advance), prompt, a in zip(jobs, prompts, answers, strict=True):
                if not advance:
                    continue
                answer = {"role": "assistant", "content": a["choices"][0]["message"]["content"]}
                if key[0] == "hot":
                    hot[key[1]] = messages + [answer]
                else:
                    cold[key[1]] = messages + [answer]
                previous[key] = prompt
            time.sleep(args.settle_s)  # the workers' blocks reach the router's index
        wall = time.perf_counter() - t0 - args.settle_s * args.rounds  # the measured rounds
        ttft = [r["ttft_s"] for r in rows]
        return {"requests": len(rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                "prefilled_tokens": sum(r["prefilled"] for r in rows),
                "recomputed_tokens": sum(r["recomputed"] for r in rows),
                "pulled_tokens": sum(r["pulled"] for r in rows),
                "cached_tokens": sum(r["cached"] for r in rows),
                "ttft_p50_s": round(statistics.median(ttft), 3),
                "ttft_p99_s": round(pct(ttft, 0.99), 3),
                "requests_per_s": round(len(rows) / wall, 3),
                "requests_per_worker": {w: sum(r["worker"] == w for r in rows)
                                        for w in sorted({r["worker"] for r in rows})},
                "rows": rows}
    finally:
        for p in reversed(procs):
            p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--hot", type=int, default=2)
    ap.add_argument("--forks", type=int, default=4)
    ap.add_argument("--cold", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hot-words", type=int, default=700)
    ap.add_argument("--fork-words", type=int, default=60)
    ap.add_argument("--cold-words", type=int, default=150)
    ap.add_argument("--turn-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--settle-s", type=float, default=1.5)
    ap.add_argument("--spread-s", type=float, default=0.0,
                    help="a round's requests arrive over this many seconds (0: all at once)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "skewed.json"))
    args = ap.parse_args()
    from engine.model_store import resolve_model

    folder = resolve_model(args.model)
    work = Path(f"/tmp/bench-skew-{uuid.uuid4().hex[:6]}")
    work.mkdir()
    arms = {name: run_arm(policy, pulls, args, folder, work)
            for name, (policy, pulls) in ARMS.items()}
    on, off = arms["kv_aware_on"], arms["kv_aware_off"]

    def ratio(key):
        return on[key] / off[key] if off[key] else None

    ratios = {"recomputed_on_over_off": ratio("recomputed_tokens"),
              "ttft_p99_on_over_off": ratio("ttft_p99_s"),
              "requests_per_s_on_over_off": ratio("requests_per_s")}
    same = ([r["text"] for r in on["rows"]] == [r["text"] for r in off["rows"]])
    result = {"model": args.model, "config": vars(args), "arms": arms, "ratios": ratios,
              "greedy_answers_identical_on_off": same,
              "goals": {"recomputed_at_most_0.5x": None if ratios["recomputed_on_over_off"]
                        is None else ratios["recomputed_on_over_off"] <= 0.5,
                        "ttft_p99_at_most_0.7x": ratios["ttft_p99_on_over_off"] <= 0.7}}
    write_result(args.out, result)
    for name, arm in arms.items():
        print(f"{name:13} prompt {arm['prompt_tokens']} prefilled {arm['prefilled_tokens']} "
              f"recomputed {arm['recomputed_tokens']} pulled {arm['pulled_tokens']} TTFT p50 "
              f"{arm['ttft_p50_s']} s p99 {arm['ttft_p99_s']} s {arm['requests_per_s']} req/s "
              f"per worker {arm['requests_per_worker']}")
    print(f"ratios {ratios}; identical {same}; goals {result['goals']}")


if __name__ == "__main__":
    main()
