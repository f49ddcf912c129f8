"""Structured outputs in the engine (engine/structured_output.py) and at the API edge
(common/structured.py): constrained sampling on tiny-random (random weights: without the mask its
output is noise, so every valid answer is the grammar's doing), continuation from given output
tokens (the decode side of P/D, a resume), and the request fields."""

from __future__ import annotations

import json
import re

import pytest

from common.protocol import StructuredOutput
from common.structured import StructuredFields, compile_grammar
from engine import LLM, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"enum": ["red", "green", "blue"]}}}


@pytest.fixture(scope="module")
def llm(tiny_folder):
    return LLM(str(tiny_folder), num_blocks=256, block_size=4)


def constrained(kind: str, spec, **kw) -> SamplingParams:
    spec = spec if isinstance(spec, str) else json.dumps(spec)
    return SamplingParams(max_tokens=kw.pop("max_tokens", 64),
                          structured=StructuredOutput(kind=kind, spec=spec), **kw)


def test_unconstrained_tiny_random_output_is_noise(llm):
    text = llm.generate("json please:", SamplingParams(temperature=0, max_tokens=40))[0].text
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_always_parses_and_validates(llm, seed):
    import jsonschema

    out = llm.generate(f"prompt {seed}", constrained("json", SCHEMA, temperature=1.0, seed=seed))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_and_choice(llm):
    out = llm.generate("x", constrained("regex", r"[0-9]{3}-[a-c]{2}", temperature=1.0, seed=3))[0]
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", out.text) and out.finish_reason == "stop"
    for seed in range(4):
        out = llm.generate("y", constrained("choice", ["alpha", "beta"], temperature=1.0,
                                            seed=seed))[0]
        assert out.text in ("alpha", "beta")


def test_given_output_continues_under_the_grammar(llm):
    """What a decode worker does with the prefill's first token (and a resume with more)."""
    params = constrained("json", SCHEMA, temperature=0)
    whole = llm.generate("continue me", params)[0]
    engine = llm.engine
    for k in (1, 3):
        rid = f"cont-{k}"
        engine.add_request(rid, llm.tokenizer.encode("continue me"), params, whole.token_ids[:k])
        tokens = list(whole.token_ids[:k])
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        assert tokens == whole.token_ids  # greedy: the same answer, token for token
    bad = llm.tokenizer.encode("not json")
    with pytest.raises(ValueError, match="do not follow"):
        engine.add_request("cont-bad", llm.tokenizer.encode("continue me"), params, bad)


def test_bad_specs_are_value_errors():
    for kind, spec in (("json", '{"type": "nonsense"}'), ("regex", "(unclosed"),
                       ("choice", "[]"), ("choice", "not json"), ("grammar", "start: ???")):
        with pytest.raises(ValueError):
            compile_grammar(kind, spec)


def test_request_fields_become_one_constraint():
    def of(**fields):
        return StructuredFields(**fields).structured()

    assert of() is None and of(response_format={"type": "text"}) is None
    assert not StructuredFields(response_format={"type": "text"}).constrained()
    assert StructuredFields(guided_regex="a+").constrained()
    assert StructuredFields(response_format={"type": "json_object"}).constrained()
    assert (of(response_format={"type": "json_object"})
            == StructuredOutput(kind="json", spec='{"type": "object"}'))
    got = of(response_format={"type": "json_schema",
                              "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert got.kind == "json" and json.loads(got.spec) == SCHEMA
    assert of(guided_choice=["a", "b"]).kind == "choice"
    assert of(guided_regex="a+").spec == "a+"
    assert of(structured_outputs={"json": SCHEMA}).kind == "json"
    with pytest.raises(ValueError, match="not several"):
        of(guided_regex="a+", response_format={"type": "json_object"})
    with pytest.raises(ValueError):
        of(guided_json={"type": "nonsense"})
