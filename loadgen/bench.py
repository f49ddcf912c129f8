"""`tandem bench`: one run of a workload against an endpoint, reported as JSON + Markdown (+ PNG).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from loadgen import workload
from loadgen.report import SLO, plot_rates, scrape, summarize, write
from loadgen.runner import RunConfig, Runner


def run(url: str, model: str, workload_name: str, size: int, *, rate: float | None = None,
        concurrency: int | None = None, seed: int = 0, api_key: str | None = None,
        slo: SLO | None = None, out_dir: Path | None = None, name: str | None = None,
        sessions: list[workload.Session] | None = None) -> dict:
    """Runs the workload (or the `sessions` given) and returns the summary (also written to
    `out_dir` when given)."""
    sessions = sessions if sessions is not None else workload.build(workload_name, size, seed)
    runner = Runner(RunConfig(base_url=url, model=model, api_key=api_key, rate=rate,
                              concurrency=concurrency, seed=seed))
    before = scrape(url)
    t0 = time.perf_counter()
    records = asyncio.run(runner.run(sessions))
    wall = time.perf_counter() - t0
    summary = summarize(records, wall, slo or SLO(), before, scrape(url))
    summary.update(workload=workload_name, size=size, seed=seed, rate=rate,
                   concurrency=concurrency, url=url)
    if out_dir is not None:
        label = name or f"{workload_name}-{'rate' if rate else 'conc'}{rate or concurrency}"
        summary["files"] = {k: str(v) for k, v in write(summary, records, out_dir, label).items()}
    return summary


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="OpenAI base URL")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the model name to send")
    p.add_argument("--api-key", default=None, help="the client API key, if the router has keys")
    p.add_argument("--workload", default="multi-turn", choices=sorted(workload.WORKLOADS),
                   help="the traffic's shape")
    p.add_argument("--size", type=int, default=16, help="sessions (multi-turn) or requests")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=_rates, default=None,
                      help="open loop: sessions per second (Poisson); several, comma-separated, "
                      "sweep the load and add a throughput-vs-rate report")
    mode.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: sessions in flight")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (prompts, arrivals)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput: TTFT target in seconds")
    p.add_argument("--slo-itl", type=float, default=0.2,
                   help="goodput: worst inter-token gap in seconds")
    p.add_argument("--out", default="bench/results",
                   help="folder for the JSON / Markdown / PNG report")
    p.add_argument("--name", default=None, help="report file name (default: workload and mode)")


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"rates must be positive numbers: {text!r}")
    return rates


def main(args) -> int:
    concurrency = args.concurrency if args.concurrency or args.rate else 4
    slo, out = SLO(args.slo_ttft, args.slo_itl), Path(args.out)
    if args.rate and len(args.rate) > 1:
        return sweep(args, args.rate, slo, out)
    summary = run(args.url, args.model, args.workload, args.size,
                  rate=args.rate[0] if args.rate else None,
                  concurrency=None if args.rate else concurrency, seed=args.seed,
                  api_key=args.api_key, slo=slo, out_dir=out, name=args.name)
    print(Path(summary["files"]["md"]).read_text())
    print(f"report: {', '.join(summary['files'].values())}")
    return 0 if summary["ok"] == summary["requests"] else 1


def sweep(args, rates: list[float], slo: SLO, out: Path) -> int:
    """One run per offered rate (same seeded sessions), then `{name}-rates.json` and `.png`."""
    label = args.name or f"{args.workload}-rates"
    rows = [run(args.url, args.model, args.workload, args.size, rate=rate, seed=args.seed,
                api_key=args.api_key, slo=slo, out_dir=out, name=f"{label}-rate{rate:g}")
            for rate in rates]
    files = {"json": out / f"{label}.json"}
    files["json"].write_text(json.dumps({"rates": rates, "runs": rows}, indent=2) + "\n")
    png = plot_rates(rows, out / f"{label}.png", label)
    if png:
        files["png"] = png
    for r in rows:
        print(f"rate {r['rate']:g}/s: {r['ok']}/{r['requests']} ok, {r['request_throughput']:.2f} "
              f"req/s, goodput {r['goodput_requests_per_s']:.2f} req/s, "
              f"TTFT p99 {(r['ttft_s']['p99'] or 0) * 1e3:.0f} ms")
    print(f"report: {', '.join(str(p) for p in files.values())}")
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1
