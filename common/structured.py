"""Structured outputs at the API edge: the OpenAI and vLLM request fields that constrain the output
(`response_format` json_object / json_schema, vLLM's `structured_outputs` and `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`), turned into one `StructuredOutput`
(common/protocol.py) and compiled by llguidance, so a bad schema is a 400 before any worker sees
it. The engine compiles the same spec again (cached) against its vocabulary
(engine/structured_output.py)."""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.protocol import MAX_GRAMMAR_CHARS, StructuredOutput


class StructuredError(ValueError):
    """A constraint that cannot be used; `param` names the request field it came from (and
    starts the message: what a client reads is `"guided_regex: ..."`, never a class name)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` object: one of its constraints."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[str] | None = Field(None, max_length=1024)
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """Mixed into the request models (router and workers)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: list[str] | None = Field(None, max_length=1024)
    guided_grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)

    def constrained(self) -> bool:
        """Whether any constraint field is given (`structured()` says which, and checks it)."""
        rf = self.response_format
        return (rf is not None and rf.type != "text") or any(
            v is not None for v in (self.structured_outputs, self.guided_json, self.guided_regex,
                                    self.guided_choice, self.guided_grammar))

    def constraint_field(self) -> str | None:
        """The request field the constraint came from (for errors that name it)."""
        rf = self.response_format
        if rf is not None and rf.type != "text":
            return "response_format"
        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            if getattr(self, name) is not None:
                return name
        return None

    def structured(self) -> StructuredOutput | None:
        """The request's one constraint; ValueError for two at once or a spec that does not
        compile."""
        found: list[tuple[str, str, str]] = []  # (kind, spec, the field it came from)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("json", '{"type": "object"}', "response_format"))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_ if rf.json_schema else None
            found.append(("json", json.dumps(schema if schema is not None else {"type": "object"}),
                          "response_format"))
        so = self.structured_outputs
        if so is not None:
            for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar)):
                _add(found, kind, value, "structured_outputs")
            if so.json_object:
                found.append(("json", '{"type": "object"}', "structured_outputs"))
        for kind, value in (("json", self.guided_json), ("regex", self.guided_regex),
                            ("choice", self.guided_choice), ("grammar", self.guided_grammar)):
            _add(found, kind, value, f"guided_{kind}")
        if not found:
            return None
        if len(found) > 1:
            raise StructuredError("give one structured output constraint (response_format, "
                                  "structured_outputs or one guided_* field), not several",
                                  found[1][2])
        kind, spec, param = found[0]
        # Checked here, not by StructuredOutput's own validation: its error is pydantic's text
        # (with its URL and the class name), which is not for clients.
        if not spec:
            raise StructuredError("the constraint is empty", param)
        if len(spec) > MAX_GRAMMAR_CHARS:
            raise StructuredError(f"the constraint is longer than {MAX_GRAMMAR_CHARS} "
                                  "characters", param)
        try:
            compile_grammar(kind, spec)
        except ValueError as e:
            raise StructuredError(str(e), param) from e
        return StructuredOutput(kind=kind, spec=spec)


def _add(found: list, kind: str, value: Any, param: str) -> None:
    if value is None:
        return
    if kind in ("json", "choice") and not isinstance(value, str):
        value = json.dumps(value)
    found.append((kind, value, param))


# What one constraint may cost, enforced by llguidance itself on every matcher (router and
# engine), in units of work, not time, so a verdict is the same on a busy machine as on an idle
# one: the fuel for building the lexer's regex ASTs is the limit a nested-repetition bomb
# (`((a{1000}){1000})`: 40 bytes) exhausts; at the default (1M) its first mask took 1-2 s on the
# engine thread, at this one ~50 ms, and then the matcher errs. Ordinary schemas use a few
# thousand. Each mask's own work is capped by `STEP_LEXER_FUEL` and `STEP_MAX_ITEMS`
# (llguidance's defaults: a recursive required schema exhausts the items).
# See tests/security/test_round_two.py and test_round_three.py.
INITIAL_LEXER_FUEL = 100_000
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
# The engine's per-mask deadline: a constrained row whose mask is not done by then ends with an
# error, and the step goes on without waiting for it (engine/structured_output.py).
MASK_DEADLINE_S = 0.5


