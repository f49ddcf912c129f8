"""One request's state inside the engine: its tokens, its blocks and how far it is computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sampling_params import SamplingParams
from engine.tokenizer import TextStream


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated, being filled by a KV transfer
    LOADING = "loading"  # blocks allocated, being filled from the KV tiers (kv_cache_manager.py)
    PARKED = "parked"  # out of the batch while its reader is behind (engine/scheduler.py)
    FINISHED = "finished"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    client: str | None = None  # who sent it (the router's opaque tag): engine/fair_share.py
    cache_salt: str | None = None  # its blocks' chain root (common/hashing.py chain_root)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    # ... of which by the tier they were in ("device", "host", "disk"); None: none cached
    num_cached_tokens_by_medium: dict[str, int] | None = None
    reloaded_media: dict[int, str] = field(default_factory=dict)  # block hash -> tier reloaded from
    tier_loaded: bool = False  # its tier load ran at this admission: not started again
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of this seq's full blocks
    num_published_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_preemptions: int = 0
    # Prefill-only requests stop after their first token but keep their blocks (for export).
    hold_blocks: bool = False
    generator: torch.Generator | None = None  # a seeded request's draws (engine/sampler.py)
    sample_key: int | None = None  # the key of its draws without a seed, once sampled
    # llguidance's matcher of a structured-output request (structured_output.py)
    matcher: Any = None
    text_stream: TextStream | None = None
    text: str = ""
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]
