"""bench/vllm_routing.py's summary: per scenario, Tandem's exact index against the ideal and
against every other arm, as hit-ratio ratios."""

from __future__ import annotations

OTHER_ARMS = ("tandem-approx", "vllm-router-cache-aware", "vllm-router-kv-aware", "round-robin")


def summarize(runs: list[dict], scenarios) -> list[dict]:
    """One row per scenario of `scenarios` (in its order) that has an exact-index run."""
    out = []
    for name in [n for n in scenarios if any(r.get("scenario") == n for r in runs)]:
        by_arm = {r["arm"]: r for r in runs
                  if r.get("scenario") == name and r.get("hit_ratio") is not None}
        exact, ideal = by_arm.get("tandem-exact"), by_arm.get("ideal-sticky")
        if not exact:
            continue
        row = {"scenario": name, "exact_hit_ratio": exact["hit_ratio"],
               "ideal_hit_ratio": ideal and ideal["hit_ratio"],
               "exact_over_ideal": ideal and round(exact["hit_ratio"] / ideal["hit_ratio"], 3)}
        for arm in OTHER_ARMS:
            if by_arm.get(arm, {}).get("hit_ratio"):
                row[f"exact_over_{arm}"] = round(exact["hit_ratio"] / by_arm[arm]["hit_ratio"], 2)
        out.append(row)
    return out
