"""Decode rates by sampling mode (issue 44): the served path (CUDA graphs, steps overlapping the
host: engine/decode_pipeline.py) for greedy, seeded, unseeded and mixed batches, and a mixed
batch that requests keep joining.

    python bench/engine.py --device cuda --sampling greedy,seeded,unseeded,mixed --out d.json
    .venv/bin/python bench/engine.py --device cpu --quick --sampling greedy,unseeded  # tiny, CPU

Per mode and batch (1, 16, 64): tokens/s of 32 timed engine steps in which every sequence
decodes (bench/engine_gpu.py steady_steps: token counts checked), how many of them overlapped,
and the rate against greedy's at the same batch (the goal: >= 0.95 for sampled batches, with
the overlap on for all). `mixed_arrivals`: a mixed batch of 16 decoding for 64 steps while one
request arrives every 8 (each arrival ends the overlap for its prefill, as served): output
tokens/s, the steps that overlapped, and the step times' p50/p99 (what a stream's ITL is).
Sampling is temperature 1.0 without top-p/top-k (an OpenAI client's default) unless the mode
says otherwise; `top_p` is temperature 0.8 with top_p 0.95 (a sort of the vocabulary a step).
On CPU (`--quick`) the steps run SDPA attention without graphs: the run proves the script and
the sampling path through the overlap in seconds, not the kernels.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.engine_fidelity import set_mode
from bench.engine_gpu import QUICK, Prompts, Sizes, build, each_shape, steady_steps
from bench.engine_profile import overlapped_steps, sync
from bench.provenance import write_result

MODES = ("greedy", "seeded", "unseeded", "mixed", "top_p")
ARRIVAL_BATCH, ARRIVAL_STEPS, ARRIVAL_EVERY = 16, 64, 8


def row_params(mode: str, i: int, max_tokens: int):
    """Row `i`'s sampling parameters in `mode` (mixed: greedy, seeded, unseeded in turn)."""
    from engine import SamplingParams

    if mode == "mixed":
        mode = ("greedy", "seeded", "unseeded")[i % 3]
    common = {"max_tokens": max_tokens, "ignore_eos": True}
    if mode == "greedy":
        return SamplingParams(temperature=0, **common)
    if mode == "seeded":
        return SamplingParams(temperature=1.0, seed=1000 + i, **common)
    if mode == "unseeded":
        return SamplingParams(temperature=1.0, **common)
    if mode == "top_p":
        return SamplingParams(temperature=0.8, top_p=0.95, **common)
    raise ValueError(f"unknown sampling mode {mode!r}; choose from {', '.join(MODES)}")


def mode_rates(llm, prompts: Prompts, sizes: Sizes, device: str, mode: str) -> dict:
    """The steady decode rate of every batch size in `mode`, the fastest of two runs."""
    out: dict = {}
    for b in sizes.batches:
        params = [row_params(mode, i, sizes.decode_steps + 8) for i in range(b)]
        walls = [steady_steps(llm, prompts, sizes, device, b, rep, params) for rep in range(2)]
        wall = min(w for w, _, _ in walls)
        out[f"decode_tok_s_b{b}"] = round(b * sizes.decode_steps / wall, 1)
        out[f"step_ms_b{b}"] = round(1e3 * wall / sizes.decode_steps, 3)
        out[f"overlapped_steps_b{b}"] = min(n for _, n, _ in walls)  # of decode_steps timed
    return out


def mixed_arrivals(llm, prompts: Prompts, sizes: Sizes, device: str, batch: int, steps: int,
                   every: int) -> dict:
    """A mixed batch decoding for `steps` engine steps while a request arrives every `every`."""
    engine = llm.engine
    total = steps + 8
    ids = [f"arr-base-{i}" for i in range(batch)]
    for i, (rid, p) in enumerate(zip(ids, prompts.make(batch, sizes.prompt_len), strict=True)):
        engine.add_request(rid, p, row_params("mixed", i, total))
    try:
        while any(not engine.requests[r].output_token_ids for r in ids):
            engine.step()
        engine.step()
        overlapped, step_s, made = overlapped_steps(engine), [], 0
        sync(device)
        t0 = time.perf_counter()
        for k in range(steps):
            if k and k % every == 0:
                rid = f"arr-new-{k}"
                ids.append(rid)
                engine.add_request(rid, prompts.make(1, sizes.prompt_len)[0],
                                   row_params("mixed", len(ids), total))
            t = time.perf_counter()
            made += sum(len(o.new_token_ids) for o in engine.step())
            step_s.append(time.perf_counter() - t)
        sync(device)
        wall = time.perf_counter() - t0
        ms = sorted(1e3 * s for s in step_s)
        return {"batch": batch, "steps": steps, "arrivals": len(ids) - batch,
                "tokens": made, "tok_s": round(made / wall, 1),
                "overlapped_steps": overlapped_steps(engine) - overlapped,
                "step_ms_p50": round(statistics.median(ms), 3),
                "step_ms_p99": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3)}
    finally:
        for rid in ids:
            engine.abort_request(rid)


