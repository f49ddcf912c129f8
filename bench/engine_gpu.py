"""The engine on a GPU (issue 31), for model shapes with random weights (engine/shapes.py, no
download): decode tok/s at batch 1/16/64 with CUDA graphs and eager (128-token prompts, the rate
from the difference of two runs), prefill tok/s at 8 x 2048, the GPU busy fraction of a batch-64
decode (torch profiler: device time of all kernels and copies over wall time), step times, and
fidelity on the first shape: the logits of 64 decode steps through the Triton kernels (eager and
graphs) against eager SDPA, teacher-forced on the same tokens, and the first 16 greedy tokens.

Run by bench/engine.py --device cuda (`--device cpu --quick`: the tiny shape, Triton interpreted,
graphs' functions called directly). One engine per shape serves every mode: "graphs", "eager"
(its graphs set aside: what enforce_eager runs) and "sdpa" (engine/attention.py, eager).
"""

from __future__ import annotations

import gc
import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 128
    short: int = 16  # max_tokens of the shorter decode run
    long: int = 48
    prefill: tuple[int, int] = (8, 2048)  # prompts x tokens
    profile_steps: int = 16
    fidelity_steps: int = 64
    greedy_tokens: int = 16
    fidelity_batch: int = 4
    num_blocks: int = 2048
    max_model_len: int = 4096


QUICK = Sizes(batches=(1, 4), prompt_len=12, short=2, long=5, prefill=(2, 48), profile_steps=2,
              fidelity_steps=6, greedy_tokens=4, fidelity_batch=2, num_blocks=128,
              max_model_len=256)
BF16_RTOL = 2e-2  # max |diff| over max |ref|: a few bf16 roundings (2^-8 each) apart


def build(shape: str, device: str, sizes: Sizes, workdir: Path):
    from engine import LLM, EngineConfig
    from engine.shapes import write_shape_folder

    folder = write_shape_folder(shape, workdir / shape)
    config = EngineConfig(model=str(folder), device=device, load_format="dummy",
                          dtype="bfloat16" if device.startswith("cuda") else "float32",
                          num_blocks=sizes.num_blocks, max_num_seqs=max(sizes.batches),
                          max_model_len=sizes.max_model_len, attention_backend="triton")
    llm = LLM(config)
    if not device.startswith("cuda"):
        llm.engine.runner.enable_graphs(capture=False)  # on CPU: the functions, called directly
    return llm


def set_mode(llm, mode: str, graphs) -> None:
    runner = llm.engine.runner
    runner.graphs = graphs if mode == "graphs" else None
    runner.attention = "sdpa" if mode == "sdpa" else "triton"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Prompts:
    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng, self.vocab = random.Random(seed), vocab

    def make(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(length)] for _ in range(n)]


def decode_rates(llm, prompts: Prompts, sizes: Sizes, device: str) -> dict:
    from engine import SamplingParams

    def run(batch: int, max_tokens: int) -> float:
        ps = prompts.make(batch, sizes.prompt_len)
        sync(device)
        t = time.perf_counter()
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        sync(device)
        return time.perf_counter() - t

    run(max(sizes.batches), 2)  # warm-up: every path's shapes
    out = {}
    for b in sizes.batches:
        best = 0.0
        for _ in range(2):
            t1, t2 = run(b, sizes.short), run(b, sizes.long)
            best = max(best, b * (sizes.long - sizes.short) / max(t2 - t1, 1e-9))
        out[f"decode_tok_s_b{b}"] = round(best, 1)
        out[f"step_ms_b{b}"] = round(1e3 * b / best, 3)
    return out


def prefill_rate(llm, prompts: Prompts, sizes: Sizes, device: str) -> dict:
    from engine import SamplingParams

    num, length = sizes.prefill
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts.make(1, length), one)  # warm-up
    best = float("inf")
    for _ in range(2):
        ps = prompts.make(num, length)
        sync(device)
        t = time.perf_counter()
        llm.generate(ps, one)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return {f"prefill_tok_s_{num}x{length}": round(num * length / best, 1)}


