"""What the engine hands back per request and step (`RequestOutput`), built in one place."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Logprob, Sequence


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far (given ones included)
    new_token_ids: list[int]  # tokens produced by this step
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    logprobs: list[Logprob] | None
    arrival_time: float = 0.0  # monotonic seconds
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # num_cached_tokens by the tier the blocks were in at admission: device, host, disk
    num_cached_tokens_by_medium: dict[str, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def output_of(seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
    """What a step tells the caller about `seq`: its new tokens and everything so far."""
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        new_token_ids=new_token_ids,
        text=seq.text,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        arrival_time=seq.arrival_time,
        first_scheduled_time=seq.first_scheduled_time,
        first_token_time=seq.first_token_time,
        num_cached_tokens_by_medium=seq.num_cached_tokens_by_medium,
    )
