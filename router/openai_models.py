"""OpenAI request bodies as the gateway accepts them (unknown fields are refused with 400); the
sampling fields are common/openai_request.py's, shared with the workers' OpenAI endpoints."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.bounds import Logprobs, MaxTokens, TokenId
from common.chat_messages import ChatFields
from common.errors import APIError
from common.openai_request import OpenAISampling

MAX_N = 8


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields OpenAI or vLLM define that Tandem does not serve: refused by name with what they are, so
# a client knows it is not a typo (a field of neither is refused as unknown). docs/openai.md.
UNSUPPORTED = {
    **dict.fromkeys(("use_beam_search", "best_of", "repetition_penalty", "length_penalty"),
                    "vLLM's sampling extension, which Tandem's engine does not have"),
    **dict.fromkeys(("include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs",
                     "allowed_token_ids", "bad_words", "add_special_tokens",
                     "return_tokens_as_token_ids", "return_token_ids"),
                    "a vLLM request option that Tandem does not serve"),
    "chat_template": "per request; the router's --chat-template sets a template for all",
    "request_id": "the router names requests itself (send X-Request-Id for correlation)",
    "suffix": "insertion (fill-in-the-middle) is not served",
    **dict.fromkeys(("functions", "function_call"),
                    "OpenAI's deprecated spelling: send tools and tool_choice"),
    **dict.fromkeys(("audio", "modalities", "prediction", "web_search_options"),
                    "the models served here are text-only"),
    **dict.fromkeys(("reasoning_effort", "service_tier", "verbosity"),
                    "an OpenAI option that Tandem does not serve"),
}


class _Common(OpenAISampling):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data):
        if isinstance(data, dict):
            for name in data.keys() & UNSUPPORTED.keys():
                raise APIError(400, f"{name} is not supported: {UNSUPPORTED[name]}",
                               "unsupported_field", name)
        return data

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
