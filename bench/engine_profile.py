"""What bench/engine_gpu.py reads off the device: the GPU busy fraction and kernels a step of a
decode (torch profiler), a graph's replay time alone, and how many steps overlapped the host."""

from __future__ import annotations

import time

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def overlapped_steps(engine) -> int:
    return getattr(engine.pipeline, "num_overlapped_steps", 0)


def replay_ms(engine, batch: int, device: str, repeats: int = 20) -> float | None:
    """The model's GPU time alone: the last step's graph replayed (it rewrites the same KV
    slots with the same values)."""
    graphs = engine.runner.graphs
    if not device.startswith("cuda") or graphs is None:
        return None
    bucket = graphs.bucket_for(batch)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graphs.replay(bucket)
    stop.record()
    stop.synchronize()
    return round(start.elapsed_time(stop) / repeats, 4)


def gpu_busy(llm, prompts, sizes, device: str) -> dict:  # bench/engine_gpu.py's Prompts, Sizes
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
    overlapped = overlapped_steps(engine)
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall = time.perf_counter() - t
    graph_ms = replay_ms(engine, batch, device)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy_us, end = 0.0, float("-inf")
    for start, stop in spans:  # union of intervals (nothing counted twice)
        busy_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return {"batch": batch, "steps": steps, "step_ms": round(1e3 * wall / steps, 3),
            "device_events_per_step": round(len(spans) / steps, 1),
            "kernels_per_step": round(len(kernels) / steps, 1), "graph_replay_ms": graph_ms,
            "overlapped_steps": overlapped_steps(engine) - overlapped,
            "gpu_busy": round(busy_us / (wall * 1e6), 4) if cuda else None}
