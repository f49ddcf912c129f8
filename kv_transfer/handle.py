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


# ---- peer prefix handles (issue 42: pull a cached prefix from whichever worker holds it) -------
# A holder's export of its cached leading blocks (worker/prefix_export.py) is signed over these
# fields, `kind` included: a prefix handle never checks as a P/D handle nor the other way round
# (their signatures cover different field sets), and it names the one worker that may pull.
PREFIX_KIND = "prefix"
PREFIX_SIGNED_FIELDS = ("kind", "remote_request_id", "remote_engine_id", "remote_host",
                        "remote_port", "remote_block_ids", "block_hashes", "requester",
                        "expires_at", "remote_staging_start")


def prefix_signature(fields: dict, token: str) -> str:
    return sign_json({k: fields.get(k) for k in PREFIX_SIGNED_FIELDS}, token)


def sign_prefix(fields: dict, token: str | None) -> dict:
    """A prefix handle's fields with `kind` and (with a token) `signature` added."""
    fields = {**fields, "kind": PREFIX_KIND}
    return {**fields, "signature": prefix_signature(fields, token)} if token else fields


def verify_prefix(kvp: KVTransferParams, token: str | None, requester: str,
                  block_hashes: list[int], require_signature: bool,
                  now: float | None = None) -> int:
    """The number of leading blocks `kvp` lets worker `requester` pull into a prompt whose own
    full-block hashes are `block_hashes`; raises InvalidHandle naming the first problem."""
    fields = {**kvp.model_dump(), **(kvp.model_extra or {})}
    missing = [k for k in REQUIRED_FIELDS + ("block_hashes",) if fields.get(k) is None]
    if missing:
        raise InvalidHandle(f"the prefix handle lacks {', '.join(missing)}")
    if fields.get("kind") != PREFIX_KIND:
        raise InvalidHandle("not a prefix handle")
    if require_signature:
        if not token:
            raise InvalidHandle("signed KV handles need an internal token on this worker")
        if not kvp.signature or not secrets_equal(kvp.signature, prefix_signature(fields, token)):
            raise InvalidHandle("the prefix handle's signature does not match")
        if kvp.expires_at is None:
            raise InvalidHandle("the prefix handle has no expiry")
    if kvp.expires_at is not None and (now if now is not None else time.time()) >= kvp.expires_at:
        raise InvalidHandle("the prefix handle has expired")
    if fields.get("requester") != requester:
        raise InvalidHandle("the prefix handle was issued to another worker")
    hashes, remote = list(kvp.block_hashes), list(kvp.remote_block_ids)
    if not hashes or len(hashes) != len(remote):
        raise InvalidHandle("the prefix handle names no blocks, or not one per hash")
    if hashes != list(block_hashes[:len(hashes)]) or len(hashes) > len(block_hashes):
        raise InvalidHandle("the prefix handle's block hashes are not this prompt's leading ones")
    return len(hashes)


class SpentHandles:
    """The prefix handles a puller has used, each until it expires. A one-sided read (NIXL)
    cannot be refused by the holder once the lease behind it has ended (the blocks may hold
    another prompt's KV by then), so the puller refuses a second use of a handle itself. Bounded:
    full of unexpired handles, it refuses new ones (the prompt is computed instead)."""

    def __init__(self, capacity: int = 65_536, unexpiring_s: float = 3600.0) -> None:
        self.capacity, self.unexpiring_s = capacity, unexpiring_s
        self._until: dict[str, float] = {}

    def spend(self, kvp: KVTransferParams, now: float | None = None) -> bool:
        """Record `kvp` as used; False if it was already (or no room is left)."""
        now = time.time() if now is None else now
        key = kvp.signature or f"{kvp.remote_engine_id}/{kvp.remote_request_id}"
        if key in self._until:
            return False
        if len(self._until) >= self.capacity:
            self._until = {k: t for k, t in self._until.items() if t > now}
            if len(self._until) >= self.capacity:
                return False
        # A handle without expiry (unsigned handles allowed: development) is kept for an hour.
        self._until[key] = kvp.expires_at if kvp.expires_at is not None else now + self.unexpiring_s
        return True
