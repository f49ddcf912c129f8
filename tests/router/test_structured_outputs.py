"""Structured outputs through a disaggregated plan, with the official `openai` client (issue 18):
SmolLM2 prefill samples the first token under the grammar, the decode worker rebuilds the
matcher from the tokens it is given and continues; a decode worker killed mid-stream is resumed
on another, still under the grammar."""

from __future__ import annotations

import concurrent.futures as cf
import json
import uuid

import jsonschema
import openai
import pytest

from tandem.cluster import Router, Worker

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES = [{"role": "user", "content": "Invent a person. Answer in JSON."}]


@pytest.fixture(scope="module")
def cluster(smollm2_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp("structured")
    ns = f"structured-{uuid.uuid4().hex[:6]}"
    procs: list = []
    try:
        common = dict(cache_dir=work, namespace=ns, block_size=16, num_blocks=192)
        procs.append(Worker("prefill", str(smollm2_folder), **common, extra=["--threads", "1"]))
        decodes = [Worker("decode", str(smollm2_folder), **common, extra=["--threads", "1"])
                   for _ in range(2)]
        procs += decodes
        # Every request disaggregated: no local prefill on the decode side.
        router = Router(smollm2_folder, ns, cache_dir=work, block_size=16,
                        extra=["--no-conditional-disagg"])
        procs.append(router)
        router.wait_workers(3)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, decodes
    finally:
        for p in reversed(procs):
            p.close()


def test_json_schema_through_pd_for_20_seeded_sampled_requests(cluster):
    client, _ = cluster

    def ask(seed: int):
        out = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT, temperature=1.0,
            seed=seed, max_tokens=80)
        body = json.loads(out.text)
        return body["choices"][0], body["tandem"]

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(ask, range(20)))
    texts = set()
    for choice, tandem in results:
        assert tandem["plan"] == "disagg"
        assert choice["finish_reason"] == "stop", choice
        person = json.loads(choice["message"]["content"])
        jsonschema.validate(person, PERSON)
        texts.add(choice["message"]["content"])
    assert len(texts) >= 5  # sampled: the constraint does not collapse the answers


def test_json_object_choice_and_regex(cluster):
    client, _ = cluster
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=5,
                                         messages=[{"role": "user", "content": "Is the sky blue?"}],
                                         extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].message.content in ("yes", "no")
    out = client.completions.create(model=MODEL, prompt="Call me at", temperature=1.0, seed=7,
                                    max_tokens=20, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert len(out.choices[0].text) == 8 and out.choices[0].text[3] == "-"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})


def test_a_decode_worker_killed_mid_stream_resumes_under_the_grammar(cluster):
    client, decodes = cluster
    listing = {"type": "object", "additionalProperties": False, "required": ["people"],
               "properties": {"people": {"type": "array", "minItems": 6, "maxItems": 6, "items": PERSON}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "people", "schema": listing, "strict": True}}
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "List six people as JSON."}],
        response_format=fmt, temperature=1.0, seed=11, max_tokens=400, stream=True)
    text, killed = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if killed is None and len(text) > 40:
            for d in decodes:
                if d.metrics()["tandem_worker_running_requests"] > 0:
                    killed = d
                    d.kill()
                    break
    assert killed is not None, "no decode worker was streaming"
    jsonschema.validate(json.loads(text), listing)
