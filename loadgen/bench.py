"""`tandem bench`: one run of a workload against an endpoint, reported as JSON + Markdown (+ PNG)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from loadgen import workload
from loadgen.report import SLO, scrape, summarize, write
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
    summary.update(workload=workload_name, size=size, seed=seed, rate=rate, concurrency=concurrency, url=url)
    if out_dir is not None:
        label = name or f"{workload_name}-{'rate' if rate else 'conc'}{rate or concurrency}"
        summary["files"] = {k: str(v) for k, v in write(summary, records, out_dir, label).items()}
    return summary


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="OpenAI base URL")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", default="multi-turn", choices=sorted(workload.WORKLOADS))
    p.add_argument("--size", type=int, default=16, help="sessions (multi-turn) or requests")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, default=None, help="open loop: sessions per second (Poisson)")
    mode.add_argument("--concurrency", type=int, default=None, help="closed loop: sessions in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput: TTFT target in seconds")
    p.add_argument("--slo-itl", type=float, default=0.2, help="goodput: worst inter-token gap in seconds")
    p.add_argument("--out", default="bench/results", help="folder for the JSON / Markdown / PNG report")
    p.add_argument("--name", default=None, help="report file name (default: workload and mode)")


def main(args) -> int:
    concurrency = args.concurrency if args.concurrency or args.rate else 4
    summary = run(args.url, args.model, args.workload, args.size, rate=args.rate,
                  concurrency=None if args.rate else concurrency, seed=args.seed, api_key=args.api_key,
                  slo=SLO(args.slo_ttft, args.slo_itl), out_dir=Path(args.out), name=args.name)
    print(Path(summary["files"]["md"]).read_text())
    print(f"report: {', '.join(summary['files'].values())}")
    return 0 if summary["ok"] == summary["requests"] else 1
