"""Fidelity of the GPU path (bench/engine_gpu.py): the logits of decode steps through the Triton
kernels (eager and graphs) against eager SDPA, teacher-forced on the same tokens, and the first
greedy tokens of graphs (overlapped steps, engine/decode_pipeline.py, as served) against SDPA.
"""

from __future__ import annotations

import torch

BF16_RTOL = 2e-2  # max |diff| over max |ref|: a few bf16 roundings (2^-8 each) apart


MODES = ("graphs", "graphs_sync", "eager", "sdpa")


def set_mode(llm, mode: str, graphs) -> None:
    """"graphs": as served on CUDA (graphs, steps overlapping the host); "graphs_sync": graphs,
    one step at a time; "eager": what enforce_eager runs; "sdpa": the CPU path's attention."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    runner = llm.engine.runner
    runner.graphs = graphs if mode.startswith("graphs") else None
    runner.attention = "sdpa" if mode == "sdpa" else "triton"
    set_overlap(llm.engine, mode == "graphs")


def set_overlap(engine, on: bool) -> None:
    """Overlapped steps on or off; a step still in flight is finished by the next `step()`."""
    if engine.pipeline is not None:
        engine.pipeline.enabled = on


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
    # Logging and forcing hook the synchronous step's calls: no overlap meanwhile.
    overlap = engine.pipeline is not None and engine.pipeline.enabled
    if logits_log is not None or forced is not None:
        set_overlap(engine, False)
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
        set_overlap(engine, overlap)


def fidelity(llm, prompts, sizes, graphs) -> dict:
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
