"""The decode CUDA-graph runner's bookkeeping: buckets, static buffers, padding, and the step's
inputs copied into them. On CPU the graphs are replaced by direct calls of the same per-bucket
functions (`capture=False`); the GPU test captures and replays real graphs."""

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graph import graph_buckets
from engine.input_buffers import InputBuffers, build_step_inputs
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_buckets_are_nano_vllms_and_end_at_max_num_seqs():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(1) == [1]


def decode_item(name, tokens, block_table, computed):
    seq = Sequence(name, tokens[:4], SamplingParams())
    seq.output_token_ids = tokens[4:]
    seq.block_table = block_table
    seq.num_computed_tokens = computed
    return ScheduledSeq(seq, 1, True)


def test_step_inputs_of_a_decode_batch():
    a = decode_item("a", list(range(10, 19)), [7, 3, 5], computed=8)  # token 8 is new
    b = decode_item("b", [1, 2, 3, 4, 5], [2, 9], computed=4)
    step = build_step_inputs([a, b], block_size=4)
    assert step.input_ids.tolist() == [18, 5]
    assert step.positions.tolist() == [8, 4]
    assert step.slot_mapping.tolist() == [5 * 4 + 0, 9 * 4 + 0]
    assert step.context_lens.tolist() == [9, 5]
    assert step.block_tables.tolist() == [[7, 3, 5], [2, 9, 0]]
    assert step.samples_every_row and not step.prefills


def test_load_pads_the_bucket_and_copies_the_step():
    buffers = InputBuffers(max_num_seqs=8, max_blocks=6, device=torch.device("cpu"))
    a = decode_item("a", list(range(10, 19)), [7, 3, 5], computed=8)
    b = decode_item("b", [1, 2, 3, 4, 5], [2, 9], computed=4)
    buffers.load(build_step_inputs([a, b, a], 4), num_rows=4)  # rows 0..2, then a stale row 2
    buffers.load(build_step_inputs([b, a], 4), num_rows=4)
    assert buffers.input_ids[:4].tolist() == [5, 18, 0, 0]
    assert buffers.positions[:4].tolist() == [4, 8, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [36, 20, -1, -1]
    assert buffers.context_lens[:4].tolist() == [5, 9, 0, 0]
    assert buffers.block_tables[0, :2].tolist() == [2, 9]
    assert buffers.block_tables[1, :3].tolist() == [7, 3, 5]
    with pytest.raises(ValueError):
        buffers.load(build_step_inputs([a, b], 4), num_rows=1)
    wide = decode_item("w", list(range(40)), list(range(10)), computed=39)
    with pytest.raises(ValueError, match="exceeds"):
        buffers.load(build_step_inputs([wide], 4), num_rows=1)


@pytest.fixture
def triton_llm(tiny_folder, triton_kernels):
    return LLM(str(tiny_folder), num_blocks=128, block_size=4, attention_backend="triton",
               max_num_seqs=8)


def test_direct_replay_equals_eager_triton_and_pads(triton_llm):
    engine = triton_llm.engine
    runner = engine.runner
    runner.enable_graphs(capture=False)
    graphs = runner.graphs
    assert graphs.bucket_for(3) == 4 and graphs.bucket_for(8) == 8 and graphs.bucket_for(9) is None
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 3, 9, 1, 2, 8]]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()  # the prefill step: eager
    out = engine.scheduler.schedule()  # the next step: three decodes
    assert all(item.num_new_tokens == 1 for item in out.scheduled)
    step = build_step_inputs(out.scheduled, engine.block_size)
    before = engine.kv_cache.clone()
    with torch.inference_mode():
        eager = runner._eager_triton(step).clone()
        after_eager = engine.kv_cache.clone()
        engine.kv_cache.copy_(before)
        replayed = graphs.run(step).clone()
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    # The padded 4th row wrote no KV: the cache equals the eager step's (three slots written).
    assert torch.equal(engine.kv_cache, after_eager) and not torch.equal(after_eager, before)
    assert graphs.buffers.slot_mapping[3].item() == -1
    assert graphs.buffers.context_lens[3].item() == 0
    assert np.isfinite(graphs.hidden[:4].numpy()).all()


def test_greedy_through_direct_replay_equals_sdpa_engine(tiny_folder, triton_llm):
    """The CPU twin of the GPU graph test: decode steps go through the per-bucket functions."""
    prompts = [[(11 * (i + 1) * (j + 3)) % 256 for j in range(5 + 7 * i)] for i in range(3)]
    want = [o.token_ids for o in LLM(str(tiny_folder), num_blocks=128, block_size=4)
            .generate(prompts, GREEDY)]
    runner = triton_llm.engine.runner
    runner.enable_graphs(capture=False)
    calls = []
    graphs = runner.graphs
    original = graphs.run
    graphs.run = lambda step, *ids: calls.append(step.num_decodes) or original(step, *ids)
    got = [o.token_ids for o in triton_llm.generate(prompts, GREEDY)]
    assert got == want
    assert calls and set(calls) == {3}  # every decode step went through the bucket path
    assert triton_llm.engine.pool.num_free_blocks == 128


@pytest.mark.gpu
def test_graph_replay_equals_eager_on_gpu(tiny_folder, triton_kernels):
    prompts = [[(13 * (i + 1) * (j + 5)) % 256 for j in range(3 + 9 * i)] for i in range(5)]
    eager = LLM(str(tiny_folder), num_blocks=256, block_size=4, device="cuda", dtype="float32",
                enforce_eager=True)
    graphed = LLM(str(tiny_folder), num_blocks=256, block_size=4, device="cuda", dtype="float32",
                  max_num_seqs=8)
    assert eager.engine.runner.graphs is None and graphed.engine.runner.graphs is not None
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert ([o.token_ids for o in graphed.generate(prompts, params)]
            == [o.token_ids for o in eager.generate(prompts, params)])
