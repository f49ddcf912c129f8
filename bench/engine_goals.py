"""Issue 31's goals for the engine on a GPU, checked against bench/engine_gpu.py's figures: one
row per goal with what was measured and whether it is met (None when the figure is missing)."""

from __future__ import annotations

import operator

# (shape, section, figure, comparison, goal, what)
GOALS = [
    ("smollm2-1.7b", "graphs", "decode_tok_s_b1", ">=", 500.0, "decode tok/s at batch 1"),
    ("smollm2-1.7b", "graphs", "step_ms_b1", "<=", 2.0, "decode step ms at batch 1"),
    ("smollm2-1.7b", "graphs", "decode_tok_s_b64", ">=", 20000.0, "decode tok/s at batch 64"),
    ("smollm2-1.7b", "profile_graphs", "gpu_busy", ">=", 0.90, "GPU busy, batch-64 decode"),
    ("smollm2-1.7b", "prefill", "prefill_tok_s_8x2048", ">=", 92000.0, "prefill tok/s 8 x 2048"),
    ("smollm2-1.7b", "fidelity", "greedy_match_graphs_vs_sdpa", "==", True,
     "16 greedy tokens equal SDPA's"),
    ("smollm2-1.7b", "fidelity", "graphs_vs_sdpa.within_bf16_tolerance", "==", True,
     "64 steps' logits within bf16 tolerance of SDPA"),
    ("llama3-8b", "graphs", "step_ms_b1", "<=", 7.0, "decode step ms at batch 1"),
]
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq}


def _figure(section: dict, path: str):
    value = section
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def goals(shapes: dict) -> list[dict]:
    """The goals of the shapes that were benchmarked, each with measured, goal and met."""
    rows = []
    for shape, section, path, op, goal, what in GOALS:
        if shape not in shapes:
            continue
        measured = _figure(shapes[shape].get(section, {}), path)
        met = None if measured is None else bool(_OPS[op](measured, goal))
        rows.append({"shape": shape, "goal": f"{what} {op} {goal}", "figure": f"{section}.{path}",
                     "measured": measured, "met": met})
    return rows


def summary(res: dict) -> dict:
    """One shape's headline figures: per batch and mode decode tok/s, step and replay ms, steps
    overlapped; per mode the batch-64 profile's kernels a step and GPU busy fraction. A figure
    a mode does not have (no graph replay in eager) is left out, never null; a measurement
    that failed shows as `{mode}.error`."""
    out: dict = {}
    for mode in ("graphs", "graphs_sync", "eager"):
        for section, prefix in ((mode, mode), (f"profile_{mode}", f"{mode}.profile")):
            figures = res.get(section)
            if not isinstance(figures, dict):
                continue
            if "error" in figures:
                out[f"{prefix}.error"] = figures["error"][:200]
            for key, value in figures.items():
                if value is not None and key.startswith(_HEADLINE):
                    out[f"{prefix}.{key}"] = value
    return out


_HEADLINE = ("decode_tok_s_b", "step_ms_b", "replay_ms_b", "overlapped_steps", "kernels_per_step",
             "graph_replay_ms", "gpu_busy", "step_ms")
