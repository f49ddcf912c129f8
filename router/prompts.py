"""A request's prompt: its body rendered through the chat template and tokenized, within the
model's context. Cheap checks come first, and a large body is handled off the event loop, so a
few multi-megabyte bodies cannot stall every other request (and /health)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from common.errors import APIError
from common.openai_request import prompt_token_ids
from common.tokenizer import Tokenizer, TooManyTokens
from router.openai_format import parse_body, text_chars


class Prompts:
    """Bodies over `offload_bytes` are measured, rendered and tokenized on two threads of their
    own: `tools`, tool call arguments, documents and template kwargs render too, not only the
    contents, and any of them can be megabytes. More threads would only contend with the event
    loop for the GIL; the rest wait their turn, off the loop."""

    def __init__(self, offload_bytes: int) -> None:
        self.offload_bytes = offload_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="render")

    async def parse(self, model, raw: bytes):
        """`model` validated from a body (router/openai_format.py parse_body), off the loop
        when the body is large: a 3.6 MiB body takes ~2 ms, and a loop that parses eight such
        bodies at a time answers nothing else meanwhile."""
        if len(raw) > self.offload_bytes:
            return await asyncio.get_running_loop().run_in_executor(self._pool, parse_body,
                                                                    model, raw)
        return parse_body(model, raw)

    async def token_ids(self, tokenizer: Tokenizer, body, limit: int, body_bytes: int) -> list[int]:
        """The body's prompt ids; a 400 naming the field when it is empty, outside the
        vocabulary or longer than the context `limit` leaves room for."""
        if body_bytes > self.offload_bytes:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._pool, prompt_within, tokenizer, body, limit)
        else:
            ids = prompt_within(tokenizer, body, limit)
        vocab_size = tokenizer.vocab_size
        if min(ids) < 0 or max(ids) >= vocab_size:  # also keeps them hashable as uint32
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", "invalid_prompt",
                           "prompt")
        return ids

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def prompt_within(tokenizer: Tokenizer, body, limit: int) -> list[int]:
    """Render and tokenize a body within the context `limit`: text longer than `limit` tokens
    could ever cover is refused before rendering, and tokenizing stops counting past the limit
    (common/tokenizer.py TooManyTokens)."""
    param = "messages" if hasattr(body, "messages") else "prompt"
    max_tokens = body.requested_max_tokens() or 0
    chars = text_chars(body, tokenizer.template_variables or frozenset())
    max_token_bytes = tokenizer.max_token_bytes
    if max_token_bytes and chars > max_token_bytes * limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                       f"request's {chars} characters of text are longer than that",
                       "context_length_exceeded", param)
    try:
        ids = prompt_token_ids(tokenizer, body, max(limit - max(max_tokens, 1), 0))
    except TooManyTokens as e:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the request "
                       f"has {e.num_tokens} prompt tokens and asks for {max_tokens} more",
                       "context_length_exceeded", param) from e
    if not ids:
        raise APIError(400, "the prompt is empty", "invalid_prompt", "prompt")
    return ids
