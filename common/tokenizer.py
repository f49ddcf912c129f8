"""Tokenizer and chat template for a model folder, via `tokenizers` and `jinja2` only
(no transformers import at serving time)."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from common.chat_template import ChatTemplate, ChatTemplateError

__all__ = ["ChatTemplateError", "TextStream", "Tokenizer"]

_RELEASE_GIL_CHARS = 4096

# The special tokens a chat template sees as variables (transformers' special_tokens_map).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class TooManyTokens(ValueError):
    """A text has more tokens than asked for (`num_tokens` of them)."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"{num_tokens} tokens")
        self.num_tokens = num_tokens


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates (default, tool_use, ...)
            template = {t["name"]: t["template"] for t in template
                        if isinstance(t, dict) and "name" in t}
        special = {k: _token_str(cfg.get(k)) for k in _SPECIAL_TOKEN_KEYS}
        self.special_tokens = {k: v for k, v in special.items() if v}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.template: ChatTemplate | None = None
        self.set_chat_template(template)

    def set_chat_template(self, template: str | dict[str, str] | None) -> None:
        """Use `template` (a model's own, or a `--chat-template` override)."""
        self.template = ChatTemplate(template, self.special_tokens) if template else None

    @property
    def chat_template(self) -> str | None:
        return self.template.source if self.template else None

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """An upper bound on how many UTF-8 bytes of text one token covers, so a text of N bytes
        has at least N / max_token_bytes tokens (a context-length check needs no tokenizing).
        None when the tokenizer normalizes text first: text may then shrink and no bound holds."""
        if self._tok.normalizer is not None:
            return None
        return (max(len((self._tok.id_to_token(i) or "").encode()) for i in range(self.vocab_size))
                or None)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def template_variables(self) -> frozenset[str] | None:
        """The variables the chat template reads; None without a template."""
        return self.template.variables if self.template else None

    def encode(self, text: str, add_special_tokens: bool = True,
               max_tokens: int | None = None) -> list[int]:
        """The text's ids; TooManyTokens when there are more than `max_tokens` of them."""
        if len(text) > _RELEASE_GIL_CHARS:
            # `encode_batch` releases the GIL while it works and `encode` holds it throughout
            # (0.6 s for 1 MiB of text): a thread tokenizing a long text then lets the event
            # loop and every other thread run (bench/abuse.py). The `_fast` one computes no
            # offsets: 2.6x faster on 1 MiB, and freeing its result holds the GIL 2 ms, not
            # the 50 ms of a 600k-token encoding with offsets. Same ids either way.
            enc = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        # Counted before the ids become a Python list: building millions of ints holds the GIL
        # (0.5 s for 5 MB of text), and a prompt past the limit needs none of them.
        if max_tokens is not None and len(enc) > max_tokens:
            raise TooManyTokens(len(enc))
        return enc.ids

    def encode_prompt(self, prompt: str | list[int] | list[str] | list[list[int]],
                      max_tokens: int | None = None) -> list[int]:
        """The token ids of an OpenAI completions `prompt` (text, ids, or a batch of one of
        either); ValueError for a batch of several, which servers here take one at a time, and
        TooManyTokens past `max_tokens`."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt, max_tokens=max_tokens)
        if prompt and isinstance(prompt[0], int):
            if max_tokens is not None and len(prompt) > max_tokens:
                raise TooManyTokens(len(prompt))
            return list(prompt)
        raise ValueError("send one prompt per request")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def decode_stream(self, skip_special_tokens: bool = True) -> TextStream:
        return TextStream(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text, as transformers' `apply_chat_template(..., tokenize=False)` renders it
        (common/chat_template.py); `kwargs`: tools, documents, continue_final_message, and any
        variable the template reads."""
        if self.template is None:
            raise ChatTemplateError("this model has no chat template")
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    max_tokens: int | None = None, **kwargs: Any) -> list[int]:
        # As transformers does: the template already carries the special tokens.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           False, max_tokens)


class TextStream:
    """Incremental detokenizer: feed token ids, get the text they add (handles multi-byte runs)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tok = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
