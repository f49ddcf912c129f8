"""`logit_bias` and `min_tokens` in the engine (engine/sampler.py, engine/stop.py), and through the
OpenAI request models."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from router.openai_models import CompletionRequest


@pytest.fixture(scope="module")
def llm(tiny_folder):
    return LLM(str(tiny_folder), num_blocks=256, block_size=4)


def test_logit_bias_forces_and_bans_tokens(llm):
    base = llm.generate("bias me", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    forced = llm.generate("bias me", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                    logit_bias={65: 100.0}))[0]
    assert forced.token_ids == [65] * 8
    banned = llm.generate("bias me", SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True,
        logit_bias={t: -100.0 for t in set(base.token_ids)}))[0]
    assert not set(banned.token_ids) & set(base.token_ids)
    for seed in range(3):  # sampled too
        out = llm.generate("bias me", SamplingParams(temperature=1.0, seed=seed, max_tokens=6,
                                                     ignore_eos=True, logit_bias={70: 100.0}))[0]
        assert out.token_ids == [70] * 6
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_min_tokens_holds_off_eos_and_stop_tokens(llm):
    eos = llm.engine.eos_token_ids[0]
    # EOS pushed to the top: without min_tokens the request stops at once.
    assert llm.generate("stop", SamplingParams(temperature=0, max_tokens=10,
                                               logit_bias={eos: 100.0}))[0].token_ids == [eos]
    out = llm.generate("stop", SamplingParams(temperature=0, max_tokens=10, min_tokens=5,
                                              logit_bias={eos: 100.0}))[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_openai_fields_parse_string_token_ids():
    body = CompletionRequest(model="m", prompt="hi", logit_bias={"42": -100, "7": 5.5},
                             min_tokens=2)
    opts = body.sampling_options(16)
    assert opts.logit_bias == {42: -100.0, 7: 5.5} and opts.min_tokens == 2
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="hi", logit_bias={"-1": 1})
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="hi", logit_bias={"1": 200})
