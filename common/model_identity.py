"""What makes two workers serve "the same model" (docs/contract.md "Registration per model"): the
digest of the files that decide its tokens (config and tokenizer), and the names it is served under.

The router keeps one tokenizer, block hasher and prefix index per (served name, digest) and routes
a request only among workers of its model; the hash seed includes the digest, so blocks of two
models can never match each other even where their token ids coincide.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from common.bounds import MAX_TOKEN_ID

# The files that decide a model's token ids and their meaning. The weights are left out on
# purpose: hashing gigabytes at every start would cost minutes, and two folders that differ only
# in their weights are a deployment error the digest cannot catch cheaply anyway.
IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "tokenizer.model", "vocab.json", "merges.txt")
DIGEST_CHARS = 16

# A served model name as it may appear in a request, a registration and a metric label.
# (vLLM names a model after its path unless given --served-model-name: `/models/x` is a name.)
NAME_PATTERN = r"^[A-Za-z0-9/.][A-Za-z0-9._:/@+\-]{0,255}$"
_NAME = re.compile(NAME_PATTERN)
DIGEST_PATTERN = r"^[0-9a-f]{16}$"


def model_digest(folder: str | Path) -> str:
    """sha256 over the identity files present in `folder` (name and bytes, in a fixed order);
    the first 16 hex digits. Raises FileNotFoundError when none of them is there."""
    folder = Path(folder)
    h = hashlib.sha256()
    found = 0
    for name in IDENTITY_FILES:
        path = folder / name
        if path.is_file():
            data = path.read_bytes()
            h.update(f"{name}\0{len(data)}\0".encode())
            h.update(data)
            found += 1
    if not found:
        raise FileNotFoundError(f"{folder} has no config or tokenizer files to "
                                "identify the model by")
    return h.hexdigest()[:DIGEST_CHARS]


def config_vocab_size(folder: str | Path) -> int | None:
    """The vocabulary size in a model folder's config.json (a multimodal config's text part
    too), or None where there is none or it is no valid size. The one reader of it for the
    router and the vLLM bridge (what they register and check token ids against)."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text()[:1 << 20])
        size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    # bool is an int: `"vocab_size": true` is no size.
    if isinstance(size, bool) or not isinstance(size, int):
        return None
    return size if 0 < size <= MAX_TOKEN_ID + 1 else None


def is_name(name: object) -> bool:
    return isinstance(name, str) and bool(_NAME.match(name))


def check_name(name: str) -> str:
    """A served model name, or ValueError saying what is wrong with it."""
    if not _NAME.match(name):
        raise ValueError(f"served model name {name!r} must be 1-256 characters of "
                         "[A-Za-z0-9._:/@+-], not starting with one of :@+-")
    return name
