"""The numbers of bench/kv_tiers.py: one arm's summary from the answers' `tandem` fields and
`usage`, each arm's hit ratio as a share of the ceiling arm's, the issue's goals checked, and the
Markdown table."""

from __future__ import annotations

from loadgen.report import percentiles
from loadgen.runner import RequestRecord

MEDIA = ("device", "host", "disk")


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """Hit ratio (cached prompt tokens / prompt tokens, as the router's `tandem` field reports
    them from the worker that computed each prompt), prompt tokens recomputed, client-side TTFT,
    and throughput over the run's wall time."""
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(int((r.timing or {}).get("num_cached_tokens") or 0) for r in ok)
    by_medium = dict.fromkeys(MEDIA, 0)
    for r in ok:
        for medium, n in ((r.timing or {}).get("num_cached_tokens_by_medium") or {}).items():
            by_medium[medium] = by_medium.get(medium, 0) + int(n)
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    plans: dict[str, int] = {}
    for r in ok:
        plans[r.plan or "?"] = plans.get(r.plan or "?", 0) + 1
    ttft = percentiles([r.ttft_s for r in ok if r.ttft_s is not None])
    return {
        "requests": len(records), "ok": len(ok), "errors": errors, "wall_s": wall_s,
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_tokens_by_medium": by_medium,
        "hit_ratio": cached / prompt if prompt else None,
        "recomputed_tokens": prompt - cached,
        "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"], "ttft_mean_s": ttft["mean"],
        "server_ttft_p50_s": percentiles([r.server_ttft_s for r in ok
                                          if r.server_ttft_s is not None])["p50"],
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "plans": plans,
    }


def session_context_tokens(records: list[RequestRecord]) -> int:
    """Every session's longest context (its last prompt and answer), summed: shared prefixes
    count once per session (the working set itself is the ceiling arm's distinct blocks)."""
    last: dict[int, int] = {}
    for r in records:
        if r.error is None:
            last[r.session_id] = max(last.get(r.session_id, 0),
                                     r.prompt_tokens + r.completion_tokens)
    return sum(last.values())


def add_shares(arms: dict[str, dict]) -> None:
    """Each arm's hit ratio as a share of the ceiling arm's (what the workload could reuse), and
    its TTFT p50 and throughput against the tiers-off arm's."""
    ceiling = (arms.get("ceiling") or {}).get("hit_ratio")
    off = arms.get("off") or {}
    for s in arms.values():
        hr = s.get("hit_ratio")
        s["hit_share_of_ceiling"] = hr / ceiling if hr is not None and ceiling else None
        s["ttft_p50_speedup_vs_off"] = (off["ttft_p50_s"] / s["ttft_p50_s"]
                                        if off.get("ttft_p50_s") and s.get("ttft_p50_s")
                                        else None)
        s["output_tokens_per_s_vs_off"] = (s["output_tokens_per_s"] / off["output_tokens_per_s"]
                                           if off.get("output_tokens_per_s") else None)


def goals(workloads: dict[str, dict]) -> dict:
    """Issue 41's goals on this run: with tiers, a hit ratio >= 0.85 of the ceiling's and TTFT
    p50 >= 2x better than tiers off on the reuse workloads; throughput within 3% of tiers off
    on the no-reuse one. None where an arm is missing."""
    out: dict[str, bool | None] = {}
    for name, w in workloads.items():
        arms = w["arms"]
        # A failed request ends its session: the arms would not have sent the same requests.
        out[f"{name}.every_request_ok"] = all(s["ok"] == w["num_requests"]
                                              for s in arms.values())
        for arm in ("host", "host_disk"):
            s = arms.get(arm)
            if s is None:
                continue
            if name == "no_reuse":
                r = s.get("output_tokens_per_s_vs_off")
                out[f"{name}.{arm}.throughput_within_3pct"] = None if r is None else r >= 0.97
            else:
                share, speed = s.get("hit_share_of_ceiling"), s.get("ttft_p50_speedup_vs_off")
                out[f"{name}.{arm}.hit_share_ge_0.85"] = None if share is None else share >= 0.85
                out[f"{name}.{arm}.ttft_p50_2x"] = None if speed is None else speed >= 2.0
    return out


def markdown(workloads: dict[str, dict]) -> str:
    def f(v, fmt="{:.3f}"):
        return "–" if v is None else fmt.format(v)

    lines = []
    for name, w in workloads.items():
        lines += [f"### {name}: working set {f(w['working_set_tokens'], '{}')} tokens, "
                  f"{f(w['working_set_vs_device'], '{:.1f}')}x the device cache", "",
                  "| arm | ok | hit ratio | share of ceiling | recomputed tokens | host / disk "
                  "tokens | TTFT p50 ms | TTFT p99 ms | output tok/s | req/s |",
                  "|" + "---|" * 10]
        for arm, s in w["arms"].items():
            m = s["cached_tokens_by_medium"]
            lines.append(
                f"| {arm} | {s['ok']}/{s['requests']} | {f(s['hit_ratio'])} | "
                f"{f(s['hit_share_of_ceiling'], '{:.2f}')} | {s['recomputed_tokens']} | "
                f"{m.get('host', 0)} / {m.get('disk', 0)} | "
                f"{f(s['ttft_p50_s'] and s['ttft_p50_s'] * 1e3, '{:.0f}')} | "
                f"{f(s['ttft_p99_s'] and s['ttft_p99_s'] * 1e3, '{:.0f}')} | "
                f"{f(s['output_tokens_per_s'], '{:.1f}')} | {f(s['requests_per_s'], '{:.2f}')} |")
        lines.append("")
    return "\n".join(lines)
