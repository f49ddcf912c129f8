"""OpenAI request bodies as the gateway accepts them (unknown fields are refused with 400)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.bounds import (
    MAX_STOP_CHARS,
    MAX_TOP_K,
    Finite,
    Logprobs,
    MaxTokens,
    MinP,
    Penalty,
    Seed,
    TokenId,
    TopP,
)

MAX_N = 8


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=256)
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0), Finite] = 1.0
    top_p: TopP = 1.0
    # OpenAI-compatible servers take 0 or -1 for "off" (vLLM); anything else must be in range.
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None
    min_p: MinP = 0.0
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=512)
    ignore_eos: bool = False
    priority: Literal["interactive", "batch"] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop must be up to 4 non-empty strings of at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        return None if v is None or v <= 0 else v


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
