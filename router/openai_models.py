"""OpenAI request bodies as the gateway accepts them (unknown fields are refused with 400); the
sampling fields are common/openai_request.py's, shared with the workers' OpenAI endpoints."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.bounds import Logprobs, MaxTokens, TokenId
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
    priority: Literal["interactive", "batch"] | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        for m in v:
            if not isinstance(m.get("role"), str):
                raise ValueError("every message needs a string role")
            c = m.get("content")
            if isinstance(c, list):  # content parts: keep the text ones
                m["content"] = "".join(p.get("text", "") for p in c if isinstance(p, dict))
            elif not isinstance(c, str) and c is not None:
                raise ValueError("message content must be a string")
        return v


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
