"""Each choice's sampling options, all validated before any choice starts (a 400 for the last
one must not leave the others generating), and the cost of a constraint bounded before it
reaches an engine: compiled and its first masks computed off the event loop under llguidance's
limits (common/structured.py `check_cost`: a verdict in units of work, the same on a busy
machine as on an idle one); one that would stall or fail an engine is a 400 naming its field.
A refused constraint is remembered by a digest of its request fields, so the same bomb sent
again is refused on the event loop for the price of a dictionary lookup. The checks run two at
a time, shared round robin between clients (router/fair_slots.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict

from pydantic import ValidationError

from common.errors import APIError, validation_detail
from common.protocol import SamplingOptions
from common.structured import check_cost, tokenizer_file_of
from common.tool_calls import constrain_tools
from router.fair_slots import FairSlots
from router.models import ServedModel
from router.openai_models import ChatCompletionRequest, CompletionRequest

REFUSED_KEPT = 4096  # refused constraints remembered (least recently refused forgotten first)


def sampling_options(body, n_index: int, max_tokens_default: int) -> SamplingOptions:
    """Choice `n_index`'s options; APIError 400 naming the field (never pydantic's own text)."""
    lp = ((body.top_logprobs or 0)
          if isinstance(body, ChatCompletionRequest) and body.logprobs else None)
    if isinstance(body, CompletionRequest):
        lp = body.logprobs
    try:
        opts = body.sampling_options(max_tokens_default, n_index, lp)
    except ValidationError as e:  # pydantic's own text (with its URL) is not for clients
        message, field = validation_detail(e)
        raise APIError(400, message + (f" (choice {n_index})" if body.n > 1 else ""),
                       "invalid_request", field) from e
    except ValueError as e:  # common/structured.py StructuredError: "<field>: ..."
        raise APIError(400, str(e), "invalid_request", getattr(e, "param", None)) from e
    if isinstance(body, ChatCompletionRequest):
        try:
            return constrain_tools(body, opts)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_request",
                           getattr(e, "param", "tool_choice")) from e
    return opts


class Choices:
    def __init__(self, max_tokens_default: int) -> None:
        self.max_tokens_default = max_tokens_default
        # Grammar checks run in threads (llguidance releases the GIL); two at a time, so a
        # flood of distinct constraints costs the router two cores' worth at most, and a freed
        # slot goes to the next client in turn: one client's queue of bombs delays another's
        # check by one check, not by the queue (a global semaphore served them in order).
        self._checks = FairSlots(2)
        self._refused: OrderedDict[tuple[str, str, bytes], str] = OrderedDict()

    async def options(self, body, model: ServedModel, client: str = "") -> list[SamplingOptions]:
        """Every choice's options, or the first choice's error; `client` (router/clients.py)
        takes its turn for a grammar check."""
        if not (body.constrained() or getattr(body, "tools", None)):
            return [sampling_options(body, i, self.max_tokens_default) for i in range(body.n)]
        param = body.constraint_field() or "tool_choice"
        key = (model.name, param, _spec_key(body, param))
        why = self._refused.get(key)
        if why is None:
            async with self._checks.slot(client):
                why = await asyncio.to_thread(self._check, body, model)
            if isinstance(why, list):
                return why
            self._refused[key] = why  # llguidance's verdict: the same every time
            if len(self._refused) > REFUSED_KEPT:
                self._refused.popitem(last=False)
        else:
            self._refused.move_to_end(key)
        raise APIError(400, f"{param}: the output constraint cannot be served: {why}",
                       "invalid_request", param)

    def _check(self, body, model: ServedModel) -> list[SamplingOptions] | str:
        """The options, or why the constraint cannot be served. The first choice's constraint
        is checked before the other choices' options are built (cheap refusal first)."""
        first = sampling_options(body, 0, self.max_tokens_default)
        s = first.structured
        if s is not None and model.tokenizer_source:
            why = check_cost(s.kind, s.spec, tokenizer_file_of(model.tokenizer_source))
            if why is not None:
                return why
        return [first, *(sampling_options(body, i, self.max_tokens_default)
                         for i in range(1, body.n))]


def _spec_key(body, param: str) -> bytes:
    """A digest of the request's constraint as sent (the tools too, which constrain a chat's
    output): the refusal cache keeps 32 bytes a constraint, not a body of up to 4 MiB."""
    fields = {param: getattr(body, param, None), "tools": getattr(body, "tools", None),
              "tool_choice": getattr(body, "tool_choice", None)}
    # json, not orjson: a client's strings may hold lone surrogates, which orjson refuses (a 500
    # before this); ensure_ascii escapes them, and the key only has to be deterministic.
    return hashlib.sha256(json.dumps(fields, default=lambda v: v.model_dump(mode="json")
                                     if hasattr(v, "model_dump") else str(v),
                                     sort_keys=True).encode()).digest()
