"""The disaggregation claim against what a user already has: each target of bench/serving.py
serves `tandem bench --workload mixed` (32 requests, half long prompts with 4-token answers, half
short prompts with 48-token answers, 4 in flight) on a fresh start; P/D's ITL p99 and throughput
against a colocated vLLM on the same cores. Run through `bench/serving.py --mixed`; writes
bench/results/serving_mixed.{json,md}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from provenance import write_result  # bench/ is on sys.path
from serving_targets import MODEL, RESULTS, Procs, median, start_target


def run_mixed(url: str, rep: int, out: Path) -> dict:
    from loadgen.bench import run

    s = run(f"{url}/v1", MODEL, "mixed", 32, concurrency=4, seed=rep, out_dir=out, name="mixed")
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {"ttft_p50_ms": ms(s["ttft_s"]["p50"]), "ttft_p99_ms": ms(s["ttft_s"]["p99"]),
            "itl_p50_ms": ms(s["itl_s"]["p50"]), "itl_p99_ms": ms(s["itl_s"]["p99"]),
            "output_tok_s": s["output_tokens_per_s"], "ok": s["ok"], "requests": s["requests"]}


def mixed_markdown(summary: list[dict], base_target: str) -> str:
    lines = ["| target | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s "
             f"| ITL p99 / {base_target}'s | tok/s / {base_target}'s |", "|" + "---|" * 8]
    base = next((s for s in summary if s["target"] == base_target), None)

    def f(v):
        return "–" if v is None else f"{v:.1f}"

    def r(s, key):
        if not base or not base.get(key) or not s.get(key):
            return "–"
        return f"{s[key] / base[key]:.2f}×"

    for s in summary:
        lines.append(f"| {s['target']} | {f(s['ttft_p50_ms'])} | {f(s['ttft_p99_ms'])} | "
                     f"{f(s['itl_p50_ms'])} | {f(s['itl_p99_ms'])} | {f(s['output_tok_s'])} | "
                     f"{r(s, 'itl_p99_ms')} | {r(s, 'output_tok_s')} |")
    return "\n".join(lines) + "\n"


def main_mixed(args, targets: list[str], folder: Path, work: Path) -> None:
    runs = []
    for target in targets:
        for rep in range(args.repeats):
            name = f"mixed-{target}-r{rep}"
            procs = Procs(work / name)
            procs.logs.mkdir()
            try:
                url = start_target(target, args, folder, procs, 2048)
                res = run_mixed(url, rep, work / name)
            except Exception as e:  # noqa: BLE001 - one failed arm is reported, not fatal
                res = {"error": f"{type(e).__name__}: {e}"}
            finally:
                procs.stop()
            runs.append({"target": target, "repeat": rep, **res})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    summary = []
    for target in targets:
        rs = [r for r in runs if r["target"] == target and "error" not in r]
        summary.append({"target": target, "num_runs": len(rs),
                        **{k: median(rs, k) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                                      "itl_p99_ms", "output_tok_s")}})
    write_result(RESULTS / "serving_mixed.json", {"runs": runs, "summary": summary})
    md = mixed_markdown(summary, "vllm")
    (RESULTS / "serving_mixed.md").write_text(md)
    print(md)
