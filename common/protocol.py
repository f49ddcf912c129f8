"""Wire models of the internal worker API (docs/contract.md "Worker <-> router API").

Both sides import these: the router builds the requests, workers validate them, and the engine
converts `SamplingOptions` into its own `engine.SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.bounds import (
    MAX_LOGPROBS,
    MAX_PROMPT_TOKENS,
    BlockHashes,
    BlockIds,
    CacheSalt,
    ClientTag,
    EngineId,
    Host,
    LeaseSeconds,
    LogitBias,
    Logprobs,
    MaxTokens,
    MinP,
    MinTokens,
    Penalty,
    Port,
    PromptTokenIds,
    RequestId,
    Seed,
    StopStrings,
    StopTokenIds,
    Temperature,
    Timestamp,
    TokenId,
    TokenIds,
    TopK,
    TopP,
)

FinishReason = Literal["stop", "length", "abort", "error"]


MAX_GRAMMAR_CHARS = 64 << 10
# What one stream event may carry: the router trusts no worker with unbounded lists (a worker
# that sent ids past uint32 gave a 500; one that sent 60,000-entry logprob lists had them
# relayed). An answer out of these bounds is a failed worker (router/worker_http.py `parse`).
MAX_EVENT_TOKENS = 1 << 16
MAX_ERROR_CHARS = 4096
MAX_PULL_BYTES = 1 << 46  # 64 TiB: above any prefix a worker can hold
MAX_PULL_S = 3600.0


class StructuredOutput(BaseModel):
    """A constraint on the output (engine/structured_output.py): a JSON schema (`json`; `{"type":
    "object"}` is OpenAI's json_object), a regular expression, a list of choices (`choice`, JSON
    text) or a Lark/GBNF grammar (`grammar`). `spec` is text, compiled where it is applied."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["json", "regex", "choice", "grammar"]
    spec: str = Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)


class SamplingOptions(BaseModel):
    """Per-request sampling, as it crosses process boundaries. Defaults follow vLLM."""

    model_config = ConfigDict(extra="forbid")

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK | None = None
    min_p: MinP = 0.0
    seed: Seed | None = None
    max_tokens: MaxTokens = 16
    stop: StopStrings = Field(default_factory=list)
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logprobs: Logprobs | None = None
    structured: StructuredOutput | None = None
    logit_bias: LogitBias | None = None
    min_tokens: MinTokens = 0


class KVTransferParams(BaseModel):
    """Where a request's KV blocks live and how to fetch them.

    The vLLM NixlConnector fields keep their names so vLLM-style routers can pass them through;
    the rest are Tandem's. The router treats the whole object as opaque. A decode worker trusts
    none of it until `kv_transfer.handle.verify` has checked `signature` (HMAC of the internal
    token over the fields that say what to pull from where, see kv_transfer/handle.py).
    """

    model_config = ConfigDict(extra="allow")

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: EngineId | None = None
    remote_block_ids: BlockIds | None = None
    remote_host: Host | None = None
    remote_port: Port | None = None
    remote_request_id: RequestId | None = None
    block_hashes: BlockHashes | None = None
    num_tokens: int | None = Field(None, ge=0, le=1 << 20)
    prompt_hash: int | None = Field(None, ge=0, lt=2**64)
    layout: dict | None = None
    lease_expires_at: Timestamp | None = None
    expires_at: Timestamp | None = None
    signature: str | None = Field(None, max_length=128)


class TokenLogprob(BaseModel):
    token_id: TokenId
    logprob: float
    top: list[tuple[TokenId, float]] = Field(default_factory=list, max_length=MAX_LOGPROBS + 1)


@dataclass(frozen=True)
class Tenant:
    """Who sent a request, as workers and the engine act on it: `client_tag` (the batch is
    shared fairly between clients: engine/fair_share.py) and `cache_salt` (its KV blocks are
    shared only with requests of the same salt: common/hashing.py `chain_root`)."""

    client_tag: str | None = None
    cache_salt: str | None = None


class _FromTenant:
    """A request that says who sent it (its `client_tag` and `cache_salt` fields)."""

    def tenant(self) -> Tenant:
        return Tenant(self.client_tag, self.cache_salt)


