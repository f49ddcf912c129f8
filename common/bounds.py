"""Every numeric and string bound of the public and internal APIs, defined once.

The router's OpenAI models, the workers' OpenAI models, the internal wire models
(`common/protocol.py`) and the engine's `SamplingParams` all take their ranges from here, so a
value one of them accepts can never crash another (a `top_k` of 2**63 once passed both HTTP
layers and killed the engine thread inside `torch.tensor`). What depends on the model (the
vocabulary, the context length) is checked where the model is known, against these same names.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1

MAX_TOKEN_ID = INT32_MAX  # ids travel as uint32 (hashing) and int32/int64 tensors
MAX_PROMPT_TOKENS = 1 << 20
MAX_TOKENS = 1 << 20  # max_tokens; the context length cuts it further
MAX_TOP_K = 1 << 20  # above any vocabulary we serve; the engine also checks the real one
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_ID_CHARS = 256
MAX_BLOCK_IDS = 1 << 20
# the wire bound; each worker applies its own, lower, --max-lease-seconds
MAX_LEASE_SECONDS = 3600.0

# Request ids travel into NIXL notifications, log lines, metric-free keys and URLs: keep them to
# characters that need no escaping anywhere.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:\-]+$"
ENGINE_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"
# A host name or an IPv4/IPv6 literal: no scheme, path, user info or port (SSRF through a
# `remote_host` of "evil/x?" or "user@host" is impossible by construction).
HOST_PATTERN = (r"^(?:[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
                r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?)*"
                r"|\[?[0-9A-Fa-f:.]{2,45}\]?)$")

_HOST_RE = re.compile(HOST_PATTERN)
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)


def _finite(v: float) -> float:
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError("must be a finite number")
    return v


Finite = AfterValidator(_finite)

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
PromptTokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
Temperature = Annotated[float, Field(ge=0.0, le=100.0), Finite]
TopP = Annotated[float, Field(gt=0.0, le=1.0), Finite]
TopK = Annotated[int, Field(ge=1, le=MAX_TOP_K)]
MinP = Annotated[float, Field(ge=0.0, le=1.0), Finite]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0), Finite]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]  # int64, as OpenAI's
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
MAX_LOGIT_BIAS = 1024  # entries of a logit_bias map
LogitBias = Annotated[dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0), Finite]],
                      Field(max_length=MAX_LOGIT_BIAS)]
MinTokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS,
                                 pattern=REQUEST_ID_PATTERN)]
EngineId = Annotated[str, Field(pattern=ENGINE_ID_PATTERN)]
# Who sent a request, as the router tells workers (router/clients.py client_tag): opaque.
ClientTag = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[0-9a-f]+$")]
# A request's cache salt (common/hashing.py chain_root), as vLLM's `cache_salt`.
MAX_CACHE_SALT_CHARS = 256
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
Host = Annotated[str, Field(min_length=1, max_length=253, pattern=HOST_PATTERN)]
Port = Annotated[int, Field(ge=1, le=65535)]
BlockId = Annotated[int, Field(ge=0, le=INT32_MAX)]
BlockIds = Annotated[list[BlockId], Field(max_length=MAX_BLOCK_IDS)]
BlockHash = Annotated[int, Field(ge=0, le=UINT64_MAX)]
BlockHashes = Annotated[list[BlockHash], Field(max_length=MAX_BLOCK_IDS)]
LeaseSeconds = Annotated[float, Field(gt=0.0, le=MAX_LEASE_SECONDS), Finite]
Timestamp = Annotated[float, Field(ge=0.0, le=1e11), Finite]  # Unix seconds


def is_host(value: str) -> bool:
    return bool(_HOST_RE.match(value)) and len(value) <= 253


def is_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and bool(_REQUEST_ID_RE.match(value))
