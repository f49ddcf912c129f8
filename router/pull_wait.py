"""The holder's side of a peer pull's price: how long its export waits right now (issue 42;
docs/architecture.md "Peer prefix pulls").

A holder pins and leases the blocks between two of its engine steps (worker/prefix_export.py),
so a pull first waits for the step the holder is in to end: nothing while it is idle, a decode
step while it only decodes, and, while prompts queue there, a step that prefills up to
`STEP_TOKENS` of them (the worker's `--max-num-batched-tokens` default) beside its decodes. That
wait depends on how busy the holder is now, not on the link, so it is predicted here from the
holder's load (its last report, or this router's own in-flight count where that is higher: the
same figures its queue is priced by) and its step time (its prefill rate, and the decode step
line of router/decode_growth.py), and priced on top of the link's learned cost. An export
request lands at no particular point of the holder's step, so the expected wait is half of it;
what exports take beyond that prediction, fleet-wide, is learned from the exports that happen
(`ExportWait`), so a bias in the prediction (a step that starts just as the exports of a burst
arrive, an event loop slowed by its engine thread) is priced too. The link's learned cost
(router/fabric.py) is taught the puller's side of the pull alone, so a busy holder's queue does
not make its link look slow for the pulls that follow, when it may be idle.
"""

from __future__ import annotations

from collections.abc import Callable

from router.decode_growth import StepLine, step_line
from router.worker_info import WorkerInfo

STEP_TOKENS = 2048  # prompt tokens one engine step prefills (worker/settings.py's default)
ALPHA = 0.2  # weight of the newest export in `ExportWait`'s EWMA
MAX_EXCESS_S = 60.0  # an export slower than this beyond its prediction teaches no more


def step_s(w: WorkerInfo, rate: float, line: StepLine) -> float:
    """Predicted seconds of the engine step `w` is in now (0.0: idle): up to `STEP_TOKENS` of
    its queued prompt tokens at `rate` tokens/s, and its decode step (`line`, or `w`'s own) for
    the streams it runs."""
    queued = w.queued_tokens()
    streams = max(w.running(), w.inflight)
    prefill = min(queued, STEP_TOKENS) / rate if queued > 0 and rate > 0 else 0.0
    if streams <= 0 and prefill == 0.0:
        return 0.0
    base, per_seq = step_line(w, line)
    return prefill + base + per_seq * max(streams, 1)


def export_wait_s(w: WorkerInfo, rate: Callable[[WorkerInfo], float], line: StepLine) -> float:
    """Expected seconds a prefix export from `w` waits for its engine now: half its step."""
    return step_s(w, rate(w), line) / 2


class ExportWait:
    """What exports took beyond their predicted wait (`export_wait_s`), fleet-wide: an EWMA of
    each export's excess (at least 0), priced on top of the prediction for every holder."""

    def __init__(self) -> None:
        self.excess_s = 0.0
        self.num_exports = 0

    def learn(self, seconds: float, predicted_s: float) -> None:
        """One export that took `seconds` where `predicted_s` was expected."""
        if not 0 <= seconds < 3600:
            return
        excess = min(max(seconds - predicted_s, 0.0), MAX_EXCESS_S)
        self.num_exports += 1
        self.excess_s = excess if self.num_exports == 1 else (
            (1 - ALPHA) * self.excess_s + ALPHA * excess)
