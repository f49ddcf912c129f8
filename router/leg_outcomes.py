"""What a worker's answer to one leg tells the router about that worker: a token id outside the
model's vocabulary fails it (router/dispatch.py retries or resumes elsewhere); its prefill rate
and its pulls' bandwidth are learned, as EWMAs that kv_aware prices legs with (router/policy.py;
the simulator learns them the same way)."""

from __future__ import annotations

from common.protocol import RequestTiming, TokenLogprob
from router.backend import WorkerFailure
from router.worker_info import WorkerInfo


def check_vocab(w: WorkerInfo, token_ids: list[int], logprobs: list[TokenLogprob] | None,
                vocab_size: int | None) -> None:
    """WorkerFailure for a token id at or past the model's vocabulary (sampled or in logprobs):
    such an answer comes from a broken or lying worker, and relaying it would drop the token
    from the text silently."""
    if vocab_size is None:
        return
    top = max(token_ids, default=-1)
    for lp in logprobs or ():
        top = max(top, lp.token_id, max((t for t, _ in lp.top), default=-1))
    if top >= vocab_size:
        raise WorkerFailure(f"{w.worker_id}: token id {top} is outside the model's vocabulary "
                            f"[0, {vocab_size})")


def learn_prefill_rate(w: WorkerInfo, num_computed: int, seconds: float) -> None:
    """EWMA of a worker's prefill tokens/s, from one prefill leg (queueing included: it is what
    the next request will see); short prompts are mostly fixed cost and are skipped."""
    if num_computed > 64 and seconds > 0:
        rate = num_computed / seconds
        w.prefill_tokens_per_s = rate if w.prefill_tokens_per_s is None else \
            0.8 * w.prefill_tokens_per_s + 0.2 * rate


def learn_bandwidth(w: WorkerInfo, timing: RequestTiming) -> None:
    """EWMA of the KV bytes/s a decode worker's pulls achieved (what kv_aware charges a transfer);
    tiny pulls are all fixed cost and would make the link look slow."""
    num_bytes, seconds = timing.transfer_bytes, timing.transfer_s
    if num_bytes >= 1 << 20 and seconds > 0:
        rate = num_bytes / seconds
        w.transfer_bytes_per_s = rate if w.transfer_bytes_per_s is None else \
            0.8 * w.transfer_bytes_per_s + 0.2 * rate
