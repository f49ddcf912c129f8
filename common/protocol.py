"""Wire models of the internal worker API (DESIGN.md "Worker <-> router API").

Both sides import these: the router builds the requests, workers validate them, and the engine
converts `SamplingOptions` into its own `engine.SamplingParams`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingOptions(BaseModel):
    """Per-request sampling, as it crosses process boundaries. Defaults follow vLLM."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what a torch generator takes
    max_tokens: int = Field(16, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class KVTransferParams(BaseModel):
    """Where a request's KV blocks live and how to fetch them.

    The vLLM NixlConnector fields keep their names so vLLM-style routers can pass them through;
    the rest are Tandem's. The router treats the whole object as opaque.
    """

    model_config = ConfigDict(extra="allow")

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    block_hashes: list[int] | None = None
    num_tokens: int | None = None
    layout: dict | None = None
    lease_expires_at: float | None = None


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class PrefillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    lease_seconds: float | None = Field(None, gt=0.0)


class PrefillResponse(BaseModel):
    request_id: str
    first_token_id: int
    num_cached_tokens: int
    kv_transfer_params: KVTransferParams
    first_token_logprob: TokenLogprob | None = None
    # Set when the request ended at its first token (EOS, stop, max_tokens=1): no decode leg.
    finish_reason: FinishReason | None = None


class GenerateRequest(BaseModel):
    """Decode (or local prefill + decode) of one request.

    `output_token_ids` are tokens the client has already seen (the prefill's first token, or the
    tokens streamed before a worker failure); generation continues after them without repeating.
    """

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    output_token_ids: list[int] = Field(default_factory=list)
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    kv_transfer_params: KVTransferParams | None = None


class RequestTiming(BaseModel):
    """Per-request breakdown carried in the final stream event (seconds)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0  # KV bytes pulled from the prefill worker
    decode_s: float = 0.0


class StreamEvent(BaseModel):
    """One chunk of a `/generate` stream: new token ids, and a finish reason on the last one."""

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_cached_tokens: int | None = None
    timing: RequestTiming | None = None
