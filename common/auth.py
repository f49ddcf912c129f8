"""Bearer-token checks shared by the router, the internal worker endpoints and the transports."""

from __future__ import annotations

import hashlib
import hmac
import json

from fastapi import Header, HTTPException


def secrets_equal(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets of any characters (`hmac.compare_digest` raises
    on non-ASCII str, which once turned a hostile header into a 500)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                               expected.encode("utf-8", "surrogateescape"))


def sign_json(obj: dict, token: str) -> str:
    """HMAC-SHA256 (hex) under `token` of `obj`'s canonical JSON (sorted keys, no spaces): how a
    holder of the internal token vouches for data that passes through others (KV handles,
    Redis registrations). Check a signature with `secrets_equal`."""
    payload = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(token.encode(), payload, hashlib.sha256).hexdigest()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    return authorization[len("Bearer "):]


def bearer_matches(authorization: str | None, token: str | None) -> bool:
    """True when no token is configured, or the header carries exactly `Bearer <token>`."""
    if not token:
        return True
    given = bearer_token(authorization)
    return given is not None and secrets_equal(given, token)


def require_internal_token(token: str | None):
    """FastAPI dependency refusing requests without the internal token (401)."""

    async def check(authorization: str | None = Header(default=None)) -> None:
        if not bearer_matches(authorization, token):
            raise HTTPException(status_code=401, detail="missing or invalid internal token")

    return check
