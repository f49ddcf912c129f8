"""Fit a simulator cost profile (sim/profile.py) to what bench/sim_profile.py measured on a live
cluster: latencies by least squares, then the CPU that latencies do not show, set so that the
calibration chat, simulated, costs each process what it was measured to use."""

from __future__ import annotations

import statistics
from dataclasses import replace

from sim.profile import CostProfile
from sim.simulator import Cluster
from sim.workload import Driver, SimSession

# Sessions in flight in the calibration chat: as measured, so as simulated.
CHAT_CONCURRENCY = 4


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def fit(m: dict) -> CostProfile:
    hop = statistics.median(m["rtt_s"]) / 2
    single = [r for r in m["single"] if r["plan"] == "disagg"]
    a, b = fit_line([r["num_prompt"] - r["num_cached_tokens"] for r in single],
                    [r["prefill_s"] for r in single])
    pulls = [r for r in single if r["transfer_bytes"] > 0]
    la, lb = fit_line([r["transfer_bytes"] for r in pulls], [r["transfer_s"] for r in pulls])
    bs = m["block_size"]
    # Every block the decode side lacked moved: the full ones and the partial tail.
    block_bytes = statistics.median(r["transfer_bytes"] / -(-r["num_prompt"] // bs) for r in pulls)
    mean_bw = sum(r["transfer_bytes"] for r in pulls) / sum(r["transfer_s"] for r in pulls)

    def step(rows):  # the first token came from the prefill worker
        return statistics.median(r["decode_s"] / max(r["num_output"] - 1, 1) for r in rows)

    # Spread: the prefill legs' scatter around the fitted line, relative to it.
    rel = [r["prefill_s"] / (a + b * (r["num_prompt"] - r["num_cached_tokens"])) for r in single]
    jitter = statistics.pstdev(rel) / statistics.fmean(rel)
    # The levels from chat, one request at a time: a chat request costs the router its template
    # and tokenizer, and a prefill behind a cached prefix costs more than its uncached tokens
    # (block tables, hashes and block ids in the answer); per uncached token, the slope above.
    seq = [r for r in m["chat_sequential"] if r["plan"] == "disagg"]
    router_cpu = statistics.median(r["first_token_s"] - r["prefill_s"] for r in seq)
    fixed = statistics.median(r["prefill_s"] - b * (r["num_prompt"] - r["num_cached_tokens"])
                              for r in seq) - 2 * hop
    # The local plan's fixed part: its first token less the router's work, two hops and the
    # uncached tokens.
    local = [r for r in m["chat_sequential"] if r["plan"] != "disagg"]
    local_fixed = statistics.median(r["first_token_s"] - router_cpu - 2 * hop
                                    - b * (r["num_prompt"] - r["num_cached_tokens"])
                                    for r in local) if local else None
    # A decode step (streamed) alone, from the chat; what each more stream adds, from 4 streams
    # against one, both of random-token prompts.
    step1 = step(seq)
    chat = m["chat"]
    profile = CostProfile(
        prefill_tokens_per_s=1 / b if b > 0 else 1e9, prefill_fixed_s=max(fixed, 1e-4),
        local_prefill_fixed_s=None if local_fixed is None else max(local_fixed, 1e-4),
        decode_step_base_s=step1,
        decode_step_per_seq_s=max((step(m["batch"]) - step(single)) / 3, 0.0),
        link_bytes_per_s=1 / lb if lb > 0 else mean_bw, link_latency_s=max(la, 0.0), block_size=bs,
        block_bytes=int(block_bytes), num_blocks=m["num_blocks"], router_hop_s=hop,
        host_cores=m["host_cores"], router_cpu_s=router_cpu, jitter=jitter,
        client_cpu_per_token_s=chat["client_cpu_s"] / chat["output_tokens"])
    sessions = [SimSession(system, [(user, n) for user, n in turns])
                for system, turns in chat["sessions"]]
    return close_cpu(profile, sessions, chat)


def simulated_cpu(profile: CostProfile, sessions: list[SimSession]) -> dict[str, float]:
    """CPU seconds of each process in the calibration chat, simulated (1P+1D, round robin)."""
    cluster = Cluster(profile, 1, 1, "round_robin")
    Driver(cluster, sessions, concurrency=CHAT_CONCURRENCY)
    cluster.clock.run()
    busy = {name: t.busy_s for name, t in cluster.threads().items()}
    return {"router": busy["router"], "prefill": busy["prefill-0"], "decode": busy["decode-0"]}


def close_cpu(profile: CostProfile, sessions: list[SimSession], chat: dict,
              rounds: int = 4) -> CostProfile:
    """Adds the CPU that the latency fits miss (the router's relaying, each worker's HTTP, leases,
    pulls and events), so that the calibration chat, simulated, costs each process what it was
    measured to. The router's extra is per token it relays (on the token's path); each worker's
    per request, after what the request waits for. A few rounds: the extra work changes the
    decode batches, and with them the steps' cost."""
    num_requests, num_tokens = chat["requests"], chat["output_tokens"]
    for _ in range(rounds):
        sim = simulated_cpu(profile, sessions)
        profile = replace(
            profile,
            router_relay_cpu_per_token_s=max(profile.router_relay_cpu_per_token_s
                                             + (chat["router_cpu_s"] - sim["router"]) / num_tokens,
                                             0.0),
            prefill_io_cpu_s=max(profile.prefill_io_cpu_s
                                 + (chat["prefill_cpu_s"] - sim["prefill"]) / num_requests, 0.0),
            decode_io_cpu_s=max(profile.decode_io_cpu_s
                                + (chat["decode_cpu_s"] - sim["decode"]) / num_requests, 0.0))
    return profile


def pool(runs: list[dict]) -> dict:
    """Several measurements as one: every request's figures together, each process's CPU over the
    calibration chat averaged (this machine's speed drifts by tens of percent between runs)."""
    m = dict(runs[0])
    for key in ("rtt_s", "single", "batch", "chat_sequential"):
        m[key] = [row for run in runs for row in run[key]]
    m["host_cores"] = statistics.median(run["host_cores"] for run in runs)
    m["chat"] = {**runs[0]["chat"], **{key: statistics.fmean(run["chat"][key] for run in runs)
                                       for key in runs[0]["chat"]
                                       if key.endswith(("_s", "_switches"))
                                       or key == "output_tokens"}}
    return m