def parser_limits():
    """llguidance's limits for every matcher Tandem builds."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL,
                                     step_lexer_fuel=STEP_LEXER_FUEL,
                                     step_max_items=STEP_MAX_ITEMS, verbose_errors=False)


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer_file: str):
    import llguidance

    return llguidance.LLTokenizer(tokenizer_file)


GAVE_UP = "the grammar engine gave up on it: "


def check_cost(kind: str, spec: str, tokenizer_file: str) -> str | None:
    """Why a compiled constraint would stall or fail an engine, or None when it is fine: a
    matcher under `parser_limits()` computes its first mask, takes one allowed token and
    computes the next, where a grammar bomb or a constraint nothing can satisfy errs. The
    verdict is llguidance's alone, counted in work (fuel, items), never in time: a busy machine
    refuses nothing an idle one serves (a 0.25 s budget once refused ordinary schemas at
    random). Releases the GIL while llguidance works; thread-safe; cached per spec."""
    key = (kind, hashlib.sha256(spec.encode("utf-8", "surrogatepass")).digest(), tokenizer_file)
    with _VERDICTS_LOCK:
        if key in _VERDICTS:
            _VERDICTS.move_to_end(key)
            return _VERDICTS[key]
    why = _first_masks(kind, spec, tokenizer_file)  # outside the lock: checks run in parallel
    with _VERDICTS_LOCK:
        _VERDICTS[key] = why
        while len(_VERDICTS) > VERDICTS_KEPT:
            _VERDICTS.popitem(last=False)
    return why


# (kind, digest of the spec, tokenizer file) -> llguidance's verdict, least recently used first
# out. Checks run on several threads at once: every access holds the lock (a plain dict evicted
# from two threads raised KeyError, a 500).
VERDICTS_KEPT = 1024
_VERDICTS: OrderedDict[tuple[str, bytes, str], str | None] = OrderedDict()
_VERDICTS_LOCK = threading.Lock()


def _first_masks(kind: str, spec: str, tokenizer_file: str) -> str | None:
    """llguidance's error for the first masks, or None."""
    import llguidance
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask

    tok = _ll_tokenizer(tokenizer_file)  # loaded once (~0.3 s): not the constraint's cost
    matcher = llguidance.LLMatcher(tok, compile_grammar(kind, spec), log_level=0,
                                   limits=parser_limits())
    vocab = tok.vocab_size
    bits = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)  # a bit per token, little-endian
    for _ in range(2):
        if matcher.is_error() or matcher.is_stopped():
            break
        fill_next_token_bitmask(matcher, bits, 0)
        if matcher.is_error():
            break
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].nonzero()[0]
        allowed = [int(t) for t in allowed if t != tok.eos_token]
        if not allowed:
            break
        matcher.consume_token(allowed[0])
    if matcher.is_error():
        return GAVE_UP + (matcher.get_error() or "").splitlines()[0][:200]
    return None


def tokenizer_file_of(folder: str | Path) -> str:
    return str(Path(folder) / "tokenizer.json")


_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str) -> str:
    """llguidance's grammar for a spec; ValueError (naming what is wrong) for a bad one."""
    import llguidance

    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid choice constraint: {_short(e)}") from e
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, str) and c for c in choices)):
            raise ValueError("a choice constraint must be a non-empty list of non-empty strings")
    fmt = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
    try:
        if kind == "json":
            # One space after `:` and `,`, nowhere else (a schema's own x-guidance may say
            # otherwise): free whitespace lets a model pad until max_tokens and cut the JSON.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_LAYOUT)
        else:
            grammar = llguidance.grammar_from(fmt, spec)
    except Exception as e:  # noqa: BLE001 - llguidance raises several kinds for a bad spec
        raise ValueError(f"invalid {kind} constraint: {_short(e)}") from e
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"invalid {kind} constraint: {_short('; '.join(messages))}")
    return grammar


def _short(error: object, limit: int = 500) -> str:
    """A grammar engine's message as a client may read it: bounded (it can quote the whole
    spec, up to 64 KiB)."""
    text = str(error)
    return text if len(text) <= limit else text[:limit] + "..."
