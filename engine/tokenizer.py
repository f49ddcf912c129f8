"""The tokenizer lives in `common.tokenizer` (torch-free, so the router shares it)."""

from common.tokenizer import ChatTemplateError, TextStream, Tokenizer

__all__ = ["ChatTemplateError", "TextStream", "Tokenizer"]
