"""Offline API in the style of vLLM / nano-vllm: `LLM(model).generate(...)` and `.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs requests to completion in this process.

    >>> llm = LLM("tiny-random")
    >>> out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4))[0]
    """

    def __init__(self, model: str | EngineConfig, **engine_args: Any) -> None:
        config = (model if isinstance(model, EngineConfig)
                  else EngineConfig(model=model, **engine_args))
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); outputs come back in prompt order."""
        batch = _as_batch(prompts)
        token_lists = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in batch]
        return self._run(token_lists, sampling_params)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [self.tokenizer.encode_chat(c, add_generation_prompt) for c in conversations]
        return self._run(token_lists, sampling_params)

    def _run(
        self,
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(token_lists)
        else:
            params = list(sampling_params)
            if len(params) != len(token_lists):
                raise ValueError("need one SamplingParams per prompt")
        ids = [f"offline-{next(self._ids)}" for _ in token_lists]
        for rid, tokens, p in zip(ids, token_lists, params, strict=True):
            self.engine.add_request(rid, tokens, p)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)
