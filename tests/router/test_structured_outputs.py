"""Structured outputs through a disaggregated plan, with the official `openai` client (issue 18):
SmolLM2 prefill samples the first token under the grammar, the decode worker rebuilds the
matcher from the tokens it is given and continues; a decode worker killed mid-stream is resumed
on another, still under the grammar."""

from __future__ import annotations

import concurrent.futures as cf
import json
import uuid
from pathlib import Path

import jsonschema
import openai
import pytest

from testing.cluster import Router, Worker

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24}}}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES = [{"role": "user", "content": "Invent a person. Answer in JSON."}]
TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "chatml_tools.jinja"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris?"}]


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
                        extra=["--no-conditional-disagg", "--chat-template", str(TEMPLATE)])
        procs.append(router)
        router.wait_workers(3)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
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
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with a name."}],
        temperature=0, max_tokens=300, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":  # a free-form object may be cut by max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.choices[0].message.content.startswith("{")
    out = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=5,
                                         messages=[{"role": "user", "content": "Is the sky blue?"}],
                                         extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].message.content in ("yes", "no")
    out = client.completions.create(model=MODEL, prompt="Call me at", temperature=1.0, seed=7,
                                    max_tokens=20,
                                    extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert len(out.choices[0].text) == 8 and out.choices[0].text[3] == "-"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


def test_a_decode_worker_killed_mid_stream_resumes_under_the_grammar(cluster):
    client, decodes = cluster
    listing = {"type": "object", "additionalProperties": False, "required": ["people"],
               "properties": {"people": {"type": "array", "minItems": 6, "maxItems": 6,
                                         "items": PERSON}}}
    fmt = {"type": "json_schema",
           "json_schema": {"name": "people", "schema": listing, "strict": True}}
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


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(client, **kw) -> tuple[list[dict], str]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        for d in c.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function and d.function.name:
                call["name"] = d.function.name
            if d.function and d.function.arguments:
                call["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}},
                                    "required"],
                         ids=["named", "required"])
def test_forced_tool_choices_give_valid_calls_streamed_or_not(cluster, choice):
    client, _ = cluster
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
              max_tokens=120)
    out = client.chat.completions.create(**kw)
    assert out.choices[0].finish_reason == "tool_calls"
    calls = out.choices[0].message.tool_calls
    _check_calls(calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]
    streamed, finish = _streamed_calls(client, **kw)
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert all(c["id"] and c["id"].startswith("call_") for c in streamed)


def test_sampled_named_tool_calls_always_match_the_schema(cluster):
    client, _ = cluster
    for seed in range(6):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "add"}})
        _check_calls(out.choices[0].message.tool_calls)


def test_auto_tool_choice_answers_with_text_or_valid_calls(cluster):
    client, _ = cluster
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto",
                                         temperature=0, max_tokens=80)
    msg = out.choices[0].message
    if msg.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        for call in msg.tool_calls:
            assert (call.function.name in SCHEMAS
                    and isinstance(json.loads(call.function.arguments), dict))
    else:
        assert msg.content and "<tool_call>" not in msg.content


def test_auto_tool_choice_parses_a_call_the_model_makes(cluster):
    """`auto` is not constrained: it depends on the model emitting the parser's format. SmolLM2
    does, greedily, once the conversation shows it two calls in the template's Hermes format."""
    client, _ = cluster

    def call(city: str, i: int) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}

    weather = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}, call("Paris", 1),
                {"role": "user", "content": "Weather in Rome?"}, call("Rome", 2),
                {"role": "user", "content": "Weather in Berlin?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=weather,
                                         tool_choice="auto", temperature=0, max_tokens=40)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Berlin"}
    assert not choice.message.content


def test_langchain_structured_output_and_bind_tools(cluster, monkeypatch):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    client, _ = cluster

    class Person(BaseModel):
        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=120)

    llm = ChatOpenAI(model=MODEL, base_url=str(client.base_url), api_key="unused", temperature=0,
                     max_tokens=80, max_retries=0)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Invent a person.")
    assert isinstance(person, Person)
    person = llm.with_structured_output(Person, method="function_calling").invoke(
        "Invent a person.")
    assert isinstance(person, Person)

    def get_weather(city: str, unit: str) -> str:
        """Weather in a city, in celsius or fahrenheit."""
        return "sunny"

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    msg = llm.bind_tools([get_weather, add], tool_choice="required").invoke("What is 2 + 3?")
    assert msg.tool_calls and all(c["name"] in ("get_weather", "add") for c in msg.tool_calls)
    assert all(isinstance(c["args"], dict) for c in msg.tool_calls)


def test_litellm_with_a_json_schema_and_tools(cluster, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
    import litellm

    client, _ = cluster
    common = dict(model=f"openai/{MODEL}", api_base=str(client.base_url), api_key="unused",
                  temperature=0, max_tokens=80)
    out = litellm.completion(messages=MESSAGES, response_format=RESPONSE_FORMAT, **common)
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = litellm.completion(messages=ASK, tools=TOOLS, **{**common, "max_tokens": 120},
                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _check_calls(out.choices[0].message.tool_calls)
