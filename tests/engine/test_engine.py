"""The engine on tiny-random against transformers, plus batching, prefix caching, preemption,
abort, chunked prefill, stops and the prefill/import calls the workers use."""

import pytest
import torch

from common.hashing import BlockHasher
from common.protocol import Tenant
from engine import LLM, EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int, base: int = 11, vocab: int = 256) -> list[list[int]]:
    return [[(base * (i + 1) * (j + 3)) % vocab for j in range(5 + 7 * i)] for i in range(n)]


_HF_CACHE: dict = {}


def hf_greedy(folder, prompt, max_new):
    """transformers' greedy tokens (computed once per folder, prompt and length)."""
    key = (str(folder), tuple(prompt), max_new)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _hf_greedy(folder, prompt, max_new)
    return _HF_CACHE[key]


def _hf_greedy(folder, prompt, max_new):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        # An explicit mask: the pad id may occur in the prompt and would be masked out.
        out = hf.generate(torch.tensor([prompt]),
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_all(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture
def llm(tiny_folder):
    return LLM(str(tiny_folder), num_blocks=256, block_size=4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_matches_transformers(tiny_folder, device):
    llm = LLM(str(tiny_folder), num_blocks=256, block_size=4, device=device, dtype="float32",
              attention_backend="sdpa")
    for p in prompts(3):
        ours = llm.generate(p, GREEDY)[0].token_ids
        assert ours == hf_greedy(tiny_folder, p, 24)


@pytest.mark.parametrize("device,graphs", [
    ("cpu", False), ("cpu", True),  # the Triton interpreter; graphs: the functions called directly
    pytest.param("cuda", False, marks=pytest.mark.gpu),
    pytest.param("cuda", True, marks=pytest.mark.gpu),
])
def test_greedy_through_triton_kernels_matches_transformers(tiny_folder, triton_kernels,
                                                            device, graphs):
    llm = LLM(str(tiny_folder), num_blocks=256, block_size=4, device=device, dtype="float32",
              attention_backend="triton", enforce_eager=not graphs, max_num_seqs=4)
    if device == "cpu" and graphs:
        llm.engine.runner.enable_graphs(capture=False)
    assert (llm.engine.runner.graphs is not None) == graphs
    ps = prompts(3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # interpreted: short
    outs = llm.generate(ps, params)  # one batch: a bucket of 4 with a padded row
    for p, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(tiny_folder, p, 24)[:16]


def test_qwen2_style_bias_and_llama3_rope_match_transformers(tmp_path):
    from engine.tiny import build_tiny_random

    qwen = build_tiny_random(tmp_path / "qwen", seed=3, config={
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    llama3 = build_tiny_random(tmp_path / "l3", seed=4, config={
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        "tie_word_embeddings": True})
    for folder in (qwen, llama3):
        p = prompts(2)[1]
        got = LLM(str(folder), num_blocks=64, block_size=4).generate(p, GREEDY)[0].token_ids
        assert got == hf_greedy(folder, p, 24)


def test_batched_equals_one_by_one(llm):
    ps = prompts(6)
    together = [o.token_ids for o in llm.generate(ps, GREEDY)]
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in ps]
    assert together == alone


def test_prefix_reuse_is_counted_and_exact(llm):
    shared = prompts(4)[3][:24]
    a = shared + [1, 2, 3]
    b = shared + [9, 8, 7, 6]
    first = llm.generate(a, GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate(b, GREEDY)[0]
    assert second.num_cached_tokens == 24  # six full blocks of 4
    fresh = LLM(str(llm.engine.folder), num_blocks=256, block_size=4)
    assert second.token_ids == fresh.generate(b, GREEDY)[0].token_ids


def test_a_cache_salt_shares_blocks_only_with_the_same_salt(llm):
    engine = llm.engine
    shared = prompts(4)[3][:24]

    def cached(request_id: str, tail: list[int], salt: str | None) -> int:
        engine.add_request(request_id, shared + tail, GREEDY, tenant=Tenant(cache_salt=salt))
        return run_all(engine)[request_id].num_cached_tokens

    assert cached("a1", [1, 2, 3], "tenant-a") == 0
    assert cached("a2", [4, 5, 6], "tenant-a") == 24  # same salt: six full blocks of 4
    assert cached("b1", [7, 8, 9], "tenant-b") == 0  # another salt: nothing
    assert cached("n1", [7, 8, 9], None) == 0  # no salt is a salt of its own
    assert cached("n2", [1, 1, 1], None) == 24
    salted = BlockHasher(engine.model_digest, 4)(shared, cache_salt="tenant-a")
    assert set(salted) <= set(engine.cached_hashes())  # what the worker publishes


def test_preemption_finishes_every_request_correctly(tiny_folder):
    ps = prompts(6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(str(tiny_folder), num_blocks=512, block_size=4)
    want = [o.token_ids for o in roomy.generate(ps, params)]
    tight = LLM(str(tiny_folder), num_blocks=40, block_size=4)
    got = [o.token_ids for o in tight.generate(ps, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
    assert tight.engine.pool.num_free_blocks == 40


def test_chunked_prefill_equals_whole_prefill(tiny_folder):
    long = [(7 * j + 1) % 256 for j in range(150)]
    whole = LLM(str(tiny_folder), num_blocks=256, block_size=4, max_num_batched_tokens=4096)
    chunked = LLM(str(tiny_folder), num_blocks=256, block_size=4, max_num_batched_tokens=16)
    a = whole.generate([long, prompts(1)[0]], GREEDY)
    b = chunked.generate([long, prompts(1)[0]], GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_abort_frees_all_blocks(tiny_folder):
    engine = LLMEngine(EngineConfig(str(tiny_folder), num_blocks=128, block_size=4))
    for i, p in enumerate(prompts(4)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=100,
                                                      ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.pool.num_free_blocks < 128
    for i in range(4):
        assert engine.abort_request(f"r{i}")
    assert engine.abort_request("r0") is None
    assert not engine.has_unfinished()
    assert engine.pool.num_free_blocks == 128


def test_stop_strings_cut_exactly(llm):
    p = prompts(3)[2]
    full = llm.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text = full.text
    # Pick a stop string from the middle of the output; the cut is at its first occurrence.
    stop = next(text[i:i + 2] for i in range(6, len(text) - 2) if text[i:i + 2].isprintable())
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                         stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_stop_token_ids_and_max_tokens(llm):
    p = prompts(2)[0]
    full = llm.generate(p, GREEDY)[0].token_ids
    stop_id = full[5]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                         stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full[: full.index(stop_id) + 1] and out.finish_reason == "stop"
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_seeded_sampling_reproducible_across_batches(llm):
    p = prompts(2)[1]
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate(p, params)[0].token_ids
    mixed = llm.generate([prompts(3)[2], p],
                         [SamplingParams(temperature=1.0, max_tokens=16), params])
    assert mixed[1].token_ids == alone
    other_seed = llm.generate(p, SamplingParams(temperature=1.0, seed=43, max_tokens=16,
                                                ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(msgs)
    assert llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_bad_requests_raise_clear_errors(tiny_folder):
    engine = LLMEngine(EngineConfig(str(tiny_folder), num_blocks=8, block_size=4, max_model_len=64))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("a", [])
    with pytest.raises(ValueError, match="context is 64"):
        engine.add_request("b", [1] * 64)
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        engine.add_request("c", [1] * 40)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 320\)"):
        engine.add_request("d", [1, 999])
    engine.add_request("e", [1, 2])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("e", [1, 2])


def test_prefill_hold_then_import_continues_identically(tiny_folder):
    """The disaggregated flow inside one process: engine P prefills and holds its blocks, the
    blocks are copied into engine D's cache, D continues; tokens equal a single engine's."""
    cfg = dict(num_blocks=64, block_size=4)
    p_engine = LLMEngine(EngineConfig(str(tiny_folder), **cfg))
    d_engine = LLMEngine(EngineConfig(str(tiny_folder), **cfg))
    prompt = prompts(3)[2]
    want = LLM(str(tiny_folder), **cfg).generate(prompt, GREEDY)[0].token_ids

    p_engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    first = run_all(p_engine)["r"]
    assert first.token_ids == want[:1]
    src_blocks = p_engine.block_table("r")
    assert len(src_blocks) == -(-len(prompt) // 4)

    seq, num_local = d_engine.add_imported_request("r", prompt, GREEDY, first.token_ids)
    assert num_local == 0
    dst_blocks = seq.block_table
    # Move the KV: [blocks, layers, 2, ...] indexed by block ids on both sides.
    d_engine.kv_cache[dst_blocks] = p_engine.kv_cache[src_blocks]
    assert p_engine.release("r") and p_engine.pool.num_free_blocks == 64
    d_engine.finish_import("r", success=True)
    out = run_all(d_engine)["r"]
    assert out.token_ids == want
    assert d_engine.pool.num_free_blocks == 64

    # Second turn on D: the shared prefix is already local, so fewer blocks need importing.
    prompt2 = prompt + want + [5, 6, 7]
    _, num_local2 = d_engine.add_imported_request("r2", prompt2, GREEDY, [1])
    assert num_local2 == (len(prompt) + len(want) - 1) // 4
    d_engine.abort_request("r2")
    assert d_engine.pool.num_free_blocks == 64


def test_failed_import_falls_back_to_local_prefill(tiny_folder):
    cfg = dict(num_blocks=64, block_size=4)
    engine = LLMEngine(EngineConfig(str(tiny_folder), **cfg))
    prompt = prompts(3)[1]
    want = LLM(str(tiny_folder), **cfg).generate(prompt, GREEDY)[0].token_ids
    engine.add_imported_request("r", prompt, GREEDY, want[:1])
    engine.finish_import("r", success=False)  # blocks hold garbage; must be recomputed
    assert run_all(engine)["r"].token_ids == want


def test_seeded_resume_continues_the_random_stream(llm):
    p = prompts(3)[1]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    want = llm.generate(p, params)[0].token_ids
    llm.engine.add_request("seeded-resume", p, params, output_token_ids=want[:5])
    assert run_all(llm.engine)["seeded-resume"].token_ids == want


def test_resume_with_given_output_tokens(llm):
    p = prompts(3)[0]
    want = llm.generate(p, GREEDY)[0].token_ids
    llm.engine.add_request("resume", p, GREEDY, output_token_ids=want[:10])
    out = run_all(llm.engine)["resume"]
    assert out.token_ids == want


def test_block_events_stream(tiny_folder):
    engine = LLMEngine(EngineConfig(str(tiny_folder), num_blocks=16, block_size=4))
    engine.add_request("a", list(range(9)), SamplingParams(temperature=0, max_tokens=1))
    run_all(engine)
    events = engine.drain_events()
    assert [e.kind for e in events] == ["stored"]
    assert list(events[0].block_hashes) == engine.hasher(list(range(9)))
    assert sorted(engine.pool.cached_hashes()) == sorted(events[0].block_hashes)


def test_a_held_request_id_cannot_be_reused(tiny_folder):
    """A second prefill under the id of one still holding its blocks is refused (it used to
    overwrite the held entry and leak its blocks; the worker fuzz test found it)."""
    from engine.llm_engine import DuplicateRequestId

    engine = LLMEngine(EngineConfig(model=str(tiny_folder), num_blocks=64, block_size=4))
    engine.add_request("r", list(range(1, 10)), SamplingParams(temperature=0, max_tokens=1),
                       hold_blocks=True)
    run_all(engine)
    used = engine.num_blocks - engine.pool.num_free_blocks
    assert used > 0 and "r" in engine.held
    with pytest.raises(DuplicateRequestId, match="already in use"):
        engine.add_request("r", list(range(1, 10)), SamplingParams(temperature=0, max_tokens=1),
                           hold_blocks=True)
    engine.release("r")
    assert engine.pool.num_free_blocks == engine.num_blocks
