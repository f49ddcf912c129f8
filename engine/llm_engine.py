"""The engine core: requests in, one batched model step's outputs per `step()`. It owns the
requests and their outputs (tokens appended, stops checked, finishing); its parts do the rest:
the scheduler over the KV store (engine/kv_store.py: the cache, block pool, tiers and the KV
cache manager), the model runner, the sampler, request intake (engine/sequence_builder.py),
KV imports (engine/kv_imports.py) and, in steady decode on CUDA, the overlapped loop that has
the next step queued already (engine/decode_pipeline.py).
For the P/D workers:
- `add_request(..., hold_blocks=True)`: prefill to the first token and keep the prompt's blocks
  (for export) until `release(request_id)`;
- `add_imported_request` / `finish_import`: allocate blocks that a KV transfer fills, then join
  the batch (waiting if it is full), or fall back to local prefill if the transfer failed.
"""

from __future__ import annotations

import threading
import time

import torch

from common.model_identity import model_digest
from common.protocol import Tenant
from engine.config import EngineConfig, ModelConfig
from engine.cpu_ops import cpu_layer_ops
from engine.decode_pipeline import DecodePipeline
from engine.kv_imports import KVImports
from engine.kv_store import KVStore
from engine.model_runner import ModelRunner
from engine.model_store import resolve_model
from engine.output import RequestOutput, output_of
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Logprob, Sequence, SequenceStatus
from engine.sequence_builder import SequenceBuilder
from engine.stop import stop_reason
from engine.structured_output import StructuredOutputs
from engine.tokenizer import Tokenizer
from engine.weights import load_model

# The methods another thread may call while a step's model forward runs, under `LLMEngine.lock`
# (a peer prefix pull's two ends: engine/prefix_pins.py). They touch only cached and free blocks
# of the pool, never a block the running step reads or writes, so a pull does not wait for the
# step a busy worker is in (a long prefill step takes seconds on a CPU).
MID_STEP_METHODS = frozenset({"pin_prefix", "reserve_prefix", "commit_prefix"})


class DuplicateRequestId(ValueError):
    """A request id that a running, held or importing request already has."""


