"""The engine on a GPU (issue 31), for model shapes with random weights (engine/shapes.py, no
download): decode tok/s at batch 1/16/64 with CUDA graphs and eager (128-token prompts; the rate
of 32 timed engine steps in which every sequence decodes, token counts checked, the graph replay
alone, and the offline `generate` rate from the difference of two runs), prefill tok/s at
8 x 2048, the GPU busy fraction and kernels a step of a batch-64 decode (torch profiler: device
time of all kernels and copies over wall time), and fidelity on the first shape
(bench/engine_fidelity.py). The JSON ends with a summary per shape and issue 31's goals, each
met or not (bench/engine_goals.py).

Run by bench/engine.py --device cuda (`--device cpu --quick`: the tiny shape, Triton interpreted,
graphs' functions called directly). One engine per shape serves every mode: "graphs" (as served:
decode steps overlapping the host, engine/decode_pipeline.py), "graphs_sync" (graphs, one step at
a time: the previous passes' loop), "eager" (its graphs set aside: what enforce_eager runs) and
"sdpa" (engine/attention.py, eager).
"""

from __future__ import annotations

import gc
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.engine_fidelity import fidelity, set_mode
from bench.engine_goals import goals, summary
from bench.engine_profile import gpu_busy, overlapped_steps, replay_ms, sync
from bench.provenance import write_result


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 128
    short: int = 16  # max_tokens of the shorter generate run
    long: int = 48
    decode_steps: int = 32  # timed all-decode engine steps per batch
    prefill: tuple[int, int] = (8, 2048)  # prompts x tokens
    profile_steps: int = 16
    fidelity_steps: int = 64
    greedy_tokens: int = 16
    fidelity_batch: int = 4
    num_blocks: int = 2048
    max_model_len: int = 4096


QUICK = Sizes(batches=(1, 4), prompt_len=12, short=2, long=5, decode_steps=3, prefill=(2, 48),
              profile_steps=2,
              fidelity_steps=6, greedy_tokens=4, fidelity_batch=2, num_blocks=128,
              max_model_len=256)


def build(shape: str, device: str, sizes: Sizes, workdir: Path):
    from engine import LLM, EngineConfig
    from engine.shapes import write_shape_folder

    folder = write_shape_folder(shape, workdir / shape)
    config = EngineConfig(model=str(folder), device=device, load_format="dummy",
                          dtype="bfloat16" if device.startswith("cuda") else "float32",
                          num_blocks=sizes.num_blocks, max_num_seqs=max(sizes.batches),
                          max_model_len=sizes.max_model_len, attention_backend="triton",
                          async_scheduling=True)  # on CPU too: the quick run exercises it
    llm = LLM(config)
    if not device.startswith("cuda"):
        llm.engine.runner.enable_graphs(capture=False)  # on CPU: the functions, called directly
    return llm


class Prompts:
    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng, self.vocab = random.Random(seed), vocab

    def make(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(length)] for _ in range(n)]


def decode_rates(llm, prompts: Prompts, sizes: Sizes, device: str) -> dict:
    """Per batch: the rate of `decode_steps` engine steps in which every sequence decodes (timed
    after the prefill and one decode step, token counts checked: each step adds one token to
    every sequence), the bucket's graph replay alone, and the offline `LLM.generate` rate from
    the difference of two runs (checked: each output has max_tokens tokens; a pair whose longer
    run is not slower is reported, not turned into a rate)."""
    out = {}
    # warm-up: every path's shapes
    generate_wall(llm, prompts, sizes, device, max(sizes.batches), 2)
    for b in sizes.batches:
        walls = [steady_steps(llm, prompts, sizes, device, b, rep) for rep in range(2)]
        wall = min(w for w, _, _ in walls)
        out[f"decode_tok_s_b{b}"] = round(b * sizes.decode_steps / wall, 1)
        out[f"step_ms_b{b}"] = round(1e3 * wall / sizes.decode_steps, 3)
        out[f"replay_ms_b{b}"] = walls[0][2]
        out[f"overlapped_steps_b{b}"] = min(w for _, w, _ in walls)  # of decode_steps timed
        rates = []
        for _ in range(2):
            t1 = generate_wall(llm, prompts, sizes, device, b, sizes.short)
            t2 = generate_wall(llm, prompts, sizes, device, b, sizes.long)
            if t2 > t1:
                rates.append(b * (sizes.long - sizes.short) / (t2 - t1))
            else:  # what broke the first run's batch-64 figure: never a rate
                out.setdefault(f"generate_bad_pairs_b{b}", []).append([round(t1, 4), round(t2, 4)])
        out[f"generate_tok_s_b{b}"] = round(max(rates), 1) if rates else None
    return out


