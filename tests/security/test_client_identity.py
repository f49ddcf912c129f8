"""Who a client is (router/clients.py): a client cannot pick its own identity with
X-Forwarded-For, which only the proxies an operator lists (`--forwarded-allow-ips`) may set, and
the addresses of one IPv6 /64 are one client. Real routers with no workers: a request the
per-client pacing lets through ends in a 503 (no worker), one it refuses in a 429."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from testing.cluster import Router
from tests.polling import wait_for

MODEL = "tiny-random"
# One request due every 2 s with a burst of one: of a concurrent burst from one client, two go
# at once, one waits its turn, the rest are refused.
PACING = ["--client-requests-per-s", "0.5", "--client-burst", "1"]


def _router(folder, tmp_path, extra: list[str]) -> Router:
    r = Router(folder, None, cache_dir=tmp_path, redis_url=None, extra=[
        "--worker", "decode=http://127.0.0.1:1", *PACING, *extra])
    wait_for(lambda: _healthy(r), timeout=60, what="the router to answer /health")
    return r


def _healthy(r: Router) -> bool:
    try:
        return r.client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def _statuses(r: Router, forwarded: list[str]) -> list[int]:
    """Each request sent at once, from loopback, with its own X-Forwarded-For."""
    def send(xff: str) -> int:
        with httpx.Client(base_url=r.url, timeout=30) as c:
            return c.post("/v1/completions", headers={"X-Forwarded-For": xff},
                          json={"model": MODEL, "prompt": "hello", "max_tokens": 1}).status_code

    with ThreadPoolExecutor(len(forwarded)) as pool:
        return list(pool.map(send, forwarded))


@pytest.fixture(scope="module")
def plain(tiny_folder, tmp_path_factory):
    r = _router(tiny_folder, tmp_path_factory.mktemp("identity"), [])
    yield r
    r.close()


@pytest.fixture(scope="module")
def proxied(tiny_folder, tmp_path_factory):
    r = _router(tiny_folder, tmp_path_factory.mktemp("identity"),
                ["--forwarded-allow-ips", "127.0.0.1"])
    yield r
    r.close()


def test_a_client_cannot_pick_its_identity_with_x_forwarded_for(plain):
    statuses = _statuses(plain, [f"10.9.{i}.{i}" for i in range(10)])
    # One client (loopback), whatever the header says: most of the burst is refused. Before,
    # uvicorn trusted loopback's header and every request was a client of its own: no 429.
    assert statuses.count(429) >= 7, statuses
    assert set(statuses) <= {429, 503}, statuses


def test_a_listed_proxy_names_its_clients_and_an_ipv6_64_is_one_client(proxied):
    distinct = _statuses(proxied, [f"10.8.{i}.{i}" for i in range(6)])
    assert distinct.count(429) == 0, distinct  # the proxy's clients are told apart
    same_64 = _statuses(proxied, [f"2001:db8:0:1::{i:x}" for i in range(1, 11)])
    assert same_64.count(429) >= 7, same_64  # one host's /64 is one client
    other_64s = _statuses(proxied, [f"2001:db8:0:{i + 2:x}::1" for i in range(6)])
    assert other_64s.count(429) == 0, other_64s
    # What is not an address is one client, never a fresh one per text.
    junk = _statuses(proxied, [f"client-{i}" for i in range(10)])
    assert junk.count(429) >= 7, junk
