"""OpenAI request bodies as the gateway accepts them (unknown fields are refused with 400); the
sampling fields are common/openai_request.py's, shared with the workers' OpenAI endpoints."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.bounds import Logprobs, MaxTokens, TokenId
from common.chat_messages import ChatFields
from common.openai_request import OpenAISampling

MAX_N = 8


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(OpenAISampling):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=256)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=512)
    # Accepted and ignored, as OpenAI-compatible servers do: nothing is stored here.
    store: bool | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    priority: Literal["interactive", "batch"] | None = None


class ChatCompletionRequest(_Common, ChatFields):
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        # Refused until implemented: accepted and ignored, it gave likelihood-scoring harnesses
        # (lm-eval's loglikelihood requests) silently wrong numbers.
        if v:
            raise ValueError("echo is not supported by this server (no prompt text or prompt "
                             "logprobs would be returned)")
        return v
