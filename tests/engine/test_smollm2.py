"""The real model: SmolLM2-135M-Instruct in float32 against transformers on the same folder."""

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

CONVERSATIONS = [
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
]
GREEDY64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_folder):
    return LLM(str(smollm2_folder), num_blocks=512)


@pytest.fixture(scope="module")
def hf(smollm2_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.tokenizer.encode_chat(c) for c in CONVERSATIONS]


@pytest.fixture(scope="module")
def reference(hf, prompt_ids):
    out = []
    with torch.no_grad():
        for p in prompt_ids:
            ids = hf.generate(torch.tensor([p]),
                              attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=64, min_new_tokens=64, do_sample=False,
                              eos_token_id=None, pad_token_id=2)
            out.append(ids[0, len(p):].tolist())
    return out


def test_chat_template_matches_transformers(smollm2_folder, llm, prompt_ids):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_folder))
    for conv, ours in zip(CONVERSATIONS, prompt_ids, strict=True):
        ref = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        assert ours == list(ref)
    from tests.golden import CHAT_PROMPT_IDS

    assert prompt_ids[0] == CHAT_PROMPT_IDS


def test_greedy_64_tokens_identical_to_transformers(llm, prompt_ids, reference):
    for p, ref in zip(prompt_ids, reference, strict=True):
        assert llm.generate(p, GREEDY64)[0].token_ids == ref


def test_batched_different_lengths_identical(llm, prompt_ids, reference):
    assert len({len(p) for p in prompt_ids}) > 1
    outs = llm.generate(prompt_ids, GREEDY64)
    assert [o.token_ids for o in outs] == reference


def test_last_position_logits_close(llm, hf, prompt_ids):
    engine = llm.engine
    for i, p in enumerate(prompt_ids):
        engine.add_request(f"logits-{i}", p, SamplingParams(temperature=0, max_tokens=1))
    batch = engine.scheduler.schedule()
    logits, rows = engine.runner.execute(batch.scheduled)
    for i, p in enumerate(prompt_ids):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].float()
        row = next(j for j, r in enumerate(rows) if r.seq.request_id == f"logits-{i}")
        assert (logits[row] - ref).abs().max().item() < 1e-3
    for i in range(len(prompt_ids)):
        engine.abort_request(f"logits-{i}")
    assert engine.pool.num_free_blocks == engine.num_blocks


def test_shared_prefix_reuses_blocks_and_output_is_identical(llm):
    system = {"role": "system", "content": "You are a helpful assistant who answers briefly and "
              "precisely, always in complete sentences, with no more detail than asked for."}
    convs = [[system, {"role": "user", "content": q}] for q in ("Name a color.", "Name a fruit.")]
    p1, p2 = (llm.tokenizer.encode_chat(c) for c in convs)
    first = llm.generate(p1, GREEDY64)[0]
    second = llm.generate(p2, GREEDY64)[0]
    common = next(i for i, (a, b) in enumerate(zip(p1, p2, strict=False)) if a != b)
    assert second.num_cached_tokens == (common // 16) * 16 > 0
    # The same prompt computed from scratch (the cache forgotten; no second model loaded).
    assert llm.engine.pool.reset_prefix_cache()
    fresh = llm.generate(p2, GREEDY64)[0]
    assert fresh.num_cached_tokens == 0
    assert second.token_ids == fresh.token_ids
    assert first.token_ids != second.token_ids


def test_answers_the_demo_question(llm):
    out = llm.chat(CONVERSATIONS[0], SamplingParams(temperature=0, max_tokens=32))[0]
    assert out.text == "The capital of France is Paris." and out.finish_reason == "stop"
