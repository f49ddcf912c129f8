"""Per-client fairness: who a request is from (its API key, else its peer address) and how many
of one client's requests the router works on at once.

A client that loops cheap-to-refuse requests (grammar bombs, invalid `n > 1` requests) from
many connections otherwise takes the router's event loop from everyone: each of its requests is
parsed, validated and answered as fast as it comes. With `max_requests`, at most that many of a
client's requests are past the gate at a time; the rest wait (a waiting request costs nothing)
in a bounded line, and past it they are refused with 429. That bounds a client's share of the
router at any moment, not its rate: with `requests_per_s`, a client's requests beyond a burst
wait their turn at that rate (as nginx's `limit_req` with a burst: a request past twice the
burst is refused with 429), so one that loops refusals as fast as they come gets `requests_per_s`
of them, and the router's CPU goes to the others. Admission (router/admission.py) then shares
the workers between clients by the same identity."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import time
from collections import OrderedDict, deque
from contextlib import asynccontextmanager

from common.errors import APIError


def client_id(api_key: str | None, peer: str | None) -> str:
    """The identity fairness counts by: a digest of the API key (never the key itself, which
    would end up in memory dumps of this table), else the peer's address: an IPv4 address, or
    an IPv6 address's /64 (one host is given a whole /64, so each of its addresses is not a
    client of its own). The peer is the connection's address, or X-Forwarded-For's only from
    the proxies in `--forwarded-allow-ips` (tandem/commands.py); anything that is not an
    address counts as one client, `addr:invalid`."""
    if api_key:
        return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
    return f"addr:{client_address(peer)}"


def client_address(peer: str | None) -> str:
    """`peer` as fairness counts it: IPv4 as is, IPv6 as its /64 (IPv4-mapped ones as IPv4)."""
    if not peer:
        return "unknown"
    try:
        ip = ipaddress.ip_address(peer[:64])
    except ValueError:
        return "invalid"
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def cache_salt(api_key: str | None, requested: str | None, secret: str | None,
               per_key: bool = True) -> str | None:
    """The salt of a request's block chain (docs/contract.md "Cache isolation"): with an API key
    (and `per_key`), `key:` and 32 hex digits of sha256 over `secret` (the cluster's
    `--hash-salt`), the key and the request's own `cache_salt`, so two keys never share a block
    and the salt names neither; else the request's `cache_salt`, or None. Every router of a
    cluster computes the same salt for a key."""
    if not (api_key and per_key):
        return requested or None
    material = "\0".join((secret or "", api_key, requested or ""))
    return "key:" + hashlib.sha256(material.encode()).hexdigest()[:32]


def client_tag(client: str) -> str | None:
    """What workers are told of a client (common/protocol.py `client_tag`): a digest that
    tells clients apart without naming them (no address, no key); None for no client."""
    return hashlib.sha256(client.encode()).hexdigest()[:16] if client else None


MAX_PACED_CLIENTS = 100_000  # clients whose pacing is remembered at once


class ClientGate:
    """At most `max_requests` requests per client at once (None: no limit), at most
    `max_waiting` more waiting; FIFO within a client."""

    def __init__(self, max_requests: int | None, max_waiting: int = 64,
                 requests_per_s: float | None = None, burst: int = 20) -> None:
        self.max_requests = max_requests
        self.max_waiting = max_waiting
        self.requests_per_s = requests_per_s
        self.burst = burst
        # client -> when its next request is due at the rate, least recently paced first
        self._due: OrderedDict[str, float] = OrderedDict()
        self._active: dict[str, int] = {}  # client -> requests past the gate (entries removed at 0)
        self._waiting: dict[str, deque[asyncio.Future]] = {}

    @property
    def num_clients(self) -> int:
        return len(self._active)

    @asynccontextmanager
    async def enter(self, client: str):
        if self.requests_per_s:
            await self._pace(client)
        if self.max_requests is None:
            yield
            return
        await self._acquire(client)
        try:
            yield
        finally:
            self._release(client)

    async def _pace(self, client: str) -> None:
        """Wait until the client's request is due at `requests_per_s` (the first `burst` go at
        once); 429 when it would wait for more than another `burst` of them (GCRA)."""
        now = time.monotonic()
        interval = 1.0 / self.requests_per_s
        due = max(self._due.get(client, now), now)
        delay = due - now - self.burst * interval
        if delay > self.burst * interval:
            raise APIError(429, f"rate limit of {self.requests_per_s:g} requests per second for "
                           "this client reached", "rate_limit_exceeded",
                           headers={"Retry-After": str(max(1, round(delay)))})
        self._due[client] = due + interval
        self._due.move_to_end(client)
        self._forget(now)
        if delay > 0:
            await asyncio.sleep(delay)

    def _forget(self, now: float) -> None:
        """Drop clients whose every request is past due, least recently paced first: an entry
        is due at most (2 x burst + 1) intervals after it was last paced, so the table holds the
        clients paced within that horizon, each dropped once (amortised O(1) a request; it was
        rebuilt on every request once 100,000 clients were in their interval). Past
        `MAX_PACED_CLIENTS` the least recently paced go even if not yet due (they get a fresh
        burst: a client with that many identities has those anyway)."""
        due = self._due
        while due and (len(due) > MAX_PACED_CLIENTS or next(iter(due.values())) <= now):
            due.popitem(last=False)

    async def _acquire(self, client: str) -> None:
        if self._active.get(client, 0) < self.max_requests and not self._waiting.get(client):
            self._active[client] = self._active.get(client, 0) + 1
            return
        line = self._waiting.setdefault(client, deque())
        if len(line) >= self.max_waiting:
            raise APIError(429, f"too many concurrent requests from this client (at most "
                           f"{self.max_requests} at once, {self.max_waiting} waiting)",
                           "too_many_concurrent_requests", headers={"Retry-After": "1"})
        fut = asyncio.get_running_loop().create_future()
        line.append(fut)
        try:
            await fut  # the releaser passed its place to this waiter
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(client)  # got the place just as the client left: pass it on
            else:
                line.remove(fut)
                if not line:
                    del self._waiting[client]
            raise

    def _release(self, client: str) -> None:
        line = self._waiting.get(client)
        while line:
            fut = line.popleft()
            if not fut.done():
                if not line:
                    del self._waiting[client]
                fut.set_result(None)  # the place goes to the next waiter: `_active` unchanged
                return
        self._waiting.pop(client, None)
        self._active[client] -= 1
        if self._active[client] == 0:
            del self._active[client]
