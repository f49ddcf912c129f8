"""When a sequence stops: stop tokens, EOS, stop strings (cut from the text) and length
limits, checked after every sampled token (vLLM's StopChecker)."""

from __future__ import annotations

from common.stops import find_stop
from engine.sequence import Sequence


def stop_reason(seq: Sequence, token_id: int, num_new_chars: int, max_model_len: int) -> str | None:
    """Why `seq` stops after `token_id` (whose text added `num_new_chars`), or None. A stop
    string found in the text is cut from `seq.text`."""
    p = seq.params
    if seq.matcher is not None and seq.matcher.is_error():
        # The grammar engine gave up (engine/structured_output.py): the output cannot be
        # trusted to follow the constraint, so the request ends with an error, not `stop`.
        return "error"
    if seq.matcher is not None and seq.matcher.is_stopped():
        # The grammar is complete (its EOS was sampled, or nothing may follow).
        seq.stop_reason = token_id
        return "stop"
    if len(seq.output_token_ids) < p.min_tokens:  # nothing but a length limit stops it yet
        return _length(seq, p, max_model_len)
    if token_id in p.stop_token_ids:
        seq.stop_reason = token_id
        return "stop"
    if not p.ignore_eos and token_id in seq.eos_token_ids:
        seq.stop_reason = token_id
        return "stop"
    if p.stop and num_new_chars:
        # A stop string can end inside the new text but start before it.
        longest = max(len(s) for s in p.stop)
        start = max(0, len(seq.text) - num_new_chars - longest + 1)
        best = find_stop(seq.text, p.stop, start)
        if best is not None:
            seq.text = seq.text[: best[0]]
            seq.stop_reason = best[1]
            return "stop"
    return _length(seq, p, max_model_len)


def _length(seq: Sequence, p, max_model_len: int) -> str | None:
    # max_tokens counts given tokens too: the client already holds them.
    if len(seq.output_token_ids) >= p.max_tokens or seq.hold_blocks:
        return "length"
    if seq.num_tokens >= max_model_len:
        return "length"
    return None
