"""Tandem's model runtime: Llama-family model, paged KV cache with prefix caching, continuous
batching scheduler, sampler, and the offline `LLM` API."""

from engine.config import EngineConfig, ModelConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams"]
