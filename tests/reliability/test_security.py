"""Security sweep over real processes: every endpoint in each service's OpenAPI schema (so a new
endpoint is covered the day it is added) refuses a request without a valid credential, except the
probes and /metrics; the router's client keys and the internal token are separate secrets."""

from __future__ import annotations

import uuid

import httpx
import pytest

from testing.cluster import TOKEN, Router, Worker

pytestmark = pytest.mark.redis

OPEN = {"/health", "/ready", "/metrics", "/openapi.json", "/docs",
        "/docs/oauth2-redirect", "/redoc"}


def operations(base: str) -> list[tuple[str, str]]:
    spec = httpx.get(f"{base}/openapi.json", timeout=10).json()
    ops = []
    for path, methods in spec["paths"].items():
        for method in methods:
            ops.append((method.upper(), path.replace("{request_id}", "some-id")))
    return ops


def call(base: str, method: str, path: str, headers: dict) -> int:
    return httpx.request(method, f"{base}{path}", json={}, headers=headers, timeout=10).status_code


@pytest.fixture(scope="module")
def services(tiny_folder, tmp_path_factory):
    work = tmp_path_factory.mktemp("security")
    ns = f"sec-{uuid.uuid4().hex[:6]}"
    p = Worker("prefill", str(tiny_folder), cache_dir=work, namespace=ns)
    d = Worker("decode", str(tiny_folder), cache_dir=work, namespace=ns)
    r = Router(tiny_folder, ns, cache_dir=work, extra=["--api-key", "client-key"])
    r.wait_workers(2)
    yield r, p, d
    r.close()
    p.close()
    d.close()


def test_every_worker_endpoint_needs_the_internal_token(services):
    _, p, d = services
    for w in (p, d):
        ops = [(m, path) for m, path in operations(w.url) if path not in OPEN]
        leg = "/prefill" if w.role == "prefill" else "/generate"
        assert ({leg, "/abort/some-id", "/v1/chat/completions", "/kv/metadata"}
                <= {path for _, path in ops})
        for method, path in ops:
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": "Bearer client-key"}):
                assert call(w.url, method, path, headers) == 401, (w.role, method, path, headers)
        # ... and the right token gets past authentication (some other answer than 401).
        assert call(w.url, "GET", "/kv/metadata", {"Authorization": f"Bearer {TOKEN}"}) == 200


def test_every_router_endpoint_needs_a_client_key(services):
    r, _, _ = services
    ops = [(m, path) for m, path in operations(r.url) if path not in OPEN]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= {path for _, path in ops}
    for method, path in ops:
        # The internal token is not a client key.
        for headers in ({}, {"Authorization": "Bearer wrong"},
                        {"Authorization": f"Bearer {TOKEN}"}):
            status = call(r.url, method, path, headers)
            assert status == 401, (method, path, headers, status)
    ok = httpx.post(f"{r.url}/v1/completions", headers={"Authorization": "Bearer client-key"},
                    json={"model": "tiny-random", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{r.url}{path}", timeout=10).status_code == 200
