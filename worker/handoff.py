"""A drain's hand-off (docs/contract.md "Drain hand-off", issue 42): on SIGTERM a worker with
`--drain-handoff` ends every `/generate` stream it runs at once, each with a last event that
names the leading block hashes of its prompt and tokens so far. Their blocks stay in its prefix
cache; the router resumes each stream on another worker and asks this one to lease those blocks
to it (`POST /kv/prefix-export`, allowed while handing off), so the stream continues without
recomputing its prompt. The worker stays up until what it leased has been pulled, for
`GRACE_S` after its last hand-off at least and `--drain-timeout-s` at most."""

from __future__ import annotations

import time

from common.protocol import GenerateRequest, StreamEvent

GRACE_S = 5.0  # how long a drained worker waits for the router to ask for its blocks


class Handoff:
    """Which streams may be handed off, and whether a drain is handing them off."""

    def __init__(self) -> None:
        self.active = False
        self.last_at: float | None = None
        self._streams: set[str] = set()

    def track(self, request_id: str) -> None:
        self._streams.add(request_id)

    def untrack(self, request_id: str) -> None:
        self._streams.discard(request_id)

    def begin(self, end_stream) -> int:
        """Hand off every tracked stream (`end_stream(request_id)`: the engine client's);
        returns how many."""
        self.active = True
        ended = sum(bool(end_stream(rid)) for rid in list(self._streams))
        if ended:
            self.last_at = time.monotonic()
        return ended

    def waiting(self) -> bool:
        """Whether the router may still ask for blocks handed off moments ago."""
        return self.last_at is not None and time.monotonic() < self.last_at + GRACE_S


def handoff_event(req: GenerateRequest, emitted: list[int], hasher, block_size: int
                  ) -> StreamEvent:
    """The last event of a handed-off stream: the hashes of the full blocks of prompt + every
    token the router has, past the last one (its KV is computed only at the next step)."""
    tokens = [*req.prompt_token_ids, *req.output_token_ids, *emitted]
    num_blocks = (len(tokens) - 1) // block_size
    hashes = hasher(tokens[:num_blocks * block_size], cache_salt=req.cache_salt) \
        if num_blocks else []
    return StreamEvent(request_id=req.request_id, handoff_block_hashes=hashes[:1 << 16])