class LLMEngine:
    """`lock`: held by `step()` except while the model runs, and by whoever else calls into the
    engine between steps while a `MID_STEP_METHODS` call may run on another thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.lock = threading.Lock()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.folder = resolve_model(config.model, config.cache_dir)
        self.model_config = ModelConfig.from_folder(self.folder)
        self.model_id = config.model_id or self.folder.name
        # What the router and peers compare: the hash seed and the KV layout carry it, so blocks
        # of two different models never match even under one served name.
        self.model_digest = model_digest(self.folder)
        self.tokenizer = Tokenizer(self.folder)
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.torch_dtype_name)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.eos_token_ids = mc.stop_ids(self.tokenizer.eos_token_id)

        self.model = load_model(self.folder, mc, self.max_model_len, self.device, self.dtype,
                                config.pack_weights, config.load_format, config.seed)

        # The KV cache, its block pool and tiers, the manager over them (engine/kv_store.py).
        self.store = KVStore(config, mc, self.model_digest, self.dtype, self.device,
                             lambda: self.pipeline and self.pipeline.wait())
        st = self.store
        self.block_size, self.num_blocks, self.kv_cache = st.block_size, st.num_blocks, st.kv_cache
        self.hasher, self.tiers, self.pool, self.kv = st.hasher, st.tiers, st.pool, st.kv
        # A peer prefix pull's two ends (engine/prefix_pins.py), called by name like the rest.
        self.pins = st.pins
        self.pin_prefix, self.reserve_prefix = self.pins.pin, self.pins.reserve
        self.commit_prefix = self.pins.commit
        self.drain_events, self.cached_hashes = st.drain_events, st.cached_hashes
        self.cached_hashes_by_medium, self.close = st.cached_hashes_by_medium, st.close
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, config.max_long_prefills)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_size, self.device,
                                  attention=config.attention, max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager,
                                  decode_kv_mirror_bytes=config.decode_kv_mirror_bytes,
                                  layer_ops=cpu_layer_ops(config.cpu_ops, self.device, self.dtype,
                                                          self.kv_cache.dtype,
                                                          config.attention))
        self.sampler = Sampler(config.seed)
        self.structured = StructuredOutputs(self.folder / "tokenizer.json", mc.vocab_size,
                                            self.eos_token_ids)
        self.builder = SequenceBuilder(
            vocab_size=mc.vocab_size, max_model_len=self.max_model_len,
            max_kv_tokens=self.num_blocks * self.block_size, eos_token_ids=self.eos_token_ids,
            device=self.device, structured=self.structured, tokenizer=self.tokenizer,
            fair=config.scheduling_policy == "fair")  # fcfs: all as one client's (fair_share.py)
        self.requests: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # prefill-only requests keeping their blocks
        self.pipeline = DecodePipeline(self.scheduler, self.kv, self.runner, self.sampler,
                                       self.append_token, self.max_model_len
                                       ) if config.overlaps_steps else None
        self.imports = KVImports(self.scheduler, self.kv,
                                 self.pipeline.wait if self.pipeline is not None else lambda: None)

    # ---- requests -------------------------------------------------------------------------

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      output_token_ids: list[int] | None, tenant: Tenant | None = None) -> Sequence:
        if request_id in self.requests or request_id in self.held or request_id in self.imports:
            raise DuplicateRequestId(f"request id {request_id!r} is already in use")
        return self.builder.build(request_id, prompt_token_ids, params, output_token_ids, tenant)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        output_token_ids: list[int] | None = None,
        hold_blocks: bool = False,
        tenant: Tenant | None = None,
    ) -> None:
        """Queue a request; `output_token_ids` continue an earlier stream (resume)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params or SamplingParams(),
                                 output_token_ids, tenant)
        seq.hold_blocks = hold_blocks
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def add_imported_request(self, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams, output_token_ids: list[int] | None = None,
                             tenant: Tenant | None = None) -> tuple[Sequence, int]:
        """Allocate blocks for a prompt whose KV comes from elsewhere (engine/kv_imports.py).

        KV is imported for every token but the last known one (`output_token_ids[-1]`, or the
        last prompt token when no output is given, as vLLM's decode side does), which the next
        step computes. Returns the sequence and how many leading blocks of its `block_table` are
        already here (prefix cache hits); the caller fills the rest, then calls `finish_import`.
        Raises `MemoryError` when blocks are short (the caller retries or refuses).
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params, output_token_ids, tenant)
        num_here = self.imports.start(seq)
        self.requests[request_id] = seq
        return seq, num_here

    def import_request(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, output_token_ids: list[int] | None = None,
                       tenant: Tenant | None = None) -> tuple[list[int], int]:
        """`add_imported_request` across threads: (its block table, number of blocks here)."""
        seq, num = self.add_imported_request(request_id, prompt_token_ids, params,
                                             output_token_ids, tenant)
        return list(seq.block_table), num

    def finish_import(self, request_id: str, success: bool) -> bool:
        """The transfer filled the blocks (join the batch) or failed (prefill locally instead).
        Returns False if the request is no longer importing (it was aborted meanwhile)."""
        return self.imports.finish(request_id, success)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks now; returns its final output (None if unknown)."""
        seq = self.requests.get(request_id) or self.held.get(request_id)
        if seq is None:
            return None
        self.imports.drop(request_id)
        self.scheduler.remove(seq)
        return self._finish(seq, "abort", keep_blocks=False)

    def park_request(self, request_id: str, parked: bool = True) -> bool:
        """Out of the batch while its reader is behind (`parked=False`: back in the queue);
        False if it was in no state to be (engine/scheduler.py `park`)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        return self.scheduler.park(seq) if parked else self.scheduler.unpark(seq)

    def release(self, request_id: str) -> bool:
        """Free the blocks a finished prefill-only request was holding."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return self.pins.release(request_id)  # or a peer export's pinned prefix
        self.kv.free(seq)
        return True

    def block_table(self, request_id: str) -> list[int]:
        seq = self.requests.get(request_id) or self.held[request_id]
        return list(seq.block_table)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_work() or self.imports)

    @property
    def background_busy(self) -> bool:
        """Tier copies queued or tier events not drained: the loops poll for events while so."""
        return self.store.background_busy

    def stats(self) -> dict:
        """The load figures the worker publishes and exports as metrics (with tiers: their
        counters under `kv_tiers` and `reload_tokens_per_s` by tier)."""
        return {**self.scheduler.stats(), **self.store.stats(), "held": len(self.held),
                "importing": len(self.imports)}

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        with self.lock:
            if self.pipeline is not None and self.pipeline.in_flight is not None:
                return self.pipeline.step()
            out = self.scheduler.schedule()
            if not out:
                return self._unschedulable()
            now = time.monotonic()
            for item in out.scheduled:
                if item.seq.first_scheduled_time is None:
                    item.seq.first_scheduled_time = now
            if self.pipeline is not None and self.pipeline.qualifies(out):
                return self.pipeline.start(out)
        # The model runs unlocked: a mid-step method may pin, reserve or cache other blocks.
        logits, rows = self.runner.execute(out.scheduled)
        with self.lock:
            self.scheduler.advance(out)
            outputs: list[RequestOutput] = []
            if rows:
                seqs = [r.seq for r in rows]
                self.structured.mask(logits, seqs)
                token_ids, logprobs = self.sampler(logits, seqs)
                for seq, token_id, lp in zip(seqs, token_ids, logprobs, strict=True):
                    outputs.append(self.append_token(seq, token_id, lp))
            return outputs

    def _unschedulable(self) -> list[RequestOutput]:
        # A lone request that cannot get blocks even from an empty pool will never run.
        s = self.scheduler
        if s.waiting and not s.running and self.pool.num_free_blocks == self.num_blocks:
            seq = s.waiting.popleft()
            return [self._finish(seq, "length", keep_blocks=False)]
        return []

    def append_token(self, seq: Sequence, token_id: int, lp: Logprob | None) -> RequestOutput:
        """`token_id` sampled for `seq`: appended (text, logprobs, grammar), stops checked, and
        `seq` finished if one hit; the output to stream."""
        seq.output_token_ids.append(token_id)
        self.structured.accept(seq, token_id)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if lp is not None and seq.logprobs is not None:
            seq.logprobs.append(lp)
        new_text = seq.text_stream.step(token_id) if seq.text_stream else ""
        seq.text += new_text
        reason = stop_reason(seq, token_id, len(new_text), self.max_model_len)
        if reason is None:
            return output_of(seq, [token_id])
        self.scheduler.remove(seq)
        return self._finish(seq, reason, keep_blocks=seq.hold_blocks, new_token_ids=[token_id])

    def _finish(
        self, seq: Sequence, reason: str, keep_blocks: bool, new_token_ids: list[int] | None = None
    ) -> RequestOutput:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
        if keep_blocks:
            self.held[seq.request_id] = seq
        else:
            self.held.pop(seq.request_id, None)  # an aborted held request lets go too
            self.kv.free(seq)
        return output_of(seq, new_token_ids or [])
