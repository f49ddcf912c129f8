"""Decode-only steps replayed from CUDA graphs, one graph per batch bucket (as nano-vllm and
vLLM v1 do it).

Buckets are 1, 2, 4, 8, then steps of 16 up to `max_num_seqs` (and `max_num_seqs` itself). Each
graph runs the model from embedding to final norm over static inputs (engine/input_buffers.py)
into a static hidden-state buffer; the LM head and the sampler stay outside. Graphs are captured
largest first into one shared memory pool, each after one eager warm-up call (Triton JIT and
cuBLAS set-up happen there, never inside a capture). A step of n rows replays the smallest
bucket >= n; the padded rows write no KV (slot -1) and attend to nothing (context length 0).

`capture=False` keeps the same per-bucket functions and calls them directly instead of
replaying a graph: the CPU tests run the whole bookkeeping that way.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from engine.input_buffers import InputBuffers, StepInputs
from engine.model import LlamaForCausalLM
from engine.triton_attention import TritonAttentionMetadata
from engine.triton_kernels import num_kv_splits


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 32, 48, ... up to max_num_seqs, and it."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, buffers: InputBuffers,
                 num_sms: int, capture: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, block_size, kvh, d]
        self.buffers = buffers
        self.buckets = graph_buckets(buffers.max_num_seqs)
        cfg = model.cfg
        weight = model.model.embed_tokens.weight
        self.hidden = torch.zeros(buffers.max_num_seqs, cfg.hidden_size, dtype=weight.dtype,
                                  device=weight.device)  # [max_num_seqs, hidden]
        self._metas = {
            b: TritonAttentionMetadata(
                slot_mapping=buffers.slot_mapping[:b], num_decode_tokens=b,
                block_tables=buffers.block_tables[:b], context_lens=buffers.context_lens[:b],
                num_splits=num_kv_splits(b, cfg.num_kv_heads, num_sms))
            for b in self.buckets
        }
        self.pool = None
        self._graphs: list[torch.cuda.CUDAGraph] = []  # kept alive: replay needs them
        self._replay: dict[int, Callable[[], None]] = {}
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self._replay[b] = self._capture(b) if capture else self._forward_fn(b)
            buffers.clear()  # the warm-up calls left nothing behind, but start clean anyway
        if capture:
            torch.cuda.synchronize()

    def _forward_fn(self, bucket: int) -> Callable[[], None]:
        buffers, meta = self.buffers, self._metas[bucket]

        def forward() -> None:
            hidden = self.model(buffers.input_ids[:bucket], buffers.positions[:bucket],
                                self.kv_cache, meta)  # [bucket, hidden]
            self.hidden[:bucket].copy_(hidden)

        return forward

    def _capture(self, bucket: int) -> Callable[[], None]:
        forward = self._forward_fn(bucket)
        self.buffers.clear()  # every row padding: the warm-up and the capture write no KV
        forward()  # warm-up, eager
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a worker's KV transfer) do not break it.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            forward()
        if self.pool is None:
            self.pool = graph.pool()
        self._graphs.append(graph)
        return graph.replay

    def bucket_for(self, num_rows: int) -> int | None:
        """The smallest bucket that holds `num_rows`, None if none does."""
        i = bisect.bisect_left(self.buckets, num_rows)
        return self.buckets[i] if i < len(self.buckets) and num_rows > 0 else None

    def run(self, step: StepInputs, decode_input_ids: torch.Tensor | None = None
            ) -> torch.Tensor:  # -> [num_decodes, hidden]
        """Run a decode-only step through its bucket's graph; `decode_input_ids` [num_decodes]
        (on the device) replace the step's input ids by a device-to-device copy. The view
        returned is valid until the next call."""
        bucket = self.bucket_for(step.num_decodes)
        if bucket is None:
            raise ValueError(f"no graph holds {step.num_decodes} rows")
        self.buffers.load(step, bucket)
        if decode_input_ids is not None:
            self.buffers.input_ids[: step.num_decodes].copy_(decode_input_ids)
        self._replay[bucket]()
        return self.hidden[: step.num_decodes]

    def replay(self, bucket: int) -> None:
        """Replay `bucket`'s graph on the inputs already in the buffers (the last step's: it
        rewrites the same KV slots with the same values). For timing the graph alone."""
        self._replay[bucket]()
