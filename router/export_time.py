"""What a holder's prefix export takes, the router's side of a peer pull's price (issue 42;
docs/architecture.md "Peer prefix pulls").

A holder pins and leases a prompt's blocks at once, even in the middle of an engine step
(engine/llm_engine.py `MID_STEP_METHODS`), so an export costs a request to the holder and back,
whatever the holder is doing, plus a reload where its blocks sit in a lower tier (priced apart:
router/reload_cost.py). That figure is learned, fleet-wide, from the exports that happen: an
EWMA of their seconds (`ExportTime`), priced on top of every pull. The link's learned cost
(router/fabric.py) is taught the puller's side of the pull alone, so a holder's slow answer (an
event loop busy with many streams) is not mistaken for a slow link."""

from __future__ import annotations

ALPHA = 0.2  # weight of the newest export in the EWMA
MAX_EXPORT_S = 60.0  # an export slower than this teaches no more


class ExportTime:
    """The seconds prefix exports take, fleet-wide: an EWMA of each export's time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.num_exports = 0

    def learn(self, seconds: float) -> None:
        """One export that took `seconds`."""
        if not 0 <= seconds < 3600:
            return
        seconds = min(seconds, MAX_EXPORT_S)
        self.num_exports += 1
        self.seconds = seconds if self.num_exports == 1 else (
            (1 - ALPHA) * self.seconds + ALPHA * seconds)
