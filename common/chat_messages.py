"""The `messages` of a chat request as every OpenAI endpoint we serve reads them (the router's and
the workers'): roles checked, text content parts joined, other parts refused by name (these
servers run text-only models: an image silently dropped would be a wrong answer, not a
degraded one), assistant turns with `tool_calls` and `content: null`, tool results, and the
request's `tools`. What reaches the chat template is plain JSON, bounded.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.errors import APIError

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64
_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"  # OpenAI's function name rule (dots allowed, as vLLM does)
# What `chat_template_kwargs` may not name: the template's own arguments, which the request's
# fields set (a kwarg `messages` was Python's "encode_chat() got multiple values for argument
# 'messages'" in a 400), the parameters of the functions that pass the kwargs on
# (common/tokenizer.py encode_chat, common/chat_template.py render), and the template's globals
# (a kwarg would shadow `raise_exception`).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "max_tokens", "self", "raise_exception", "namespace", "dict", "strftime_now"})


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=_NAME)
    description: str | None = Field(None, max_length=16384)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    class _Name(BaseModel):
        name: str = Field(pattern=_NAME)

    type: Literal["function"] = "function"
    function: _Name


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def chat_messages(raw: list[Any]) -> list[dict[str, Any]]:
    """The messages as the template gets them; an APIError(400) naming the field otherwise."""
    if not raw:
        raise _bad("messages must not be empty", "messages")
    if len(raw) > MAX_MESSAGES:
        raise _bad(f"at most {MAX_MESSAGES} messages", "messages")
    return [_message(m, i) for i, m in enumerate(raw)]


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(f"{where} must be an object", where)
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        out["content"] = _text_parts(content, f"{where}.content")
    elif content is None:
        if role not in ("assistant",):
            raise _bad(f"{where}.content is required for a {role} message", f"{where}.content")
        if not m.get("tool_calls") and not m.get("function_call") and not m.get("refusal"):
            out["content"] = ""  # an empty assistant turn
    elif not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or a list of content parts",
                   f"{where}.content")
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    if role == "tool" and not isinstance(m.get("tool_call_id", ""), str):
        raise _bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
    return out


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            texts.append(p["text"])
        elif kind in ("refusal",) and isinstance(p.get("refusal"), str):
            texts.append(p["refusal"])
        else:
            raise _bad(f"{where}[{j}]: content parts of type {kind!r} are not supported: this "
                       "server runs a text-only model (send text parts or a string)",
                       f"{where}[{j}].type")
    # As vLLM: text parts are joined by newlines.
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise _bad(f"{where} must be a list of at most {MAX_TOOL_CALLS} calls", where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}[{j}] needs function.name", f"{where}[{j}].function")
        args = fn.get("arguments", "{}")
        # Templates render arguments with `tojson` and expect an object; OpenAI clients send the
        # JSON text. Parse it where it is an object, as vLLM does.
        if isinstance(args, str):
            try:
                parsed = json.loads(args or "{}")
            except json.JSONDecodeError:
                parsed = args
            args = parsed if isinstance(parsed, dict) else args
        out.append({**c, "function": {**fn, "arguments": args}})
    return out


def tools_for_template(tools: list[Tool] | None) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class ChatFields(BaseModel):
    """The chat-only request fields both the router's and the workers' models take."""

    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras: how the template is applied.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = Field(None, max_length=256)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, v):
        try:
            return chat_messages(v)
        except APIError as e:
            raise ValueError(e.message) from e

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v):
        taken = sorted(RESERVED_TEMPLATE_KWARGS.intersection(v or ()))
        if taken:
            raise ValueError(f"may not set {', '.join(map(repr, taken))}: the request's own "
                             "fields (or the template) set those")
        return v

    def template_args(self) -> dict[str, Any]:
        """What the chat template is rendered with besides the messages."""
        kwargs: dict[str, Any] = dict(self.chat_template_kwargs or {})
        # tool_choice "none": the model is told of no tools, so it cannot call one.
        if self.tools and self.tool_choice != "none":
            kwargs["tools"] = tools_for_template(self.tools)
        if self.documents:
            kwargs["documents"] = self.documents
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_messages", param)
