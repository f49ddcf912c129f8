"""The price of a decode worker's batch growth (kv_aware, router/policy.py).

A placement adds a stream to its decode worker's batch, and every stream there then waits a
longer step. The step with one more stream is predicted on the decode step line (base + per
sequence x batch) the SLO planner fits on the inter-token latency this router observes
(router/planner_loop.py sets it on each live decode worker, `WorkerInfo.decode_step`), the
configured `--planner-decode-step-*` until then. Where that step is past the inter-token latency
SLO (`--slo-itl`), the placement is charged the excess for each of `--decode-growth-tokens`
tokens: the time by which the new answer's decode runs over what the SLO allows. Within the SLO
a stream more costs nothing: the cache locality and the time to first token decide.

Without it, a session's next turn goes where its history is (its KV transfer, or its local
prefill, is the cheapest), however many streams run there: a decode worker added by the
autoscaler gets almost no traffic while the busy ones run far past the SLO.
"""

from __future__ import annotations

from router.settings import RouterSettings
from router.worker_info import WorkerInfo

StepLine = tuple[float, float]  # (base_s, per_seq_s): step seconds = base + per_seq * batch


def fleet_step_line(workers: list[WorkerInfo], s: RouterSettings) -> StepLine:
    """The line for a worker that has none of its own (one started since the planner's last
    decision, a colocated worker): the mean of the others', else the configured one."""
    lines = [w.decode_step for w in workers if w.decode_step is not None]
    if not lines:
        return s.planner_decode_step_base_s, s.planner_decode_step_per_seq_s
    return (sum(b for b, _ in lines) / len(lines), sum(p for _, p in lines) / len(lines))


def step_line(w: WorkerInfo, fleet_line: StepLine) -> StepLine:
    """`w`'s own decode step line where the planner has fitted one, else the fleet's."""
    return w.decode_step if w.decode_step is not None else fleet_line


def batch_after(d: WorkerInfo) -> int:
    """`d`'s batch with one more stream: what it runs and queues by its last report, or what this
    router has sent it (reports lag by up to a heartbeat, and a disaggregated request counts
    from when it was routed, while it still prefills elsewhere), whichever is more."""
    return max(d.running() + int(d.load.get("waiting", 0)), d.inflight) + 1


def growth_s(d: WorkerInfo, fleet_line: StepLine, s: RouterSettings) -> float:
    """Seconds a placement on `d` is charged for its batch growth: the predicted step past the
    ITL SLO, times `decode_growth_tokens`; 0 within the SLO (or with the setting at 0)."""
    if not s.decode_growth_tokens:
        return 0.0
    base, per_seq = step_line(d, fleet_line)
    return max(base + per_seq * batch_after(d) - s.slo_itl, 0.0) * s.decode_growth_tokens
