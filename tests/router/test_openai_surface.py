"""The parts of the OpenAI API that real clients send, through the official `openai` client against
a live router (issue 18): tool-using conversations (`content: null`, tool results), `tools`
rendered into the template, roles checked, non-text parts refused by name, fields OpenAI clients
send and servers ignore, cached prompt tokens in `usage`, `models.retrieve`."""

from __future__ import annotations

import uuid

import openai
import pytest

from testing.cluster import Router, Worker

MODEL = "tiny-random"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(tiny_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp("surface")
    ns = f"surface-{uuid.uuid4().hex[:6]}"
    procs = []
    try:
        procs.append(Worker("prefill", str(tiny_folder), cache_dir=work, namespace=ns))
        procs.append(Worker("decode", str(tiny_folder), cache_dir=work, namespace=ns))
        router = Router(tiny_folder, ns, cache_dir=work)
        procs.append(router)
        router.wait_workers(2)
        yield openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused",
                            max_retries=0, timeout=60)
    finally:
        for p in reversed(procs):
            p.close()


def test_a_tool_using_conversation_is_accepted(client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                         tool_choice="auto", parallel_tool_calls=False,
                                         max_tokens=4, temperature=0, store=False,
                                         metadata={"team": "a"}, user="u-1")
    assert out.choices[0].finish_reason in ("stop", "length")


def test_roles_and_content_parts_are_checked(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "wizard", "content": "hi"}])
    assert "role" in str(e.value) and e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert "'image_url'" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": None}])
    # Text parts are joined, as vLLM joins them.
    out = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "user",
         "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert out.usage.prompt_tokens == client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": "a\nb"}]).usage.prompt_tokens


def test_usage_reports_cached_prompt_tokens(client):
    messages = [{"role": "user", "content": str(uuid.uuid4()) + " a long shared prefix" * 12}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           temperature=0)
    # Only the template's own header (one block) can be cached the first time.
    assert first.usage.prompt_tokens_details.cached_tokens <= 8
    assert (again.usage.prompt_tokens // 2 < again.usage.prompt_tokens_details.cached_tokens
            < again.usage.prompt_tokens)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage]
    assert usage and usage[-1].prompt_tokens_details.cached_tokens > 0


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_streaming_n_choices_interleave_and_match_the_non_streamed_answer(client):
    kw = dict(model=MODEL, prompt="Three stories begin:", max_tokens=12, temperature=1.0,
              seed=5, n=3, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    texts, finishes, indexes, usage = ["", "", ""], [None] * 3, [], None
    for chunk in client.completions.create(stream=True,
                                           stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
            indexes.append(c.index)
        usage = chunk.usage or usage
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert finishes == ["length"] * 3 and set(indexes) == {0, 1, 2}
    assert usage.completion_tokens == 36 == whole.usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, n=2, temperature=1.0, seed=1, stream=True)
    roles = [c.choices[0].index for c in chat if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1]


def test_logprobs_with_n_choices(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4, n=2, temperature=1.0, seed=2, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    for c in out.choices:
        assert (len(c.logprobs.content) == 4
                and all(len(t.top_logprobs) == 2 for t in c.logprobs.content))


def test_logit_bias_through_the_router(client):
    texts = []
    for token in ("65", "66"):
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0,
                                        logit_bias={token: 100}, extra_body={"ignore_eos": True})
        texts.append(out.choices[0].text)
    # Byte-level vocabulary: one byte per token, the biased one five times over.
    assert all(len(t) == 5 and len(set(t)) == 1 for t in texts) and texts[0] != texts[1]


def test_a_refused_streaming_n_request_is_a_400_not_a_500(client):
    """Fuzzing found it: every choice failing at once left generators running while they closed."""
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, n=6, stream=True,
                                  extra_body={"guided_regex": "a+", "guided_choice": ["b"]})
    assert client.models.retrieve(MODEL).id == MODEL  # and the router is fine
