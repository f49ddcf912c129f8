"""Seeded multi-turn sessions as token ids, and the driver that plays them into a simulated
cluster open loop (Poisson session arrivals) or closed loop (N sessions in flight)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from sim.simulator import Cluster, SimRequest

_MT_WORDS = 624  # CPython's and numpy's MT19937: the same generator, the same state


@dataclass
class SimSession:
    system: list[int]
    turns: list[tuple[list[int], int]]  # (user tokens, answer tokens) per turn
    think_s: float = 0.0


class TokenDraws:
    """Token ids drawn from a seeded `random.Random` exactly as `rng.randrange(vocab)` in a loop
    draws them, in bulk: CPython draws `randrange(vocab)` as the top bits of one MT19937 word,
    redrawn while not below `vocab`, and numpy's MT19937 is the same generator, so the words
    are drawn there from `rng`'s state, which is then moved on as far as the loop would have
    (a 30,000-token context: ~1 ms, not ~20). Equal ids are one shared int object."""

    def __init__(self, rng: random.Random, vocab: int) -> None:
        self.rng, self.vocab = rng, vocab
        # one int object per id (a model's vocabulary), shared: 8 bytes a token, not 36
        self._ids = list(range(vocab)) if vocab <= 1 << 20 else None
        self._id_objects = np.array(self._ids, dtype=object) if self._ids else None
        self._gen = np.random.MT19937(0)  # its state is `rng`'s at each draw

    def __call__(self, n: int) -> list[int]:
        """`[rng.randrange(vocab) for _ in range(n)]`, and `rng` where that leaves it."""
        rng, vocab, bits = self.rng, self.vocab, self.vocab.bit_length()
        if n < 256 or bits > 32:  # a few, or two words a draw: the loop itself
            ids = self._ids
            return [rng.randrange(vocab) if ids is None else ids[rng.randrange(vocab)]
                    for _ in range(n)]
        version, internal, gauss = rng.getstate()
        gen = self._gen
        gen.state = {"bit_generator": "MT19937",
                     "state": {"key": np.array(internal[:_MT_WORDS], dtype=np.uint32),
                               "pos": internal[_MT_WORDS]}}
        # Never a word more than the loop would use: `need` words give at most `need` ids.
        chunks, need = [], n
        while need:
            words = gen.random_raw(need) >> (32 - bits)
            chunks.append(words[words < vocab])
            need -= len(chunks[-1])
        end = gen.state["state"]
        rng.setstate((version, (*end["key"].tolist(), int(end["pos"])), gauss))
        drawn = np.concatenate(chunks)
        if self._id_objects is None:
            return drawn.tolist()
        return self._id_objects[drawn.astype(np.intp)].tolist()


def iter_multi_turn(num_sessions: int, turns: int = 4, seed: int = 0, system_tokens: int = 200,
                    user_tokens: int = 40, answer_tokens: int = 32, vocab: int = 49152,
                    think_s: float = 0.0, shared_prefixes: int | None = None
                    ) -> Iterator[SimSession]:
    """`multi_turn`'s sessions one at a time, in order."""
    rng = random.Random(seed)
    draw = TokenDraws(rng, vocab)

    def toks(mean: int) -> list[int]:
        return draw(max(1, int(mean * rng.uniform(0.5, 1.5))))

    shared = [toks(system_tokens) for _ in range(shared_prefixes or 0)]
    for _ in range(num_sessions):
        system = rng.choice(shared) if shared else toks(system_tokens)
        yield SimSession(system, [(toks(user_tokens),
                                   max(1, int(answer_tokens * rng.uniform(0.5, 1.5))))
                                  for _ in range(turns)], think_s)


