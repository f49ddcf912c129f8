"""Signed KV handles: what lets a decode worker trust `kv_transfer_params`.

A prefill worker signs each handle it issues with the cluster's internal token:

    signature = HMAC-SHA256(token, canonical JSON of SIGNED_FIELDS)

A decode worker pulls only with a handle whose signature checks out and that has not expired,
only from the engine and address the handle names, and only into the prompt the handle was
issued for (`num_tokens`, `prompt_hash` and every full block's hash must equal its own). So a
client, a peer or anything else without the token can neither point a decode worker at another
host (SSRF), nor make it cache one prompt's KV under another prompt's hashes (poisoning).
Without a token (a loopback-only development cluster, or `--insecure`) handles are unsigned and
only the prompt checks apply.
"""

from __future__ import annotations

import time

from common.auth import secrets_equal, sign_json
from common.hashing import hash_tokens
from common.protocol import KVTransferParams

SIGNED_FIELDS = ("remote_request_id", "remote_engine_id", "remote_host", "remote_port",
                 "remote_block_ids", "block_hashes", "num_tokens", "prompt_hash", "expires_at",
                 "remote_staging_start")
# The fields a pull cannot do without, signed or not.
REQUIRED_FIELDS = ("remote_request_id", "remote_engine_id", "remote_host", "remote_port",
                   "remote_block_ids")


class InvalidHandle(ValueError):
    """A handle this worker will not pull with; the request is prefilled locally instead."""


def signature(fields: dict, token: str) -> str:
    return sign_json({k: fields.get(k) for k in SIGNED_FIELDS}, token)


def sign(fields: dict, token: str | None) -> dict:
    """`fields` with `signature` added (left unsigned without a token)."""
    return {**fields, "signature": signature(fields, token)} if token else dict(fields)


def verify(kvp: KVTransferParams, token: str | None, prompt_token_ids: list[int],
           block_hashes: list[int], require_signature: bool, now: float | None = None) -> None:
    """Raises InvalidHandle naming the first problem; returns when `kvp` may be pulled with for
    this prompt (`block_hashes`: this worker's own hashes of its full blocks)."""
    fields = kvp.model_dump()
    missing = [k for k in REQUIRED_FIELDS if fields.get(k) is None]
    if missing:
        raise InvalidHandle(f"the KV handle lacks {', '.join(missing)}")
    if require_signature:
        if not token:
            raise InvalidHandle("signed KV handles need an internal token on this worker")
        if not kvp.signature:
            raise InvalidHandle("the KV handle is not signed")
        if not secrets_equal(kvp.signature, signature(fields, token)):
            raise InvalidHandle("the KV handle's signature does not match")
        if kvp.expires_at is None:
            raise InvalidHandle("the KV handle has no expiry")
    if kvp.expires_at is not None and (now if now is not None else time.time()) >= kvp.expires_at:
        raise InvalidHandle("the KV handle has expired")
    # The prompt checks hold signed or not: a handle fills only the prompt it was issued for.
    if kvp.num_tokens is not None and kvp.num_tokens != len(prompt_token_ids):
        raise InvalidHandle(f"the KV handle is for a prompt of {kvp.num_tokens} tokens, "
                            f"this one has {len(prompt_token_ids)}")
    if kvp.prompt_hash is not None and kvp.prompt_hash != hash_tokens(prompt_token_ids):
        raise InvalidHandle("the KV handle was issued for another prompt")
    if kvp.block_hashes is not None and list(kvp.block_hashes) != list(block_hashes):
        raise InvalidHandle("the KV handle's block hashes differ from this prompt's")
    if require_signature and (kvp.num_tokens is None or kvp.prompt_hash is None
                              or kvp.block_hashes is None):
        raise InvalidHandle("the KV handle does not say which prompt it is for")
