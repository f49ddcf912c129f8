"""A model's chat template, rendered the way `transformers`' `apply_chat_template` renders it, so
the router's prompt tokens are the ones the model was trained on: the same Jinja sandbox and
extensions (`loopcontrols` for `{% break %}`, the `{% generation %}` tag), the same `tojson` (no
HTML escaping, non-ASCII kept), `raise_exception`, `strftime_now`, `namespace`, the special tokens
as variables, `tools` and `documents`, `None`-valued message keys dropped, reasoning fields aliased,
`add_generation_prompt` and `continue_final_message`.

tests/common/test_chat_template.py checks it string for string against transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The conversation does not fit the model's chat template (raised by the template itself)."""


# The names a message's reasoning goes by; templates read `reasoning_content` (gpt-oss: `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    keeps the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` without underscore attributes (no reaching into CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError("a namespace attribute may not start "
                                                  f"with '_': {name!r}")


class _Dict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, &, ' for HTML; chat templates want the JSON itself.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, dict=_Dict(), namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _plain(value: Any) -> Any:
    """Only JSON types reach the template (the sandbox does not know every object's methods)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return repr(value)


def _message(message: Mapping) -> dict:
    # As transformers: keys whose value is None are dropped (`content: null` on an assistant turn
    # with tool calls), and reasoning goes under every name templates read.
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class ChatTemplate:
    """One template source (or a model's named templates: `default`, `tool_use`)."""

    def __init__(self, source: str | dict[str, str],
                 special_tokens: dict[str, str] | None = None) -> None:
        named = source if isinstance(source, dict) else {"default": source}
        if "default" not in named:
            raise ValueError(f"named chat templates need a 'default' one, got {sorted(named)}")
        env = _environment()
        self.sources = named
        self._compiled = {name: env.from_string(text) for name, text in named.items()}
        self.special_tokens = dict(special_tokens or {})
        # The variables any of the templates reads (`tools`, `documents`, a kwarg...): what a
        # request's size check counts of its body (router/openai_format.py text_chars).
        self.variables = frozenset().union(*(jinja2.meta.find_undeclared_variables(env.parse(t))
                                             for t in named.values()))

    @property
    def source(self) -> str:
        return self.sources["default"]

    def render(self, messages: list[Mapping[str, Any]], *, tools: list[dict] | None = None,
               documents: list[dict] | None = None, add_generation_prompt: bool = False,
               continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text; raises ChatTemplateError where the template refuses the conversation."""
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt "
                                    "exclude each other")
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        try:
            return self._render(name, [_message(_plain(m)) for m in messages], tools, documents,
                                add_generation_prompt, continue_final_message, kwargs)
        except jinja2.UndefinedError as e:
            if not any(isinstance(m, Mapping) and "content" in m and m["content"] is None
                       for m in messages):
                raise ChatTemplateError(f"the chat template failed: {e}") from e
        # A template that knows nothing of tool calls reads every message's content: give the
        # assistant turns whose content is null an empty one (transformers would fail here).
        chat = [_message({**_plain(m), "content": m.get("content") or ""}) for m in messages]
        try:
            return self._render(name, chat, tools, documents, add_generation_prompt,
                                continue_final_message, kwargs)
        except jinja2.UndefinedError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from e

    def _render(self, name: str, chat: list[dict], tools, documents, add_generation_prompt: bool,
                continue_final_message: bool, kwargs: dict) -> str:
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message needs a final message "
                                        "with text content")
            chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
        try:
            text = self._compiled[name].render(
                messages=chat, tools=_plain(tools), documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **_plain({**self.special_tokens, **kwargs}))
        except (ChatTemplateError, jinja2.UndefinedError):
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from e
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            # A value of a type the template does not expect (a `chat_template_kwargs` entry, a
            # tool) met its code: Python's own text ("'int' object is not iterable") is not for
            # clients.
            raise ChatTemplateError("the chat template could not render the request: a value "
                                    "(in chat_template_kwargs, tools, documents or messages) has "
                                    "a type it does not take") from e
        if final is not None:
            tag = text.rfind(_CONTINUE_TAG.strip())
            if tag < 0 or final.strip() not in text:
                raise ChatTemplateError("the chat template dropped the final message to continue")
            text = (text[:tag] if text[tag:tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG
                    else text[:tag].rstrip())
        return text
