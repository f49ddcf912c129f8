"""Tool calls in chat completions (OpenAI's `tools` / `tool_choice`).

- `auto`: the tools are rendered into the chat template and the model's text is parsed for calls
  in its own format by a parser from `PARSERS` (`--tool-call-parser`, as vLLM's flag; Hermes
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` first, the format Qwen2.5, Hermes and
  our shipped ChatML template use).
- `required` and a named function: the output is constrained by a JSON schema (structured
  outputs), so the arguments always parse and match the function's schema; as vLLM does,
  `required` produces a JSON array of `{name, parameters}`, a named choice the arguments object.
- `none`: the model is told of no tools.

`ToolStream` turns a stream of text into OpenAI's streamed `delta.tool_calls` (id, type and name
first, then the arguments in pieces) and the final `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Protocol

from common.chat_messages import NamedToolChoice, Tool
from common.protocol import MAX_GRAMMAR_CHARS, SamplingOptions, StructuredOutput
from common.structured import StructuredError, compile_grammar

ARGUMENT_PIECE_CHARS = 16  # streamed arguments come in pieces of about this size


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{os.urandom(12).hex()}")

    def message(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser(Protocol):
    start: str  # the text that opens a call: what a stream holds back once seen

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text without its calls, and the calls (empty when there are none)."""


class HermesParser:
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for raw in self._CALL.findall(text):
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError:
                continue  # not a call after all: stays in the text below
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = obj.get("arguments", obj.get("parameters", {}))
                calls.append(ToolCall(obj["name"],
                                      args if isinstance(args, str) else json.dumps(args)))
        if not calls:
            return text, []
        return text[: text.index(self.start)].rstrip(), calls


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}


def tool_constraint(tools: list[Tool] | None, choice,
                    parallel: bool | None) -> StructuredOutput | None:
    """The JSON schema that `required` or a named `tool_choice` puts on the output;
    StructuredError (naming `tool_choice`) when there can be none."""
    if not tools or choice in (None, "none", "auto"):
        return None
    by_name = {t.function.name: t.function for t in tools}
    if isinstance(choice, NamedToolChoice):
        fn = by_name.get(choice.function.name)
        if fn is None:
            raise StructuredError(f"names {choice.function.name!r}, which is not in tools",
                                  "tool_choice")
        return _json_constraint(_parameters(fn))
    items = {"anyOf": [{"type": "object", "additionalProperties": False,
                        "properties": {"name": {"const": name}, "parameters": _parameters(fn)},
                        "required": ["name", "parameters"]} for name, fn in by_name.items()]}
    schema = {"type": "array", "minItems": 1, "items": items}
    if parallel is False:
        schema["maxItems"] = 1
    return _json_constraint(schema)


def _json_constraint(schema: dict) -> StructuredOutput:
    spec = json.dumps(schema)
    if len(spec) > MAX_GRAMMAR_CHARS:  # StructuredOutput's own check would be pydantic's text
        raise StructuredError(f"the tools' parameter schemas come to more than "
                              f"{MAX_GRAMMAR_CHARS} characters", "tool_choice")
    return StructuredOutput(kind="json", spec=spec)


def constrain_tools(body, opts: SamplingOptions) -> SamplingOptions:
    """A chat body's `required` or named tool choice as the output's constraint (the router's and
    the workers' endpoints); StructuredError (a ValueError naming `tool_choice`) when it cannot
    be one."""
    forced = tool_constraint(body.tools, body.tool_choice, body.parallel_tool_calls)
    if forced is None:
        return opts
    if opts.structured is not None:
        raise StructuredError("'required' or a named function cannot be combined with another "
                              "structured output constraint", "tool_choice")
    try:
        compile_grammar(forced.kind, forced.spec)
    except ValueError as e:
        raise StructuredError(str(e), "tool_choice") from e
    opts.structured = forced
    return opts


def _parameters(fn) -> dict:
    return fn.parameters or {"type": "object", "properties": {}}


class ToolCalls:
    """How one chat request's output becomes content and tool calls."""

    def __init__(self, tools: list[Tool] | None, choice, parser: str = "hermes") -> None:
        self.mode = "off" if not tools or choice == "none" else (
            "named" if isinstance(choice, NamedToolChoice) else (choice or "auto"))
        self.name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self.parser = PARSERS[parser]()

    @classmethod
    def for_request(cls, body, chat: bool, parser: str) -> ToolCalls | None:
        """The request's tool calls, or None when it has no tools in play."""
        if not chat or not body.tools:
            return None
        tools = cls(body.tools, body.tool_choice, parser)
        return tools if tools.active else None

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut by max_tokens: no call to report
            return None, [ToolCall(i["name"], json.dumps(i["parameters"])) for i in items]
        content, calls = self.parser.parse(text)
        return (content or None) if calls else content, calls


class ToolStream:
    """Streamed deltas for one choice. A named function's arguments stream as they are generated
    (id, type and name first); otherwise text passes through until a call can start, then is
    held and given out as `tool_calls` deltas when the output ends. Each piece of text is
    scanned once (with the held-back tail): linear in the output."""

    def __init__(self, calls: ToolCalls) -> None:
        self.calls = calls
        self._parts: list[str] = []  # the whole text, joined once at the end
        self._pending = ""  # text after what was given out, before a call's tag is seen
        self._call_seen = False
        self.sent = 0  # characters of text given out as content
        self.num_calls = 0
        self._named = ToolCall(calls.name, "") if calls.mode == "named" else None

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """New text; the content and the tool-call deltas that may be sent now."""
        self._parts.append(text)
        if self._named is not None:
            deltas = [] if self.num_calls else [_head(0, self._named)]
            self.num_calls = 1
            if text:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return "", deltas
        if self.calls.mode == "required" or self._call_seen:
            return "", []  # a JSON array of calls, or a call begun: given out at the end
        start = self.calls.parser.start
        pending = self._pending + text
        held_from = pending.find(start)
        if held_from >= 0:
            self._call_seen = True
        else:  # hold back a tail that could be the start of the tag
            held_from = len(pending)
            for k in range(min(len(start) - 1, len(pending)), 0, -1):
                if pending.endswith(start[:k]):
                    held_from = len(pending) - k
                    break
        out, self._pending = pending[:held_from], pending[held_from:]
        self.sent += len(out)
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        """The rest of the content and the last tool-call deltas."""
        if self._named is not None:
            deltas = [] if self.num_calls else [_head(0, self._named)]
            self.num_calls = 1
            return "", deltas
        text = self.text
        content, calls = self.calls.split(text)
        rest = (content or "")[self.sent:] if calls else text[self.sent:]
        self.sent = len(text)
        deltas = []
        for index, call in enumerate(calls):
            deltas.append(_head(index, call))
            for i in range(0, len(call.arguments), ARGUMENT_PIECE_CHARS):
                deltas.append({"index": index, "function": {
                    "arguments": call.arguments[i:i + ARGUMENT_PIECE_CHARS]}})
        self.num_calls = len(calls)
        return rest, deltas


def _head(index: int, call: ToolCall) -> dict:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": ""}}