class PrefillRequest(BaseModel, _FromTenant):
    model_config = ConfigDict(extra="forbid")

    request_id: RequestId
    prompt_token_ids: PromptTokenIds
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    lease_seconds: LeaseSeconds | None = None  # each worker caps it at its --max-lease-seconds
    client_tag: ClientTag | None = None  # who sent it: the batch is shared fairly between clients
    cache_salt: CacheSalt | None = None  # its blocks match only requests with the same salt
    # A peer's signed prefix handle: pull those leading blocks first (worker/peer_pull.py).
    prefix_kv_params: KVTransferParams | None = None


# Cached prompt tokens by the tier their blocks were in at admission (common/block_events.py
# Medium): "device", "host", "disk".
CachedByMedium = dict[Literal["device", "host", "disk"],
                      Annotated[int, Field(ge=0, le=MAX_PROMPT_TOKENS)]]


class PrefillResponse(BaseModel):
    request_id: str = Field(max_length=1024)
    # None when the decode leg produces every token (a vLLM backend: its prefill's token is
    # not used, so sampled text stays one draw).
    first_token_id: TokenId | None
    num_cached_tokens: int = Field(ge=0, le=MAX_PROMPT_TOKENS)
    num_cached_tokens_by_medium: CachedByMedium | None = None
    kv_transfer_params: KVTransferParams
    first_token_logprob: TokenLogprob | None = None
    # Set when the request ended at its first token (EOS, stop, max_tokens=1): no decode leg.
    finish_reason: FinishReason | None = None
    # Prompt tokens pulled from a peer (prefix_kv_params), not counted in num_cached_tokens;
    # the pull's KV bytes and seconds (the router learns the link from them: router/fabric.py).
    num_pulled_tokens: int = Field(0, ge=0, le=MAX_PROMPT_TOKENS)
    pull_bytes: int = Field(0, ge=0, le=MAX_PULL_BYTES)
    pull_s: float = Field(0.0, ge=0, le=MAX_PULL_S)


class GenerateRequest(BaseModel, _FromTenant):
    """Decode (or local prefill + decode) of one request.

    `output_token_ids` are tokens the client has already seen (the prefill's first token, or the
    tokens streamed before a worker failure); generation continues after them without repeating.
    """

    model_config = ConfigDict(extra="forbid")

    request_id: RequestId
    prompt_token_ids: PromptTokenIds
    output_token_ids: TokenIds = Field(default_factory=list)
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    kv_transfer_params: KVTransferParams | None = None
    client_tag: ClientTag | None = None  # who sent it: the batch is shared fairly between clients
    cache_salt: CacheSalt | None = None  # its blocks match only requests with the same salt
    # A peer's signed prefix handle: pull those leading blocks first (worker/peer_pull.py).
    prefix_kv_params: KVTransferParams | None = None


class RequestTiming(BaseModel):
    """Per-request breakdown carried in the final stream event (seconds)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0  # KV bytes pulled from the prefill worker
    decode_s: float = 0.0
    # Prompt tokens pulled from a peer's cache (not in the event's num_cached_tokens), and the
    # pull's KV bytes and seconds (the router learns the link from them: router/fabric.py).
    num_pulled_tokens: int = Field(0, ge=0, le=MAX_PROMPT_TOKENS)
    pull_bytes: int = Field(0, ge=0, le=MAX_PULL_BYTES)
    pull_s: float = Field(0.0, ge=0, le=MAX_PULL_S)


class StreamEvent(BaseModel):
    """One chunk of a `/generate` stream: new token ids, and a finish reason on the last one."""

    request_id: str = Field(max_length=1024)
    token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_EVENT_TOKENS)
    logprobs: list[TokenLogprob] | None = Field(None, max_length=MAX_EVENT_TOKENS)
    finish_reason: FinishReason | None = None
    error: str | None = Field(None, max_length=MAX_ERROR_CHARS)
    num_cached_tokens: int | None = Field(None, ge=0, le=MAX_PROMPT_TOKENS)
    num_cached_tokens_by_medium: CachedByMedium | None = None  # on the last event, with tiers
    timing: RequestTiming | None = None
    # A draining worker hands the stream over (docs/contract.md "Drain hand-off"): the last
    # event, with no finish_reason, names the leading block hashes of prompt + tokens so far
    # that it holds for the next worker to pull (router/handoff.py).
    handoff_block_hashes: BlockHashes | None = Field(None, max_length=1 << 16)