def against_greedy(res: dict, batches) -> dict:
    """Each sampled mode's rate over greedy's at the same batch, and whether every step of
    every mode overlapped."""
    greedy = res.get("greedy", {})
    ratios = {}
    for mode, figures in res.items():
        if mode == "greedy" or not isinstance(figures, dict) or "error" in figures:
            continue
        for b in batches:
            g, m = greedy.get(f"decode_tok_s_b{b}"), figures.get(f"decode_tok_s_b{b}")
            if g and m:
                ratios[f"{mode}_over_greedy_b{b}"] = round(m / g, 3)
    return ratios


def bench_shape(shape: str, device: str, sizes: Sizes, arrivals: tuple, modes: list[str],
                workdir: Path, report) -> None:
    """Every mode's rates on one shape's engine, then the arrivals; a measurement that fails
    records its error and the rest go on."""
    from engine.shapes import SHAPES

    res: dict = {}
    t = time.perf_counter()
    llm = build(shape, device, sizes, workdir)
    set_mode(llm, "graphs", llm.engine.runner.graphs)  # as served
    if not device.startswith("cuda"):
        # Interpreted Triton takes ~0.4 s a step here: the CPU run proves the script and the
        # sampling path through the overlap (SDPA attention), not the kernels (--quick alone).
        llm.engine.runner.graphs, llm.engine.runner.attention = None, "sdpa"
    res["build_s"] = round(time.perf_counter() - t, 1)
    prompts = Prompts(SHAPES[shape]["vocab_size"])
    for name in [*modes, "mixed_arrivals"]:
        t = time.perf_counter()
        try:
            if name == "mixed_arrivals":
                res[name] = mixed_arrivals(llm, prompts, arrivals[0], device, *arrivals[1:])
            else:
                res[name] = mode_rates(llm, prompts, sizes, device, name)
        except Exception as e:  # noqa: BLE001 - one GPU run: keep every other figure
            res[name] = {"error": repr(e)[:2000]}
        res[name]["seconds"] = round(time.perf_counter() - t, 1)
        res["ratios"] = against_greedy(res, sizes.batches)
        report(shape, res)


def run(shapes: list[str], device: str, quick: bool, modes: list[str], out: Path) -> dict:
    """Each shape's rates per mode; the JSON at `out` is rewritten after every measurement, so
    a run cut short still leaves what it measured."""
    for mode in modes:
        row_params(mode, 0, 1)  # an unknown mode fails before any model is built
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported
        import engine.triton_kernels as kernels

        kernels.fix_interpreter_scalars()
    sizes = QUICK if quick else Sizes()
    arrivals = ((replace(sizes, decode_steps=12), 2, 6, 3) if quick
                else (sizes, ARRIVAL_BATCH, ARRIVAL_STEPS, ARRIVAL_EVERY))
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    result: dict = {"device": device, "quick": quick, "sizes": asdict(sizes), "modes": modes,
                    "params": {m: repr(row_params(m, 1, 1)) for m in modes}, "shapes": {},
                    "machine": {"torch": torch.__version__, "gpu": gpu}}
    t0 = time.perf_counter()

    def report(shape: str, res: dict) -> None:
        result["shapes"][shape] = res
        result["seconds"] = round(time.perf_counter() - t0, 1)
        write_result(out, result)

    each_shape(shapes, "tandem-decode-bench-", device, result, report,
               lambda shape, _, workdir: bench_shape(shape, device, sizes, arrivals, modes,
                                                     workdir, report))
    return result