def multi_turn(num_sessions: int, turns: int = 4, seed: int = 0, system_tokens: int = 200,
               user_tokens: int = 40, answer_tokens: int = 32, vocab: int = 49152,
               think_s: float = 0.0, shared_prefixes: int | None = None) -> list[SimSession]:
    """Each session: a system prompt of its own (or, with `shared_prefixes`, one of that many
    shared by all sessions: agents working on the same code base or documents), then `turns`
    user messages; lengths vary by +-50% around the given means."""
    return list(iter_multi_turn(num_sessions, turns, seed, system_tokens, user_tokens,
                                answer_tokens, vocab, think_s, shared_prefixes))


class LazySessions(Sequence):
    """`multi_turn`'s sessions, each drawn when a driver first asks for it (in order, as it
    starts them) and let go by the time it asks for the next: a fleet's worth of long contexts
    (38,400 sessions of ~30,000 tokens: 1.15 billion tokens) never sits in memory at once.
    Asking for an earlier one draws them all again from the seed (a sweep's next setting)."""

    def __init__(self, num_sessions: int, **kwargs) -> None:
        self._num, self._kwargs = num_sessions, kwargs
        self._sessions: Iterator[SimSession] | None = None
        self._at, self._current = -1, None

    def __len__(self) -> int:
        return self._num

    def __getitem__(self, i):
        if isinstance(i, slice) or not 0 <= i < self._num:
            raise IndexError(f"session {i} of {self._num}, one at a time")
        if self._sessions is None or i < self._at:
            self._sessions = iter_multi_turn(self._num, **self._kwargs)
            self._at, self._current = -1, None
        while self._at < i:
            self._current = None  # let the last one go before drawing the next
            self._current, self._at = next(self._sessions), self._at + 1
        return self._current


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
                 concurrency: int | None = None, seed: int = 0, keep_prompts: bool = True,
                 arrivals: list[float] | None = None) -> None:
        """`keep_prompts=False`: a request's prompt holds only its tokens past the full blocks
        its `prefix_hashes` cover (from `prompt_start` on), and is let go once done, its length
        kept (`num_prompt_tokens`): a fleet's long contexts would not fit in memory. `sessions`
        may be a `LazySessions` (sessions are started in order).
        `arrivals`: each session's start time (open loop, a trace), instead of a rate."""
        if sum(x is not None for x in (rate, concurrency, arrivals)) != 1:
            raise ValueError("give exactly one of rate (open loop), arrivals (a trace) or "
                             "concurrency (closed loop)")
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
        elif arrivals is not None:
            for i, t in enumerate(arrivals):
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
        s = self.sessions[i]  # its system prompt is let go once sent, where prompts are not kept
        self._turn(s.turns, s.think_s, 0, list(s.system), 0, [])

    def _turn(self, turns: list[tuple[list[int], int]], think_s: float, k: int,
              history: list[int], start: int, history_hashes: list[int]) -> None:
        """Turn `k` of a session: `history` is its conversation so far from token `start` on;
        the tokens before `start` are full blocks that `history_hashes` covers (0 where prompts
        are kept, and the rest is all the next turn's hashing needs where they are not)."""
        if k == len(turns):
            self._start_next()  # closed loop: the next session takes this one's place
            return
        user, n_answer = turns[k]
        prompt = history + user
        answer = [self.rng.randrange(49152) for _ in range(n_answer)]

        def done(req: SimRequest) -> None:
            delay = self.rng.expovariate(1 / think_s) if think_s else 0.0
            # The decode worker hashed the whole sequence: the next prompt continues it.
            hashes, req.sequence_hashes = req.sequence_hashes or [], None
            sequence = prompt + answer
            cut = 0 if self.keep_prompts else len(hashes) * self.c.profile.block_size - start
            self.c.clock.after(delay, self._turn, turns, think_s, k + 1,
                               sequence[cut:] if cut else sequence, start + cut, hashes)
            if not self.keep_prompts:  # (a summary needs their lengths only)
                req.prompt, req.answer, req.hashes, req.on_done = [], [], [], None

        req = SimRequest(next(self._ids), prompt, answer, self.c.clock.now, on_done=done,
                         prefix_hashes=history_hashes, prompt_start=start)
        self.requests.append(req)
        self.c.submit(req)