def generate_wall(llm, prompts: Prompts, sizes: Sizes, device: str, batch: int,
                  max_tokens: int) -> float:
    """Wall seconds of one offline `generate` of `batch` prompts to exactly `max_tokens`."""
    from engine import SamplingParams

    ps = prompts.make(batch, sizes.prompt_len)
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    sync(device)
    wall = time.perf_counter() - t
    lengths = {len(o.token_ids) for o in outs}
    if len(outs) != batch or lengths != {max_tokens}:
        raise RuntimeError(f"generate of {batch} x {max_tokens} gave lengths {sorted(lengths)}")
    return wall


def steady_steps(llm, prompts: Prompts, sizes: Sizes, device: str, batch: int,
                 rep: int, params: list | None = None) -> tuple[float, int, float | None]:
    """(wall seconds of `decode_steps` all-decode engine steps at `batch`, how many of them were
    queued before the previous one was read, the bucket's graph replay in ms or None without
    graphs). Raises if a step did not add one token to every row. Overlapped, each call reads
    a step and leaves the next in flight: one in flight at the start and at the end (synced).
    `params`: each row's SamplingParams (bench/gpu_decode.py), greedy when None."""
    from engine import SamplingParams

    engine = llm.engine
    steps = sizes.decode_steps
    greedy = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    params = params or [greedy] * batch
    ids = [f"steady-{batch}-{rep}-{i}" for i in range(batch)]
    for rid, p, sp in zip(ids, prompts.make(batch, sizes.prompt_len), params, strict=True):
        engine.add_request(rid, p, sp)
    try:
        seqs = [engine.requests[rid] for rid in ids]
        while any(not s.output_token_ids for s in seqs):
            engine.step()  # the prefill, in chunks
        engine.step()  # one decode step: every row decoding from here on
        before = sum(len(s.output_token_ids) for s in seqs)
        overlapped = overlapped_steps(engine)
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall = time.perf_counter() - t
        made = sum(len(s.output_token_ids) for s in seqs) - before
        if made != batch * steps:
            raise RuntimeError(f"{steps} steps at batch {batch} made {made} tokens, "
                               f"not {batch * steps}")
        return wall, overlapped_steps(engine) - overlapped, replay_ms(engine, batch, device)
    finally:
        for rid in ids:
            engine.abort_request(rid)


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
    res |= {"build_and_capture_s": round(time.perf_counter() - t, 2),
            "graph_buckets": graphs.buckets}
    report(shape, res)
    prompts = Prompts(SHAPES[shape]["vocab_size"])
    for mode in ("graphs", "graphs_sync", "eager"):
        measure(mode, lambda: decode_rates(llm, prompts, sizes, device), mode)
    measure("prefill", lambda: prefill_rate(llm, prompts, sizes, device), "graphs")
    for mode in ("graphs", "graphs_sync", "eager"):
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
        result["summary"] = {k: summary(v) for k, v in result["shapes"].items()}
        result["goals"] = goals(result["shapes"])
        result["seconds"] = round(time.perf_counter() - t0, 1)
        write_result(out, result)

    each_shape(shapes, "tandem-engine-bench-", device, result, report,
               lambda shape, i, workdir: bench_shape(shape, device, sizes, workdir,
                                                     with_fidelity=i == 0, report=report))
    return result


def each_shape(shapes: list[str], prefix: str, device: str, result: dict, report,
               run: Callable[[str, int, Path], None]) -> None:
    """`run(shape, index, workdir)` for each model shape in turn, in one scratch folder: a shape
    whose build or run fails is reported with its error and the next is tried, and each shape's
    engine, graphs and cache go before the next is built."""
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        for i, shape in enumerate(shapes):
            try:
                run(shape, i, Path(workdir))
            except Exception as e:  # noqa: BLE001 - the build failed: report it, try the next
                report(shape, {**result["shapes"].get(shape, {}), "error": repr(e)[:2000]})
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
