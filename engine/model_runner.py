"""Builds the flat token batch for one scheduler step and runs the model on it."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.model import LlamaForCausalLM
from engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, kvh, d]
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run one step; returns logits [num_sampling_rows, vocab] and the rows' sequences."""
        bs = self.block_size
        # Single-token work (decodes, and one-token prefill tails) shares one padded call.
        decodes = [s for s in batch if s.num_new_tokens == 1]
        prefills = [s for s in batch if s.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        sample_index: list[int] = []
        sample_rows: list[ScheduledSeq] = []

        def add_tokens(item: ScheduledSeq) -> None:
            seq = item.seq
            start = seq.num_computed_tokens
            for pos in range(start, start + item.num_new_tokens):
                input_ids.append(seq.token_at(pos))
                positions.append(pos)
                slot_blocks.append(seq.block_table[pos // bs])
                slot_offsets.append(pos % bs)
            if item.samples:
                sample_index.append(len(input_ids) - 1)
                sample_rows.append(item)

        for item in decodes:
            add_tokens(item)
        decode_tables = decode_lens = decode_mask = None
        if decodes:
            lens = [d.seq.num_computed_tokens + 1 for d in decodes]
            max_blocks = -(-max(lens) // bs)
            tables = [d.seq.block_table[:max_blocks] for d in decodes]
            tables = [t + [0] * (max_blocks - len(t)) for t in tables]
            decode_tables = torch.tensor(tables, dtype=torch.long, device=self.device)
            decode_lens = torch.tensor(lens, dtype=torch.long, device=self.device)
            key_pos = torch.arange(max_blocks * bs, device=self.device)
            decode_mask = (key_pos[None, :] < decode_lens[:, None])[:, None, None, :]
        chunks: list[PrefillChunk] = []
        for item in prefills:
            start = len(input_ids)
            add_tokens(item)
            ctx = item.seq.num_computed_tokens + item.num_new_tokens
            table = item.seq.block_table[: -(-ctx // bs)]
            chunks.append(
                PrefillChunk(
                    query_start=start,
                    num_query_tokens=item.num_new_tokens,
                    context_len=ctx,
                    block_table=torch.tensor(table, dtype=torch.long, device=self.device),
                )
            )
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=self.device),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            decode_mask=decode_mask,
            prefills=chunks,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache, meta)  # [T, hidden]
        if not sample_index:
            return hidden.new_empty((0, self.model.cfg.vocab_size)), []
        index = torch.tensor(sample_index, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[index]), sample_rows
