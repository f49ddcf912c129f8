"""Seeded workloads: multi-turn chat sessions, shared-system-prompt traffic, a mix of
long-prompt/short-answer with short-prompt/long-answer requests, agents over long shared
contexts, and prompts that share nothing.

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


def agentic(num_sessions: int, seed: int = 0, num_contexts: int = 4, context_words: int = 400,
            steps: int = 3, tool_words: int = 50, max_tokens: int = 16) -> list[Session]:
    """Agents over long shared contexts (a repository, a document set): `num_contexts` long
    system prompts, each shared by the sessions assigned to it in turn, and per step a tool
    output (the new user message) appended to the history. Sent round-robin
    (`Runner.run_round_robin`), each agent comes back only after every other one took a step:
    the long think time of agentic traffic."""
    rng = random.Random(seed)
    contexts = [_text(rng, context_words) for _ in range(num_contexts)]
    return [Session(i, contexts[i % num_contexts],
                    [Turn("Tool output: " + _text(rng, tool_words), max_tokens)
                     for _ in range(steps)])
            for i in range(num_sessions)]


def no_reuse(num_requests: int, seed: int = 0, prompt_words: int = 300,
             max_tokens: int = 16) -> list[Session]:
    """Fresh prompts that share nothing past the chat template's first tokens: every prefix
    lookup misses (what a KV cache, or its tiers, cost when they cannot help)."""
    rng = random.Random(seed)
    return [Session(i, _text(rng, prompt_words), [Turn(_text(rng, 10), max_tokens)])
            for i in range(num_requests)]


WORKLOADS = {"multi-turn": multi_turn, "shared-system": shared_system, "mixed": mixed,
             "agentic": agentic, "no-reuse": no_reuse}


def build(name: str, size: int, seed: int = 0) -> list[Session]:
    try:
        return WORKLOADS[name](size, seed=seed)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}") from None
