"""API keys (401) and per-key request / token rate limits (429 + Retry-After).

Limits are fixed one-minute windows kept in Redis (`tandem:{ns}:rl:{key}:{minute}`), so every
router replica in a namespace shares them; without Redis each replica counts for itself. If
Redis fails mid-flight the request is let through (fail open) rather than refused.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from common.auth import bearer_token, secrets_equal
from common.errors import APIError
from common.registry import RedisKeys

log = logging.getLogger(__name__)


def load_keys(keys: list[str], keys_file: Path | None) -> set[str]:
    out = {k.strip() for k in keys if k.strip()}
    if keys_file is not None:
        out |= {line.strip() for line in keys_file.read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    return out


class KeyAuth:
    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> str | None:
        """The caller's key, or None when no keys are configured; 401 otherwise."""
        if not self.keys:
            return None
        token = bearer_token(authorization) or ""
        for key in self.keys:
            if secrets_equal(token, key):
                return key
        raise APIError(401, "invalid or missing API key", "invalid_api_key")


class RateLimiter:
    def __init__(self, redis, keys: RedisKeys, rpm: int | None, tpm: int | None) -> None:
        self.redis = redis
        self.prefix = keys.prefix + "rl:"
        self.rpm, self.tpm = rpm, tpm
        self._local: dict[str, list[int]] = {}
        self._local_window: int | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    async def admit(self, api_key: str | None) -> None:
        """Count one request, before any work is done for it (tokenizing a large body costs
        more than refusing it): 429 past the request limit, or when the token budget is spent."""
        if not self.enabled:
            return
        counts = await self._add(api_key, 1, 0)
        if counts is None:
            return
        requests, used = counts
        if self.rpm and requests > self.rpm:
            raise self._limited(f"rate limit of {self.rpm} requests per minute reached")
        if self.tpm and used >= self.tpm:
            raise self._limited(f"rate limit of {self.tpm} tokens per minute reached")

    async def charge(self, api_key: str | None, tokens: int) -> None:
        """Count the request's tokens (prompt + max_tokens), once they are known."""
        if not self.tpm:
            return
        counts = await self._add(api_key, 0, tokens)
        if counts is not None and counts[1] > self.tpm:
            raise self._limited(f"rate limit of {self.tpm} tokens per minute reached")

    @staticmethod
    def _limited(message: str) -> APIError:
        now = time.time()
        return APIError(429, message, "rate_limit_exceeded",
                        headers={"Retry-After": str(max(1, int(60 - now % 60)))})

    async def _add(self, api_key: str | None, requests: int, tokens: int) -> tuple[int, int] | None:
        """Add to this minute's counts of `api_key`; (requests, tokens) after, or None when the
        limiter is unavailable (fail open: a limiter outage must not stop traffic)."""
        window = int(time.time() // 60)
        who = hashlib.sha256((api_key or "anonymous").encode()).hexdigest()[:16]
        key = f"{self.prefix}{who}:{window}"
        try:
            if self.redis is not None:
                pipe = self.redis.pipeline(transaction=True)
                pipe.hincrby(key, "requests", requests)
                pipe.hincrby(key, "tokens", tokens)
                pipe.expire(key, 61)
                counted, used, _ = await pipe.execute()
                return counted, used
            if window != self._local_window:  # only this minute's counts are kept
                self._local.clear()
                self._local_window = window
            counts = self._local.setdefault(key, [0, 0])
            counts[0] += requests
            counts[1] += tokens
            return counts[0], counts[1]
        except Exception as e:  # noqa: BLE001 - fail open
            log.warning("rate limiter unavailable (%s); admitting", e)
            return None
