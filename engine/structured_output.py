"""Structured outputs: the tokens a constrained request may sample next, from a grammar engine
(llguidance: a JSON schema, a regex, a choice or a Lark/GBNF grammar compiled against the model's
own vocabulary).

Each constrained sequence has a matcher that has consumed every output token so far, so a
request that arrives with output already sampled elsewhere (the decode side of P/D, a resume
after a failed worker) continues under the grammar from where it stands. Grammars are compiled
once per spec (an LRU); a matcher is cheap. Masks are computed for the constrained rows of a step
only, into one bitmask array, and applied to the logits before sampling: a disallowed token gets
-inf, so greedy, seeded and top-k/p sampling all stay inside the grammar.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import torch

from common.structured import MASK_DEADLINE_S, compile_grammar, parser_limits
from engine.mask_worker import MaskWorker
from engine.sequence import Sequence

log = logging.getLogger(__name__)


class FailedMatcher:
    """Stands in for a matcher that gave up (its limits, or the per-mask deadline): the row
    samples freely for its last token, and the stop check ends it with finish reason `error`
    (engine/stop.py), never `stop` with output that breaks the constraint."""

    def __init__(self, error: str) -> None:
        self.error = error

    def is_error(self) -> bool:
        return True

    def is_stopped(self) -> bool:
        return False

    def get_error(self) -> str:
        return self.error

    def consume_token(self, token_id: int) -> bool:
        return False


class StructuredOutputs:
    """The engine's grammar state: one tokenizer view for llguidance, one matcher per sequence."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 mask_deadline_s: float = MASK_DEADLINE_S) -> None:
        self.tokenizer_file = tokenizer_file
        self.mask_deadline_s = mask_deadline_s
        self._masks = MaskWorker(mask_deadline_s)
        self.vocab_size = vocab_size  # the model's (logits' width), which may pad the tokenizer's
        self.eos_token_ids = list(eos_token_ids)

    @functools.cached_property
    def _tokenizer(self):
        import llguidance

        return llguidance.LLTokenizer(str(self.tokenizer_file), n_vocab=self.vocab_size,
                                      eos_token=self.eos_token_ids or None)

    def start(self, seq: Sequence) -> None:
        """Give `seq` its matcher, advanced over the output it already has; ValueError when the
        spec does not compile or that output breaks it."""
        import llguidance

        s = seq.params.structured
        matcher = llguidance.LLMatcher(self._tokenizer, compile_grammar(s.kind, s.spec),
                                       log_level=0, limits=parser_limits())
        if seq.output_token_ids and not matcher.consume_tokens(seq.output_token_ids):
            raise ValueError("the output tokens given do not follow the request's structured "
                             f"output constraint: {matcher.get_error()}")
        seq.matcher = matcher

    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """-inf, in place, for every token a constrained row may not sample next."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return
        vocab = logits.shape[1]
        bits = np.empty((len(rows), (vocab + 31) // 32), dtype=np.int32)  # a bit per token, LE
        # One row after another, on one helper thread that this thread waits for, at most
        # `mask_deadline_s` a row (engine/mask_worker.py): llguidance's parallel executor
        # measured 0.83x the unconstrained decode rate on 2 cores (its threads take the CPU
        # from torch's); sequential, 0.99x (bench/grammar.py).
        given_up = set(self._masks.fill([seqs[i].matcher for i in rows], bits))
        for j, i in enumerate(rows):
            seq = seqs[i]
            # A row given up is not asked anything: its matcher is still in the helper's hands.
            if j in given_up:
                why = f"a mask failed or took longer than {self.mask_deadline_s:g} s"
            elif seq.matcher.is_error():
                why = seq.matcher.get_error() or "error"
            else:
                continue
            # This row's constraint failed: its last token is free, then it ends with an error
            # (a grammar that stalls the engine thread stalls every request on it).
            log.warning("request %s: structured output failed: %s", seq.request_id,
                        why.splitlines()[0][:200])
            seq.matcher = FailedMatcher(why)
            bits[j] = -1
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        with torch.inference_mode():  # the runner's logits are inference tensors
            allowed_t = torch.from_numpy(allowed.astype(bool)).to(logits.device)  # [rows, vocab]
            logits[rows] = logits[rows].masked_fill(~allowed_t, float("-inf"))

    @staticmethod
    def accept(seq: Sequence, token_id: int) -> bool:
        """Advance `seq`'s matcher by its sampled token; True when the grammar is complete (the
        sequence stops, as it would on EOS)."""
        matcher = seq.matcher
        if matcher is None:
            return False
        matcher.consume_token(token_id)
        return matcher.is_stopped() or matcher.is_error()
