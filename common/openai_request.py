"""An OpenAI request body as every OpenAI endpoint we serve reads it (the router's and the
workers'): the sampling fields, defined once, and the one translation of a body into the
internal request: its prompt token ids, and its `SamplingOptions` (common/protocol.py), from
which the engine builds its `SamplingParams`.
Ranges come from common/bounds.py; vLLM's extensions (`top_k`, `min_p`, `ignore_eos`,
`stop_token_ids`) are accepted as vLLM accepts them."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from common.bounds import (
    MAX_STOP_CHARS,
    MAX_TOP_K,
    CacheSalt,
    Finite,
    LogitBias,
    MaxTokens,
    MinP,
    MinTokens,
    Penalty,
    Seed,
    StopTokenIds,
    TopP,
)
from common.errors import APIError
from common.protocol import SamplingOptions
from common.structured import StructuredFields
from common.tokenizer import ChatTemplateError, Tokenizer, TooManyTokens

MAX_OPENAI_STOPS = 4  # OpenAI's own limit


class OpenAISampling(StructuredFields):
    """Mixed into the request models; `None` means "the default" wherever OpenAI allows null."""

    # vLLM's: not sampling, but how the request's KV blocks are shared (common/hashing.py
    # chain_root); read by the router and the workers' endpoints alike.
    cache_salt: CacheSalt | None = None

    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0), Finite] | None = None
    top_p: TopP | None = None
    # OpenAI-compatible servers take 0 or -1 for "off" (vLLM); anything else must be in range.
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None  # OpenAI sends the token ids as strings; parsed to ints
    min_tokens: MinTokens | None = None  # vLLM's: no EOS, stop token or stop string before it

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_OPENAI_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop must be up to {MAX_OPENAI_STOPS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        return stops

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        return None if v is None or v <= 0 else v

    def requested_max_tokens(self) -> int | None:
        # Only chat bodies have max_completion_tokens; a missing attribute on a pydantic model
        # costs an exception inside its __getattr__, so look it up on the class first.
        if "max_completion_tokens" in type(self).model_fields:
            return self.max_completion_tokens or self.max_tokens
        return self.max_tokens

    def sampling_options(self, default_max_tokens: int, seed_offset: int = 0,
                         logprobs: int | None = None) -> SamplingOptions:
        """The internal sampling of this body; `seed_offset` gives each of `n` choices its own
        seeded stream. Raises `ValueError` (pydantic's) for a value the wire refuses."""
        return SamplingOptions(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k,
            min_p=self.min_p or 0.0, seed=None if self.seed is None else self.seed + seed_offset,
            max_tokens=self.requested_max_tokens() or default_max_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, logprobs=logprobs,
            structured=self.structured(), logit_bias=self.logit_bias or None,
            min_tokens=self.min_tokens or 0)


def prompt_token_ids(tokenizer: Tokenizer, body, max_tokens: int | None = None) -> list[int]:
    """A chat body's `messages` through the chat template, or a completions body's `prompt`,
    as token ids; a bad one is a 400 naming the field. More than `max_tokens` of them raise
    TooManyTokens (before the ids are built)."""
    if hasattr(body, "messages"):
        args = body.template_args()
        gen = body.add_generation_prompt and not body.continue_final_message
        try:
            return tokenizer.encode_chat(body.messages, gen, max_tokens, **args)
        except TooManyTokens:
            raise
        except (ChatTemplateError, TypeError, KeyError, ValueError) as e:
            raise APIError(400, f"messages: {e}", "invalid_messages", "messages") from e
    try:
        return tokenizer.encode_prompt(body.prompt, max_tokens)
    except TooManyTokens:
        raise
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), "invalid_prompt", "prompt") from e
