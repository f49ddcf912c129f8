"""common/tool_calls.py: the Hermes parser, the forced-choice schemas and the streamed deltas
(which must reassemble into the non-streamed calls, whatever the chunking)."""

from __future__ import annotations

import json

import pytest

from common.chat_messages import NamedToolChoice, Tool
from common.structured import compile_grammar
from common.tool_calls import ToolCalls, ToolStream, tool_constraint

TOOLS = [Tool.model_validate({"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
    Tool.model_validate({"type": "function", "function": {"name": "noop"}})]
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')


def test_hermes_calls_are_parsed_from_auto_output():
    content, calls = ToolCalls(TOOLS, "auto").split(TEXT)
    assert content == "Let me check."
    assert ([(c.name, json.loads(c.arguments)) for c in calls]
            == [("get_weather", {"city": "Paris"}), ("noop", {})])
    assert ToolCalls(TOOLS, "auto").split("no calls here") == ("no calls here", [])
    # A tag with no valid JSON is text, not a call.
    assert ToolCalls(TOOLS, "auto").split("<tool_call>oops</tool_call>")[1] == []
    assert not ToolCalls(TOOLS, "none").active and not ToolCalls(None, "auto").active


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_deltas_reassemble_into_the_calls(step):
    stream = ToolStream(ToolCalls(TOOLS, "auto"))
    content, deltas = "", []
    for i in range(0, len(TEXT), step):
        c, d = stream.feed(TEXT[i:i + step])
        content, deltas = content + c, deltas + d
    c, d = stream.finish()
    content, deltas = content + c, deltas + d
    assert "<tool" not in content and content.strip() == "Let me check."
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
        call["name"] += d.get("function", {}).get("name", "")
        call["arguments"] += d["function"].get("arguments", "")
        if "id" in d:
            assert d["id"].startswith("call_") and d["type"] == "function"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("noop", {})]
    assert stream.num_calls == 2


def test_plain_text_streams_through_with_a_held_back_tag_prefix():
    stream = ToolStream(ToolCalls(TOOLS, "auto"))
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed(" not a tag") == ("<tool not a tag", [])
    assert stream.finish() == ("", []) and stream.num_calls == 0


def test_named_arguments_stream_as_generated():
    stream = ToolStream(ToolCalls(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}})))
    _, first = stream.feed('{"city": ')
    assert (first[0]["function"]["name"] == "get_weather"
            and first[1]["function"]["arguments"] == '{"city": ')
    _, more = stream.feed('"Oslo"}')
    assert more == [{"index": 0, "function": {"arguments": '"Oslo"}'}}]
    assert stream.finish() == ("", [])


def test_forced_choices_compile_to_schemas():
    named = tool_constraint(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}), None)
    assert json.loads(named.spec) == TOOLS[0].function.parameters
    required = tool_constraint(TOOLS, "required", False)
    schema = json.loads(required.spec)
    assert (schema["minItems"] == 1 and schema["maxItems"] == 1
            and len(schema["items"]["anyOf"]) == 2)
    for s in (named, required):
        compile_grammar(s.kind, s.spec)
    assert (tool_constraint(TOOLS, "auto", None) is None
            and tool_constraint(None, "required", None) is None)
    with pytest.raises(ValueError, match="not in tools"):
        tool_constraint(TOOLS, NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": "missing"}}), None)
