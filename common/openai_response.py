"""OpenAI response objects, built the same way by every OpenAI endpoint we serve (the router's
and the workers'): choices of a full response, choices of a stream chunk, usage, the envelope."""

from __future__ import annotations

from typing import Any


def usage(num_prompt: int, num_output: int, num_cached: int | None = None) -> dict:
    """OpenAI's usage object; `num_cached`: prompt tokens served from the prefix cache."""
    out: dict[str, Any] = {"prompt_tokens": num_prompt, "completion_tokens": num_output,
                           "total_tokens": num_prompt + num_output}
    if num_cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return out


def choice(index: int, text: str, finish: str | None, chat: bool,
           logprobs: dict | None = None) -> dict:
    """One choice of a full (non-streamed) response."""
    c: dict[str, Any] = {"index": index, "finish_reason": finish}
    if chat:
        c["message"] = {"role": "assistant", "content": text}
    else:
        c["text"] = text
    c["logprobs"] = logprobs
    return c


def chunk_choice(delta: str, finish: str | None, chat: bool, logprobs: dict | None = None) -> dict:
    """The choice of one stream chunk; a chat chunk that only finishes has an empty delta."""
    if chat:
        return {"index": 0, "delta": {"content": delta} if delta or finish is None else {},
                "finish_reason": finish, "logprobs": logprobs}
    return {"index": 0, "text": delta, "finish_reason": finish, "logprobs": logprobs}


def envelope(rid: str, chat: bool, created: int, model: str, choices: list[dict], *,
             stream: bool = False, usage_: dict | None = None) -> dict:
    """`{id, object, created, model, choices[, usage]}` with the object name of its kind."""
    if stream:
        obj = "chat.completion.chunk" if chat else "text_completion"
    else:
        obj = "chat.completion" if chat else "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out
