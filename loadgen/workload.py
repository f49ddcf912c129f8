"""Seeded workloads: multi-turn chat sessions, shared-system-prompt traffic, and a mix of
long-prompt/short-answer with short-prompt/long-answer requests.

A workload is a list of `Session`s; a session is a list of turns sent one after another (each
turn's messages are the history so far plus the new user message; the answers received are
appended by the runner, so the shared prefix grows like real chat traffic).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_WORDS = ("cache block prefill decode token router worker memory network latency batch stream "
          "prompt answer model layer tensor kernel queue request policy index transfer shard "
          "graph node cluster replica budget window vector matrix sample").split()


@dataclass
class Turn:
    user: str
    max_tokens: int


@dataclass
class Session:
    session_id: int
    system: str | None
    turns: list[Turn] = field(default_factory=list)


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words)).capitalize() + "."


def multi_turn(num_sessions: int, turns: int = 4, seed: int = 0, system_words: int = 60,
               user_words: int = 20, max_tokens: int = 16) -> list[Session]:
    rng = random.Random(seed)
    return [Session(i, _text(rng, system_words),
                    [Turn(_text(rng, user_words), max_tokens) for _ in range(turns)])
            for i in range(num_sessions)]


def shared_system(num_requests: int, seed: int = 0, system_words: int = 200, user_words: int = 15,
                  max_tokens: int = 16) -> list[Session]:
    rng = random.Random(seed)
    system = _text(rng, system_words)
    return [Session(i, system, [Turn(_text(rng, user_words), max_tokens)])
            for i in range(num_requests)]


def mixed(num_requests: int, seed: int = 0, long_prompt_words: int = 300,
          long_answer_tokens: int = 64, long_prompt_fraction: float = 0.5) -> list[Session]:
    """Long prompt + short answer (prefill-heavy) interleaved with short prompt + long answer
    (decode-heavy): the traffic where a long prefill stalls colocated decode streams."""
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        if rng.random() < long_prompt_fraction:
            out.append(Session(i, None, [Turn(_text(rng, long_prompt_words), 4)]))
        else:
            out.append(Session(i, None, [Turn(_text(rng, 8), long_answer_tokens)]))
    return out


WORKLOADS = {"multi-turn": multi_turn, "shared-system": shared_system, "mixed": mixed}


def build(name: str, size: int, seed: int = 0) -> list[Session]:
    try:
        return WORKLOADS[name](size, seed=seed)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}") from None
