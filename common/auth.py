"""Bearer-token checks shared by the internal worker endpoints."""

from __future__ import annotations

import hmac

from fastapi import Header, HTTPException


def bearer_matches(authorization: str | None, token: str | None) -> bool:
    """True when no token is configured, or the header carries exactly `Bearer <token>`."""
    if not token:
        return True
    if not authorization or not authorization.startswith("Bearer "):
        return False
    return hmac.compare_digest(authorization[len("Bearer "):], token)


def require_internal_token(token: str | None):
    """FastAPI dependency refusing requests without the internal token (401)."""

    async def check(authorization: str | None = Header(default=None)) -> None:
        if not bearer_matches(authorization, token):
            raise HTTPException(status_code=401, detail="missing or invalid internal token")

    return check
