"""Turns the logits of the sampling rows into tokens: penalties, greedy or temperature sampling
with top-k / top-p / min-p, and top-N logprobs.

Each sampled token takes one uniform draw u, and every request has its own stream of them, so a
row's draw never depends on which other rows share its batch (an overlapped decode step may
sample a row that is dropped afterwards: engine/decode_pipeline.py):

- a request with a seed draws from its own `torch.Generator` (`Sequence.generator`), one draw per
  sampled token in order, so P/D and resume replay it exactly by skipping the draws of the tokens
  given (`Sampler.skip`);
- a request without one draws u = mix(key, n): its key, fixed at its first draw, is a hash of
  the engine's seed, the request id and a count of the streams keyed before (`Sampler.key`), n
  the index of the token in its output (counter-based: a stream is keyed and offset, as Philox
  is). The mix is SplitMix64's output function, vectorised over the rows in numpy (about 6 us a
  step at batch 8 or 64, where per-request device generators would launch a kernel a row); the
  draws reach the device in one non-blocking copy. A run is reproducible from the engine's seed
  and the order in which requests first sample.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from engine.sequence import Logprob, Sequence


@dataclass
class SampledBatch:
    """A step's picks, launched on the device and copied to the host without a sync (an
    overlapped decode step reads them after the next step is queued: engine/decode_pipeline.py)."""

    token_ids: torch.Tensor  # [N] int64 on the logits' device (the next step's input ids)
    host: torch.Tensor  # [N] int64, or [N, 2 + 2 * top_n] float64 with logprobs; pinned on CUDA
    ready: torch.cuda.Event | None  # recorded after the copy to `host` (CUDA only)
    logprob_counts: list[int | None]  # each row's params.logprobs
    top_n: int

    def wait(self) -> None:
        """Until the picks are on the host (and the step that made them has run)."""
        if self.ready is not None:
            self.ready.synchronize()

    def resolve(self) -> tuple[list[int], list[Logprob | None]]:
        """The tokens (and logprobs) on the host; waits for this batch's copy alone."""
        self.wait()
        logprobs: list[Logprob | None] = [None] * len(self.logprob_counts)
        if self.host.dtype == torch.int64:
            return self.host.tolist(), logprobs
        packed, top_n = self.host.tolist(), self.top_n
        token_ids = [int(row[0]) for row in packed]
        for i, n in enumerate(self.logprob_counts):
            if n is not None:
                row = packed[i]
                top = [(int(t), v) for t, v in zip(row[2 : 2 + n], row[2 + top_n : 2 + top_n + n],
                                                   strict=True)] if n else []
                logprobs[i] = Logprob(token_ids[i], row[1], top)
        return token_ids, logprobs


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        """`seed`: the engine's, which keys the draws of requests without their own."""
        self.seed = seed
        self.num_keys = 0  # streams keyed so far

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]  # logits: [N, vocab] float32
    ) -> tuple[list[int], list[Logprob | None]]:
        return self.launch(logits, seqs).resolve()

    def launch(self, logits: torch.Tensor, seqs: list[Sequence],
               num_pending: int = 0) -> SampledBatch:
        """Pick every row's token on the logits' device and start one copy of the picks (with
        the logprobs, when asked for) to the host; `resolve()` reads them. `num_pending`: the
        tokens each row sampled that are not in its output yet (1 in an overlapped step)."""
        num_rows = logits.shape[0]
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = self._apply_penalties(self._apply_biases(logits, seqs), seqs)
        greedy = [s.params.greedy for s in seqs]
        rows = [i for i, g in enumerate(greedy) if not g]
        # Every row's token is picked on the logits' device; the host reads them in one
        # transfer at the end (with the logprobs, when asked for).
        if not rows:
            tokens = logits.argmax(dim=-1)  # [N]
        elif len(rows) == num_rows:
            tokens = self._sample(logits, seqs, num_pending)
        else:
            tokens = torch.zeros(num_rows, dtype=torch.long, device=logits.device)
            greedy_rows = _on([i for i, g in enumerate(greedy) if g], torch.long, logits.device)
            tokens[greedy_rows] = logits.index_select(0, greedy_rows).argmax(dim=-1)
            sampled = _on(rows, torch.long, logits.device)
            tokens[sampled] = self._sample(logits.index_select(0, sampled),
                                           [seqs[i] for i in rows], num_pending)

        counts = [s.params.logprobs for s in seqs]
        if raw_logprobs is None:
            return _to_host(tokens, tokens, counts, 0)
        top_n = max(s.params.logprobs or 0 for s in seqs)
        columns = [tokens[:, None].double(), raw_logprobs.gather(1, tokens[:, None]).double()]
        if top_n:
            values, ids = raw_logprobs.topk(top_n, dim=-1)  # [N, top_n]
            columns += [ids.double(), values.double()]  # token ids are exact in float64
        packed = torch.cat(columns, dim=1)  # [N, 2 + 2 * top_n], one transfer
        return _to_host(tokens, packed, counts, top_n)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                num_pending: int) -> torch.Tensor:
        """Tokens [n] of non-greedy rows (logits [n, vocab]), on the logits' device."""
        vocab = logits.shape[1]
        probs = self._probs(logits, seqs)  # [n, vocab]
        # Inverse-CDF sampling: the first token whose cumulative probability exceeds u,
        # u ~ U[0, total). One uniform per row (the exponential race drew a whole vocabulary
        # of exponentials: 1.1 ms a row on this CPU against 0.03 ms).
        cdf = probs.cumsum(dim=-1)  # [n, vocab]
        u = self._uniforms(seqs, num_pending, probs.device)
        # right=True never lands on a zero-probability token; u < 1 keeps it inside the vocab.
        return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1).view(-1)

    def _uniforms(self, seqs: list[Sequence], num_pending: int,
                  device: torch.device) -> torch.Tensor:
        """One draw in [0, 1) per row, [len(seqs), 1] on `device` (module docstring)."""
        keyed = [j for j, s in enumerate(seqs) if s.generator is None]
        u = None
        if keyed:
            keys = np.fromiter((self.key(seqs[j]) for j in keyed), np.uint64, len(keyed))
            index = np.fromiter((len(seqs[j].output_token_ids) + num_pending for j in keyed),
                                np.uint64, len(keyed))
            drawn = torch.from_numpy(counter_uniforms(keys, index)[:, None])
            if device.type == "cuda":  # pinned: the copy runs without a host sync
                drawn = drawn.pin_memory().to(device, non_blocking=True)
            if len(keyed) == len(seqs):
                return drawn
            u = torch.empty(len(seqs), 1, device=device)
            u[_on(keyed, torch.long, device)] = drawn
        if u is None:
            u = torch.empty(len(seqs), 1, device=device)
        for j, s in enumerate(seqs):
            if s.generator is not None:
                u[j] = torch.rand(1, generator=s.generator, device=device)
        return u

    def key(self, seq: Sequence) -> int:
        """The key of `seq`'s stream of draws without a seed, fixed at its first draw: a hash
        of the engine's seed, its id and how many streams this sampler keyed before (an id may
        come back: a client's X-Request-Id; the same answer again would be no sample)."""
        if seq.sample_key is None:
            name = f"{self.seed}\0{self.num_keys}\0{seq.request_id}"
            seq.sample_key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8)
                                            .digest(), "little")
            self.num_keys += 1
        return seq.sample_key

    @staticmethod
    def skip(generator: torch.Generator, num_samples: int) -> None:
        """Advance `generator` past `num_samples` samples (each draws one uniform)."""
        for _ in range(num_samples):
            torch.rand(1, generator=generator, device=generator.device)

    @staticmethod
    def _apply_biases(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """`logit_bias`, and -inf for EOS and stop tokens while a row is short of `min_tokens`."""
        rows = [i for i, s in enumerate(seqs) if s.params.logit_bias
                or len(s.output_token_ids) < s.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p = seqs[i].params
            if p.logit_bias:
                ids = _on(list(p.logit_bias), torch.long, logits.device)
                logits[i, ids] += _on(list(p.logit_bias.values()), logits.dtype, logits.device)
            if len(seqs[i].output_token_ids) < p.min_tokens:
                banned = [t for t in (*seqs[i].eos_token_ids, *p.stop_token_ids)
                          if t < logits.shape[1]]
                logits[i, banned] = float("-inf")
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if s.params.needs_penalties and s.output_token_ids]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            p = seqs[i].params
            ids = torch.tensor(seqs[i].output_token_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)  # [vocab]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        return logits

    @staticmethod
    def _probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Temperature, then top-k / top-p / min-p filtering; returns probabilities."""
        device = logits.device
        temps = _on([s.params.temperature for s in seqs], logits.dtype, device)
        logits = logits / temps[:, None]
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        if all(k is None for k in top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
            return torch.softmax(logits, dim=-1)
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, vocab]
        ks = _on([min(k or vocab, vocab) for k in top_k], torch.long, device)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # top-p: keep the smallest head whose mass reaches p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        ps = _on(top_p, logits.dtype, device)
        drop = mass_before >= ps[:, None]
        # min-p: drop tokens below min_p times the top probability.
        mps = _on(min_p, logits.dtype, device)
        drop |= probs < mps[:, None] * probs[:, :1]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return torch.softmax(filtered, dim=-1)


def _on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A few host values as a tensor on `device`. On CUDA through pinned memory without
    blocking: `torch.tensor(values, device="cuda")` waits for the stream, which would hold the
    host until the step just queued has run (and end an overlapped step's point)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _to_host(tokens: torch.Tensor, values: torch.Tensor, counts: list[int | None],
             top_n: int) -> SampledBatch:
    if values.device.type != "cuda":
        return SampledBatch(tokens, values, None, counts, top_n)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return SampledBatch(tokens, host, ready, counts, top_n)


# SplitMix64 (Steele, Lea and Flood 2014): the state advances by the golden gamma, the output
# function mixes it. Draw n of a stream is the output at state key + (n + 1) * gamma.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_ONE, _S27, _S30, _S31, _S40 = (np.uint64(n) for n in (1, 27, 30, 31, 40))
_UNIT = np.float32(2.0**-24)


def counter_uniforms(keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Draw `index` of each stream `keys` (both uint64 [n]) as float32 in [0, 1): the top 24
    bits of SplitMix64's output, exact in float32 and never 1. In place on one array: numpy's
    cost here is per call, not per row (about 6 us at 8 rows and at 64 rows)."""
    z = index + _ONE  # uint64 arithmetic wraps modulo 2**64
    z *= _GAMMA
    z += keys
    z ^= z >> _S30
    z *= _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    z >>= _S40
    out = z.astype(np.float32)
    out *= _UNIT
    return out
