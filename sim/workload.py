"""Seeded multi-turn sessions as token ids, and the driver that plays them into a simulated
cluster open loop (Poisson session arrivals) or closed loop (N sessions in flight)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sim.simulator import Cluster, SimRequest


@dataclass
class SimSession:
    system: list[int]
    turns: list[tuple[list[int], int]]  # (user tokens, answer tokens) per turn
    think_s: float = 0.0


def multi_turn(num_sessions: int, turns: int = 4, seed: int = 0, system_tokens: int = 200,
               user_tokens: int = 40, answer_tokens: int = 32, vocab: int = 49152,
               think_s: float = 0.0, shared_prefixes: int | None = None) -> list[SimSession]:
    """Each session: a system prompt of its own (or, with `shared_prefixes`, one of that many
    shared by all sessions: agents working on the same code base or documents), then `turns`
    user messages; lengths vary by +-50% around the given means."""
    rng = random.Random(seed)
    ids = list(range(vocab))  # one int object per id, shared: 8 bytes a token, not 36

    def toks(mean: int) -> list[int]:
        return [ids[rng.randrange(vocab)]
                for _ in range(max(1, int(mean * rng.uniform(0.5, 1.5))))]

    shared = [toks(system_tokens) for _ in range(shared_prefixes or 0)]
    return [SimSession(rng.choice(shared) if shared else toks(system_tokens),
                       [(toks(user_tokens), max(1, int(answer_tokens * rng.uniform(0.5, 1.5))))
                        for _ in range(turns)], think_s)
            for _ in range(num_sessions)]


def from_chat(text_sessions, tokenizer) -> list[SimSession]:
    """`loadgen.workload` chat sessions as the token ids the router sends (system and user
    messages through the model's chat template), for replaying a real run."""
    sessions = []
    for s in text_sessions:
        system = tokenizer.encode_chat([{"role": "system", "content": s.system}],
                                       add_generation_prompt=False)
        turns = [(tokenizer.encode_chat([{"role": "user", "content": t.user}],
                                        add_generation_prompt=True),
                  t.max_tokens) for t in s.turns]
        sessions.append(SimSession(system, turns))
    return sessions


class Driver:
    """Plays sessions: turn k's prompt is the system prompt plus every earlier turn's user tokens
    and answer, plus turn k's user tokens (what a chat client sends)."""

    def __init__(self, cluster: Cluster, sessions: list[SimSession], *, rate: float | None = None,
                 concurrency: int | None = None, seed: int = 0, keep_prompts: bool = True) -> None:
        """`keep_prompts=False`: a request's prompt (and what holds it) is let go once it is
        done, its length kept (`num_prompt_tokens`): long contexts would not fit in memory."""
        if (rate is None) == (concurrency is None):
            raise ValueError("give exactly one of rate (open loop) or concurrency (closed loop)")
        self.c, self.sessions, self.keep_prompts = cluster, sessions, keep_prompts
        self.rng = random.Random(seed)
        self.requests: list[SimRequest] = []
        self._ids = iter(range(1 << 62))
        self._next_session = 0
        if rate is not None:
            t = 0.0
            for i in range(len(sessions)):
                t += self.rng.expovariate(rate)
                self.c.clock.at(t, self._start, i)
            self._next_session = len(sessions)
        else:
            for _ in range(min(concurrency, len(sessions))):
                self._start_next()

    def _start_next(self) -> None:
        if self._next_session < len(self.sessions):
            self._next_session += 1
            self._start(self._next_session - 1)

    def _start(self, i: int) -> None:
        self._turn(i, 0, list(self.sessions[i].system), [])

    def _turn(self, i: int, k: int, history: list[int], history_hashes: list[int]) -> None:
        s = self.sessions[i]
        if k == len(s.turns):
            self._start_next()  # closed loop: the next session takes this one's place
            return
        user, n_answer = s.turns[k]
        prompt = history + user
        answer = [self.rng.randrange(49152) for _ in range(n_answer)]

        def done(req: SimRequest) -> None:
            delay = self.rng.expovariate(1 / s.think_s) if s.think_s else 0.0
            # The decode worker hashed the whole sequence: the next prompt continues it.
            hashes, req.sequence_hashes = req.sequence_hashes or [], None
            self.c.clock.after(delay, self._turn, i, k + 1, prompt + answer, hashes)
            if not self.keep_prompts:
                req.prompt, req.on_done = [], None

        req = SimRequest(next(self._ids), prompt, answer, self.c.clock.now, on_done=done,
                         prefix_hashes=history_hashes)
        self.requests.append(req)
        self.c.submit(req)
