"""API keys (401) and per-key request / token rate limits (429 + Retry-After).

Limits are fixed one-minute windows kept in Redis (`tandem:{ns}:rl:{key}:{minute}`), so every
router replica in a namespace shares them; without Redis each replica counts for itself. If
Redis fails mid-flight the request is let through (fail open) rather than refused.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from pathlib import Path

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
        token = authorization[7:] if authorization and authorization.startswith("Bearer ") else ""
        for key in self.keys:
            if hmac.compare_digest(token, key):
                return key
        raise APIError(401, "invalid or missing API key", "invalid_api_key")


class RateLimiter:
    def __init__(self, redis, keys: RedisKeys, rpm: int | None, tpm: int | None) -> None:
        self.redis = redis
        self.prefix = keys.prefix + "rl:"
        self.rpm, self.tpm = rpm, tpm
        self._local: dict[str, list[int]] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    async def admit(self, api_key: str | None, tokens: int) -> None:
        if not self.enabled:
            return
        now = time.time()
        window = int(now // 60)
        retry_after = str(max(1, int(60 - now % 60)))
        who = hashlib.sha256((api_key or "anonymous").encode()).hexdigest()[:16]
        key = f"{self.prefix}{who}:{window}"
        try:
            if self.redis is not None:
                pipe = self.redis.pipeline(transaction=True)
                pipe.hincrby(key, "requests", 1)
                pipe.hincrby(key, "tokens", tokens)
                pipe.expire(key, 61)
                requests, used, _ = await pipe.execute()
            else:
                counts = self._local.setdefault(key, [0, 0])
                counts[0] += 1
                counts[1] += tokens
                requests, used = counts
        except Exception as e:  # noqa: BLE001 - fail open: a limiter outage must not stop traffic
            log.warning("rate limiter unavailable (%s); admitting", e)
            return
        if self.rpm and requests > self.rpm:
            raise APIError(429, f"rate limit of {self.rpm} requests per minute reached",
                           "rate_limit_exceeded", headers={"Retry-After": retry_after})
        if self.tpm and used > self.tpm:
            raise APIError(429, f"rate limit of {self.tpm} tokens per minute reached",
                           "rate_limit_exceeded", headers={"Retry-After": retry_after})
