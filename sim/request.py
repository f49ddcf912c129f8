"""One simulated request: what the driver sends, and what the simulation records about it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from router.tiered_match import MatchByMedium


@dataclass
class SimRequest:
    request_id: int
    prompt: list[int]
    answer: list[int]  # the tokens it will generate (drawn up front: sampling is not simulated)
    arrival: float
    on_done: Callable[[SimRequest], None] | None = None
    plan: str = ""
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    done_at: float | None = None
    hashes: list[int] = field(default_factory=list)
    # The block hashes of an earlier turn's whole sequence, which this prompt continues (the
    # driver passes them on): the router's hashes of the prompt are computed past them only.
    prefix_hashes: list[int] = field(default_factory=list)
    sequence_hashes: list[int] | None = None  # prompt + answer, once done (the next turn's prefix)
    # The blocks the worker that prefilled it held, by tier (reloaded from host or disk, or on
    # its device): `num_cached_tokens` in blocks. None until prefilled.
    cached_media: MatchByMedium | None = None
    # What the router's plan counted as cached on that worker, by tier (router/policy.py).
    planned_media: MatchByMedium | None = None
    planned_cached_blocks: int = 0  # what the plan counted as cached, all tiers
    reload_s: float = 0.0  # what reloading the lower tiers' blocks cost before its prefill
    # `prompt` holds the prompt from this token on: those before it are full blocks that
    # `prefix_hashes` covers, which a driver that keeps no long history leaves out.
    prompt_start: int = 0
    # The prompt's length (prompt_start + len(prompt)): kept where a driver lets it go once done.
    num_prompt_tokens: int = -1

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = self.prompt_start + len(self.prompt)
