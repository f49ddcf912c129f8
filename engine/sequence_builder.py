"""Request intake: a request's arguments become a `Sequence` the scheduler can take, checked
against what this engine can run, with everything that depends on the output tokens given
(a resume, or a prefill worker's first token) positioned after them, as if sampled here."""

from __future__ import annotations

import torch

from common.protocol import Tenant
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams, check_request
from engine.sequence import Sequence
from engine.structured_output import StructuredOutputs
from engine.tokenizer import Tokenizer


class SequenceBuilder:
    """Builds sequences for one engine: its model's vocabulary and length, its KV cache's
    capacity, its device (seeded generators), grammars and detokenizer."""

    def __init__(self, *, vocab_size: int, max_model_len: int, max_kv_tokens: int,
                 eos_token_ids: tuple[int, ...], device: torch.device, fair: bool,
                 structured: StructuredOutputs, tokenizer: Tokenizer) -> None:
        """`max_kv_tokens`: the tokens the whole KV cache holds (one sequence may use it all);
        `fair`: tag each sequence with its client (fair share), else all run as one client's."""
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.max_kv_tokens = max_kv_tokens
        self.eos_token_ids, self.device, self.fair = eos_token_ids, device, fair
        self.structured, self.tokenizer = structured, tokenizer

    def build(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              output_token_ids: list[int] | None, tenant: Tenant | None) -> Sequence:
        """The new sequence; `ValueError` for a request this engine cannot run (engine/
        sampling_params.py check_request, or more tokens than the KV cache holds, counting the
        next one)."""
        prompt, out = list(prompt_token_ids), list(output_token_ids or [])
        check_request(prompt, out, params, self.vocab_size, self.max_model_len)
        num_tokens = len(prompt) + len(out)
        if num_tokens + 1 > self.max_kv_tokens:
            raise ValueError(f"prompt of {num_tokens} tokens does not fit in the KV cache")
        tenant = tenant or Tenant()  # who sent it: fair share, and the chain root of its blocks
        seq = Sequence(request_id, prompt, params, self.eos_token_ids,
                       tenant.client_tag if self.fair else None, tenant.cache_salt)
        seq.output_token_ids = out
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
            if not params.greedy:
                # Continue the stream of random draws where the tokens given were sampled
                # (by a prefill worker, or before a failure), so P/D equals one engine.
                Sampler.skip(seq.generator, len(out))
        if params.structured is not None:
            self.structured.start(seq)  # after the output given, as if sampled here
        seq.text_stream = self.tokenizer.decode_stream(params.skip_special_tokens)
        for t in out:
            seq.text += seq.text_stream.step(t)
        if params.logprobs is not None:
            seq.logprobs = []
        return seq
