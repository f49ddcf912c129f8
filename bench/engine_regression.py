"""The CPU decode step, guarded: run before committing an engine change.

    .venv/bin/python bench/engine_regression.py                 # against the committed result
    .venv/bin/python bench/engine_regression.py --against REV   # and REV, measured in this run
    .venv/bin/python bench/engine_regression.py --update        # write the new baseline

What it measures, per checkout, in a fresh process each: the engine's CPU time per decode step
(SmolLM2-135M, one torch thread, greedy, 256 new tokens) at batch 1, 4 and 16, and a colocated
worker's CPU time per streamed token at 4 streams in flight (its API process and engine core
together, through its own /v1/chat/completions). CPU time, not wall time: on a shared
machine a step waits for a core, but the work it does stays the same, so the figure moves by a
few percent where wall time moves by tens. The checkouts alternate for `--repeats` rounds and
the medians are compared.

It exits 1 when the working tree is more than `--tolerance` (5%) slower than the committed
baseline (`bench/results/engine_regression.json`) or than `--against` on any figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from testing.processes import wait_http_ok  # noqa: E402

BASELINE = ROOT / "bench" / "results" / "engine_regression.json"
NEW_TOKENS = 256
STEP_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    torch.set_num_threads(1)
    from engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", num_blocks=1024, block_size=16))
    params = SamplingParams(temperature=0, max_tokens={new}, ignore_eos=True)
    out = {{}}
    for batch in (1, 4, 16, 4):  # the first batch of 4 warms up; the second is measured
        for i in range(batch):
            engine.add_request(f"{{batch}}-{{time.monotonic_ns()}}-{{i}}", [1, 2, 3, 4 + i] * 20,
                               params)
        steps, c0 = 0, time.process_time()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        out[f"step_cpu_ms_b{{batch}}"] = (time.process_time() - c0) * 1000 / steps
    print(json.dumps(out))
""").format(new=NEW_TOKENS)


def step_cpu(checkout: Path) -> dict[str, float]:
    """CPU ms per decode step at batch 1, 4 and 16, in a fresh process of `checkout`'s code."""
    out = subprocess.run([sys.executable, "-c", STEP_SCRIPT], cwd=checkout, check=True,
                         capture_output=True, text=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])


def _tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its descendants so far."""
    total, todo = 0.0, [pid]
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _stream(url: str, i: int) -> None:
    body = {"model": "smollm2-135m-instruct", "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"Write a long story, number {i}."}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for _ in r.iter_lines():
            pass


def worker_cpu(checkout: Path, port: int) -> dict[str, float]:
    """CPU ms per streamed token of a colocated worker (2 threads) at 4 streams in flight."""
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "colocated", "--model",
                             "smollm2-135m-instruct", "--port", str(port), "--threads", "2"],
                            cwd=checkout, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TANDEM_INTERNAL_TOKEN": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(proc, Path(log.name), lambda: httpx.get(f"{url}/ready", timeout=2),
                     "colocated worker", timeout=300, interval=0.3)
        rounds = 3

        def load(n_rounds: int) -> None:
            for r in range(n_rounds):
                threads = [threading.Thread(target=_stream, args=(url, 10 * r + i))
                           for i in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

        load(1)  # warm-up
        c0 = _tree_cpu(proc.pid)
        load(rounds)
        return {"worker_cpu_ms_per_token": (_tree_cpu(proc.pid) - c0) * 1000
                / (rounds * 4 * NEW_TOKENS)}
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def measure(checkout: Path, port: int) -> dict[str, float]:
    return {**step_cpu(checkout), **worker_cpu(checkout, port)}


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def compare(new: dict[str, float], old: dict[str, float], tolerance: float) -> list[str]:
    """The figures of `new` more than `tolerance` above `old`'s, as lines."""
    return [f"{k}: {new[k]:.2f} against {old[k]:.2f} ({new[k] / old[k] - 1:+.1%})"
            for k in new if k in old and new[k] > old[k] * (1 + tolerance)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", default=None, help="also measure this git revision, same run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--port", type=int, default=18610)
    ap.add_argument("--update", action="store_true", help="write the result as the new baseline")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_regression.run.json"))
    args = ap.parse_args()
    checkouts = {"tree": ROOT}
    tmp = None
    if args.against:
        tmp = Path(tempfile.mkdtemp(prefix="tandem-against-"))
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tmp / "wt"),
                        args.against], cwd=ROOT, check=True)
        checkouts[args.against] = tmp / "wt"
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    try:
        for rep in range(args.repeats):
            for name, checkout in checkouts.items():
                runs[name].append(measure(checkout, args.port))
                print(json.dumps({"repeat": rep, name: runs[name][-1]}), flush=True)
    finally:
        if tmp is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "wt")], cwd=ROOT)
    result = {"new_tokens": NEW_TOKENS, "runs": runs,
              "medians": {name: medians(r) for name, r in runs.items()}}
    slower = []
    if args.against:
        slower += [f"against {args.against}: {line}" for line in
                   compare(result["medians"]["tree"], result["medians"][args.against],
                           args.tolerance)]
    if BASELINE.is_file() and not args.update:
        base = json.loads(BASELINE.read_text())["medians"]["tree"]
        slower += [f"against the committed baseline: {line}" for line in
                   compare(result["medians"]["tree"], base, args.tolerance)]
    result["slower"] = slower
    write_result(BASELINE if args.update else Path(args.out), result)
    print(json.dumps(result["medians"], indent=2))
    for line in slower:
        print("SLOWER", line)
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
