"""Builds the flat token batch for one scheduler step and runs the model on it.

Two attention backends: `sdpa` (engine/attention.py; the CPU path, lists turned into tensors)
and `triton` (engine/triton_attention.py; the GPU path: host arrays copied without a sync,
decode-only steps replayed from CUDA graphs unless `enforce_eager`).
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.decode_kv_mirror import DecodeKVMirror
from engine.input_buffers import InputBuffers, StepInputs, build_step_inputs, upload
from engine.model import LlamaForCausalLM
from engine.scheduler import ScheduledSeq

ATTENTION_BACKENDS = ("sdpa", "triton")


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, kvh, d]
        block_size: int,
        device: torch.device,
        attention: str = "sdpa",
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        enforce_eager: bool = True,
        decode_kv_mirror_bytes: int = 0,
        layer_ops: object | None = None,
    ) -> None:
        """`layer_ops`: the SDPA path's fused layer ops (engine/cpu_ops.py), or None; the Triton
        path uses its own (engine/fused_ops.py)."""
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention!r}; "
                             f"known: {', '.join(ATTENTION_BACKENDS)}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.attention = attention
        self.layer_ops = layer_ops
        self.max_num_seqs = max_num_seqs
        self.max_blocks = -(-max_model_len // block_size)
        self.graphs = None  # engine.cuda_graph.DecodeGraphs once enabled
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)
        if attention == "triton" and device.type == "cuda" and not enforce_eager:
            self.enable_graphs(capture=True)
        # The SDPA path keeps decode rows' KV contiguous between steps (see the module); the
        # Triton kernels read the blocks in place.
        cfg = model.cfg
        self.decode_kv = (DecodeKVMirror(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                         block_size, kv_cache.dtype, device,
                                         decode_kv_mirror_bytes)
                          if attention == "sdpa" and decode_kv_mirror_bytes > 0 else None)

    def enable_graphs(self, capture: bool) -> None:
        """Serve decode-only steps from per-bucket graphs; `capture=False` calls the captured
        functions directly (CPU tests of the bookkeeping: on CPU graphs are never used)."""
        from engine.cuda_graph import DecodeGraphs  # imports triton: only where it is used

        if self.attention != "triton":
            raise ValueError("CUDA graphs need the triton attention backend")
        buffers = InputBuffers(self.max_num_seqs, self.max_blocks, self.device)
        self.graphs = DecodeGraphs(self.model, self.kv_cache, buffers, self.num_sms, capture)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], decode_input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run one step; returns logits [num_sampling_rows, vocab] and the rows' sequences.

        `decode_input_ids` [num_decodes] on the device: the decode rows' input ids, sampled by
        the step before and not yet on the host (engine/decode_pipeline.py); the batch must
        then be decode-only."""
        if decode_input_ids is not None and any(s.num_new_tokens != 1 for s in batch):
            raise ValueError("device input ids need a decode-only batch")
        if self.attention == "triton":
            return self._execute_triton(batch, decode_input_ids)
        pending = decode_input_ids is not None
        bs = self.block_size
        # Single-token work (decodes, and one-token prefill tails) shares one padded call.
        decodes = [s for s in batch if s.num_new_tokens == 1]
        prefills = [s for s in batch if s.num_new_tokens > 1]
        decode_kv = None
        if self.decode_kv is not None:
            in_batch = decodes
            decodes, decode_kv = self.decode_kv.plan(decodes)  # in the mirror's row order
            if pending:  # the device ids are in the batch's order, the rows now the mirror's
                where = {id(item): i for i, item in enumerate(in_batch)}
                order = torch.tensor([where[id(item)] for item in decodes], dtype=torch.long,
                                     device=self.device)
                decode_input_ids = decode_input_ids.index_select(0, order)
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
                input_ids.append(0 if pending else seq.token_at(pos))
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
            if decode_kv is None:  # the gather's tables; the mirror gathers its own rows
                tables = [d.seq.block_table[:max_blocks] for d in decodes]
                tables = [t + [0] * (max_blocks - len(t)) for t in tables]
                decode_tables = torch.tensor(tables, dtype=torch.long, device=self.device)
            decode_lens = torch.tensor(lens, dtype=torch.long, device=self.device)
            key_pos = torch.arange(max_blocks * bs, device=self.device)
            attended = (key_pos[None, :] < decode_lens[:, None])[:, None, None, :]
            decode_mask = torch.zeros(attended.shape, dtype=self.kv_cache.dtype,
                                      device=self.device).masked_fill_(~attended, float("-inf"))
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
        blocks = torch.tensor(slot_blocks, dtype=torch.long, device=self.device)
        offsets = torch.tensor(slot_offsets, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_blocks=blocks,
            slot_offsets=offsets,
            num_decode_tokens=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            decode_mask=decode_mask,
            prefills=chunks,
            decode_kv=decode_kv,
            fused_ops=self.layer_ops,
            slot_mapping=None if self.layer_ops is None else blocks * bs + offsets,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        if pending:
            ids.copy_(decode_input_ids)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache, meta)  # [T, hidden]
        if self.decode_kv is not None:
            self.decode_kv.commit()
        if not sample_index:
            return hidden.new_empty((0, self.model.cfg.vocab_size)), []
        index = torch.tensor(sample_index, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[index]), sample_rows

    def _execute_triton(self, batch: list[ScheduledSeq], decode_input_ids: torch.Tensor | None
                        ) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        step = build_step_inputs(batch, self.block_size, decode_input_ids is not None)
        if (self.graphs is not None and not step.prefills
                and self.graphs.bucket_for(step.num_decodes) is not None):
            hidden = self.graphs.run(step, decode_input_ids)  # [num_decodes, hidden]
        else:
            hidden = self._eager_triton(step, decode_input_ids)  # [T, hidden]
        if not step.sample_rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size)), []
        if not step.samples_every_row:
            (index,) = upload([step.sample_index], self.device)
            hidden = hidden[index]
        return self.model.compute_logits(hidden), step.sample_rows

    def _eager_triton(self, step: StepInputs, decode_input_ids: torch.Tensor | None = None
                      ) -> torch.Tensor:  # -> [T, hidden]
        from engine.triton_attention import TritonAttentionMetadata
        from engine.triton_kernels import num_kv_splits

        tables = [c.block_table for c in step.prefills]
        ids, pos, slots, lens, decode_tables, *chunk_tables = upload(
            [step.input_ids, step.positions, step.slot_mapping, step.context_lens,
             step.block_tables, *tables], self.device)
        nd = step.num_decodes
        if decode_input_ids is not None:
            ids[:nd].copy_(decode_input_ids)
        meta = TritonAttentionMetadata(
            slot_mapping=slots, num_decode_tokens=nd, block_tables=decode_tables,
            context_lens=lens,
            num_splits=num_kv_splits(nd, self.model.cfg.num_kv_heads, self.num_sms),
            prefills=[PrefillChunk(c.query_start, c.num_query_tokens, c.context_len, t)
                      for c, t in zip(step.prefills, chunk_tables, strict=True)])
        return self.model(ids, pos, self.kv_cache, meta)
