"""OpenAI request bodies as the gateway accepts them (unknown fields are refused with 400)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 8


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI's
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    priority: Literal["interactive", "batch"] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        return None if v is None or v <= 0 else v


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

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
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