def gpu_busy(llm, prompts: Prompts, sizes: Sizes, device: str) -> dict:
    """Device time (union of kernel and copy intervals) over wall time of decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    engine = llm.engine
    batch, steps = max(sizes.batches), sizes.profile_steps
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts.make(batch, sizes.prompt_len)):
        engine.add_request(f"busy-{i}", p, params)
    while any(not s.output_token_ids for s in engine.requests.values()):
        engine.step()  # prefill
    engine.step()
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall = time.perf_counter() - t
    graph_ms = None
    graphs = engine.runner.graphs
    if cuda and graphs is not None:  # the model's GPU time alone: the last step's graph, replayed
        bucket = graphs.bucket_for(batch)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graphs.replay(bucket)
        stop.record()
        stop.synchronize()
        graph_ms = round(start.elapsed_time(stop) / 20, 4)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA")
    busy_us, end = 0.0, float("-inf")
    for start, stop in spans:  # union of intervals (nothing counted twice)
        busy_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return {"batch": batch, "steps": steps, "step_ms": round(1e3 * wall / steps, 3),
            "device_events_per_step": round(len(spans) / steps, 1), "graph_replay_ms": graph_ms,
            "gpu_busy": round(busy_us / (wall * 1e6), 4) if cuda else None}


def _run(engine, prompts: list[list[int]], max_tokens: int, logits_log: dict | None = None,
         forced: dict | None = None) -> dict[str, list[int]]:
    """Greedy requests fid-0.. to the end; optionally logs each row's logits and forces the
    tokens of an earlier run (teacher forcing), so two paths see identical inputs."""
    from engine import SamplingParams

    runner, sampler = engine.runner, engine.sampler
    execute = runner.execute

    def logged(batch):
        logits, rows = execute(batch)
        for row, item in zip(logits, rows, strict=True):
            logits_log.setdefault(item.seq.request_id, []).append(row.float())
        return logits, rows

    def forcing(logits, seqs):
        ids, logprobs = sampler(logits, seqs)
        return [forced[s.request_id][len(s.output_token_ids)] for s in seqs], logprobs

    if logits_log is not None:
        runner.execute = logged
    if forced is not None:
        engine.sampler = forcing
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"fid-{i}", p, params)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.token_ids)
        return done
    finally:
        runner.execute, engine.sampler = execute, sampler


def fidelity(llm, prompts: Prompts, sizes: Sizes, graphs) -> dict:
    engine = llm.engine
    ps = prompts.make(sizes.fidelity_batch, sizes.prompt_len)
    greedy = {}
    for mode in ("graphs", "sdpa"):
        set_mode(llm, mode, graphs)
        greedy[mode] = _run(engine, ps, sizes.greedy_tokens)
    match = greedy["graphs"] == greedy["sdpa"]
    logs: dict[str, dict] = {m: {} for m in ("graphs", "eager", "sdpa")}
    set_mode(llm, "graphs", graphs)
    tokens = _run(engine, ps, sizes.fidelity_steps + 1, logs["graphs"])  # prefill + 64 decodes
    for mode in ("eager", "sdpa"):
        set_mode(llm, mode, graphs)
        _run(engine, ps, sizes.fidelity_steps + 1, logs[mode], forced=tokens)
    set_mode(llm, "graphs", graphs)

    def compare(a: str, b: str) -> dict:
        x = torch.stack([torch.stack(v) for _, v in sorted(logs[a].items())])  # [seqs, steps, V]
        y = torch.stack([torch.stack(v) for _, v in sorted(logs[b].items())])
        diff = (x - y).abs().max().item()
        scale = y.abs().max().item()
        agree = (x.argmax(-1) == y.argmax(-1)).float().mean().item()
        return {"max_abs_diff": diff, "max_abs_logit": scale, "rel": diff / max(scale, 1e-30),
                "within_bf16_tolerance": diff <= BF16_RTOL * scale, "argmax_agreement": agree}

    return {"greedy_tokens": sizes.greedy_tokens, "greedy_match_graphs_vs_sdpa": match,
            "decode_steps": sizes.fidelity_steps, "seqs": sizes.fidelity_batch,
            "graphs_vs_sdpa": compare("graphs", "sdpa"), "eager_vs_sdpa": compare("eager", "sdpa"),
            "graphs_vs_eager": compare("graphs", "eager")}


def bench_shape(shape: str, device: str, sizes: Sizes, workdir: Path, with_fidelity: bool,
                report) -> None:
    """Every measurement of one shape; one that fails records its error and the rest go on."""
    from engine.shapes import SHAPES

    res: dict = {}

    def measure(name: str, fn, mode: str | None = None) -> None:
        if mode is not None:
            set_mode(llm, mode, graphs)
        t = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - one GPU run: keep every other figure
            res[name] = {"error": repr(e)[:2000]}
        res[name]["seconds"] = round(time.perf_counter() - t, 1)
        report(shape, res)

    t = time.perf_counter()
    llm = build(shape, device, sizes, workdir)
    graphs = llm.engine.runner.graphs
    res |= {"build_and_capture_s": round(time.perf_counter() - t, 2), "graph_buckets": graphs.buckets}
    report(shape, res)
    prompts = Prompts(SHAPES[shape]["vocab_size"])
    for mode in ("graphs", "eager"):
        measure(mode, lambda: decode_rates(llm, prompts, sizes, device), mode)
    measure("prefill", lambda: prefill_rate(llm, prompts, sizes, device), "graphs")
    for mode in ("graphs", "eager"):
        measure(f"profile_{mode}", lambda: gpu_busy(llm, prompts, sizes, device), mode)
    if with_fidelity:
        measure("fidelity", lambda: fidelity(llm, prompts, sizes, graphs))


def run(shapes: list[str], device: str, quick: bool, out: Path) -> dict:
    """Benchmark each shape; the JSON at `out` is rewritten after every measurement, so a run
    cut short still leaves what it measured."""
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported
        import engine.triton_kernels as kernels

        kernels.fix_interpreter_scalars()
    sizes = QUICK if quick else Sizes()
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    result: dict = {"device": device, "quick": quick, "sizes": asdict(sizes), "shapes": {},
                    "machine": {"torch": torch.__version__, "gpu": gpu}}
    t0 = time.perf_counter()

    def report(shape: str, res: dict) -> None:
        result["shapes"][shape] = res
        result["seconds"] = round(time.perf_counter() - t0, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="tandem-engine-bench-") as workdir:
        for i, shape in enumerate(shapes):
            try:
                bench_shape(shape, device, sizes, Path(workdir), with_fidelity=i == 0,
                            report=report)
            except Exception as e:  # noqa: BLE001 - the build failed: report it, try the next
                report(shape, {**result["shapes"].get(shape, {}), "error": repr(e)[:2000]})
            gc.collect()  # the shape's engine, graphs and cache go before the next is built
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return result
