"""Turns the logits of the sampling rows into tokens: penalties, greedy or temperature sampling
with top-k / top-p / min-p, per-request seeded generators, and top-N logprobs."""

from __future__ import annotations

from dataclasses import dataclass

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
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        # Shared generator for requests without a seed; seeded requests carry their own.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]  # logits: [N, vocab] float32
    ) -> tuple[list[int], list[Logprob | None]]:
        return self.launch(logits, seqs).resolve()

    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledBatch:
        """Pick every row's token on the logits' device and start one copy of the picks (with
        the logprobs, when asked for) to the host; `resolve()` reads them."""
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
        else:
            tokens = torch.zeros(num_rows, dtype=torch.long, device=logits.device)
            if len(rows) < num_rows:
                greedy_rows = torch.tensor([i for i, g in enumerate(greedy) if g],
                                           device=logits.device)
                tokens[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
            tokens[torch.tensor(rows, device=logits.device)] = self._sample(logits, seqs, rows)

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

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        """Tokens [len(rows)] of the non-greedy rows, on the logits' device."""
        vocab = logits.shape[1]
        probs = self._probs(logits[rows], [seqs[i] for i in rows])  # [len(rows), vocab]
        # Inverse-CDF sampling: the first token whose cumulative probability exceeds u,
        # u ~ U[0, total). One uniform per row (the exponential race drew a whole vocabulary
        # of exponentials: 1.1 ms a row on this CPU against 0.03 ms). A seeded request draws
        # from its own generator, so P/D and resume replay it exactly (see `skip`); the rest
        # share one draw from the engine's generator.
        cdf = probs.cumsum(dim=-1)  # [len(rows), vocab]
        u = torch.empty(len(rows), 1, device=probs.device)
        shared = [j for j, r in enumerate(rows) if seqs[r].generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), 1, generator=self.generator, device=probs.device)
        for j, r in enumerate(rows):
            if seqs[r].generator is not None:
                u[j] = torch.rand(1, generator=seqs[r].generator, device=probs.device)
        # right=True never lands on a zero-probability token; u < 1 keeps it inside the vocab.
        return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1).view(-1)

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
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                               device=logits.device)
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
        temps = torch.tensor([s.params.temperature for s in seqs], device=device)
        logits = logits / temps[:, None]
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        if all(k is None for k in top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
            return torch.softmax(logits, dim=-1)
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, vocab]
        ks = torch.tensor([min(k or vocab, vocab) for k in top_k], device=device)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # top-p: keep the smallest head whose mass reaches p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        ps = torch.tensor(top_p, device=device)
        drop = mass_before >= ps[:, None]
        # min-p: drop tokens below min_p times the top probability.
        mps = torch.tensor(min_p, device=device)
        drop |= probs < mps[:, None] * probs[:, :1]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return torch.softmax(filtered, dim=-1)


def _to_host(tokens: torch.Tensor, values: torch.Tensor, counts: list[int | None],
             top_n: int) -> SampledBatch:
    if values.device.type != "cuda":
        return SampledBatch(tokens, values, None, counts, top_n)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return SampledBatch(tokens, host, ready, counts, top_n)
