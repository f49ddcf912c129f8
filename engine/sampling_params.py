"""Per-request sampling parameters of the engine (validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common import bounds
from common.protocol import SamplingOptions, StructuredOutput

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = bounds.MAX_LOGPROBS


@dataclass
class SamplingParams:
    """vLLM-style sampling parameters. `temperature == 0` means greedy.

    Invalid values raise `ValueError` naming the field, so an API layer can turn them into a 400.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # engine/structured_output.py
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        # The same ranges as the wire models (common/bounds.py): whatever reaches the engine by
        # any path is inside them, so no value can break a tensor op on the engine thread.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, int | float) and math.isfinite(value), name,
                   f"must be a finite number, got {value!r}")
        _check(0.0 <= self.temperature <= 100.0, "temperature",
               f"must be in [0, 100], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            self.top_k is None
            or (isinstance(self.top_k, int) and 1 <= self.top_k <= bounds.MAX_TOP_K),
            "top_k",
            f"must be None or an integer in [1, {bounds.MAX_TOP_K}], got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= bounds.MAX_TOKENS,
            "max_tokens",
            f"must be an integer in [1, {bounds.MAX_TOKENS}], got {self.max_tokens}",
        )
        _check(self.seed is None or (isinstance(self.seed, int)
                                     and bounds.INT64_MIN <= self.seed <= bounds.INT64_MAX),
               "seed", f"must be a 64-bit signed integer, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        _check(len(self.stop) <= bounds.MAX_STOP_STRINGS
               and all(isinstance(s, str) and 0 < len(s) <= bounds.MAX_STOP_CHARS
                       for s in self.stop),
               "stop", f"must be at most {bounds.MAX_STOP_STRINGS} non-empty strings of at most "
               f"{bounds.MAX_STOP_CHARS} characters")
        _check(len(self.stop_token_ids) <= bounds.MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"must be at most {bounds.MAX_STOP_TOKEN_IDS} ids")
        _check(all(isinstance(t, int) and 0 <= t <= bounds.MAX_TOKEN_ID
                   for t in self.stop_token_ids),
               "stop_token_ids", f"must be integers in [0, {bounds.MAX_TOKEN_ID}]")
        bias = self.logit_bias or {}
        _check(len(bias) <= bounds.MAX_LOGIT_BIAS and all(
            isinstance(t, int) and 0 <= t <= bounds.MAX_TOKEN_ID and isinstance(v, int | float)
            and math.isfinite(v) and -100.0 <= v <= 100.0 for t, v in bias.items()),
            "logit_bias",
            f"must map at most {bounds.MAX_LOGIT_BIAS} token ids to biases in [-100, 100]")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_options(cls, options: SamplingOptions) -> SamplingParams:
        return cls(**{**options.model_dump(), "structured": options.structured})

    def to_options(self) -> SamplingOptions:
        data = {k: getattr(self, k) for k in SamplingOptions.model_fields}
        return SamplingOptions(**data)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}: {message}")


def check_request(prompt: list[int], output: list[int], params: SamplingParams, vocab_size: int,
                  max_model_len: int) -> None:
    """Raise `ValueError` for a request this model cannot run: an empty prompt, token ids
    outside the vocabulary, given output that already reaches `max_tokens`, a `top_k` past the
    vocabulary, or more tokens than the context holds."""
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    if len(output) >= params.max_tokens:
        raise ValueError(f"{len(output)} output tokens given already reach "
                         f"max_tokens={params.max_tokens}")
    if any(not (0 <= t < vocab_size) for t in prompt + output):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError("invalid sampling parameter logit_bias: "
                         f"token ids must be in [0, {vocab_size})")
    if params.top_k is not None and params.top_k > vocab_size:
        raise ValueError(f"invalid sampling parameter top_k: must be at most the vocabulary "
                         f"size {vocab_size}, got {params.top_k}")
    total = len(prompt) + len(output)
    if total >= max_model_len:
        raise ValueError(f"prompt has {total} tokens; this model's context is "
                         f"{max_model_len} tokens")
