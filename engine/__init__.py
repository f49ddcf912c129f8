"""Tandem's model runtime: Llama-family model, paged KV cache with prefix caching, continuous
batching scheduler, sampler, and the offline `LLM` API.

The names below load on first use, so `engine.model_store` (what `tandem prepare-model`
needs) imports without torch: the router image, which has no torch, downloads tokenizers
with it (the chart's `model.source: huggingface`)."""

from __future__ import annotations

import importlib

_WHERE = {"EngineConfig": "engine.config", "ModelConfig": "engine.config", "LLM": "engine.llm",
          "LLMEngine": "engine.llm_engine", "RequestOutput": "engine.llm_engine",
          "SamplingParams": "engine.sampling_params"}

__all__ = ["LLM", "EngineConfig", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
