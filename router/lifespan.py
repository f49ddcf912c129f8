"""A router's run, the app's lifespan (router/app.py): the HTTP session and the backends over it,
Redis, the gateway's collaborators that need them (dispatcher, prefix index, rate limiter) where
it was not given its own, the workers probed, and the background refreshes; on the way out the
refreshes stop before Redis and the session close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp

from common.redis_client import connect
from router.backend import Timeouts
from router.backends import BACKENDS
from router.dispatch import Dispatcher
from router.gateway import Gateway
from router.index import INDEXES
from router.limits import RateLimiter

log = logging.getLogger(__name__)


@asynccontextmanager
async def running(gw: Gateway) -> AsyncIterator[Gateway]:
    """Open the HTTP session and Redis, probe the workers, run the background refreshes."""
    s, directory = gw.settings, gw.directory
    async with AsyncExitStack() as stack:
        http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=s.request_timeout_s, connect=2.0),
            connector=aiohttp.TCPConnector(limit=1000, limit_per_host=0, keepalive_timeout=60),
            auto_decompress=False, read_bufsize=1 << 20)  # one NDJSON event must fit a line
        stack.push_async_callback(http.close)
        stack.callback(gw.prompts.close)
        tokens = {"tandem": s.internal_token, "vllm": s.vllm_api_key}
        timeouts = Timeouts(s.prefill_timeout_s, s.stream_stall_timeout_s, s.request_timeout_s,
                            s.prefill_timeout_min_tokens_per_s)
        backends = {name: cls(http, tokens[name], s.model or "", timeouts)
                    for name, cls in BACKENDS.items()}
        backends["vllm"].report_full_prefix = s.vllm_report_full_prefix
        if gw.dispatcher is None:
            gw.dispatcher = Dispatcher(backends, directory, s.max_prefill_retries,
                                       s.retry_backoff_s, s.kv_full_waits, s.request_timeout_s,
                                       s.peer_pull_export_timeout_s, gw.pulls, s.peer_pulls)

        def probe(w):
            return backends[w.backend].probe(w)

        await directory.probe_all(probe)
        # Every worker is health-checked, Redis-discovered ones too (a heartbeat is not
        # readiness).
        tasks = [asyncio.create_task(directory.run_probes(probe, s.probe_interval_s))]
        try:
            redis = None
            if s.redis_url:
                redis = connect(s.redis_url, s.redis_cluster)
                stack.push_async_callback(redis.aclose)
                if gw.index is None:
                    gw.index = INDEXES[s.index](redis, gw.keys, s.index_search,
                                                s.redis_cluster, directory.errors)
                directory.index = gw.index  # told of the live workers on every refresh
                await directory.refresh(redis)
                tasks.append(asyncio.create_task(directory.run(redis, s.refresh_interval_s)))
                tasks.append(asyncio.create_task(gw.index.run(s.index_poll_interval_s)))
            else:
                log.warning("no Redis configured: in-process prefix index (learns from routing "
                            "only)")
            if gw.limiter is None:
                gw.limiter = RateLimiter(redis, gw.keys, s.rate_limit_rpm, s.rate_limit_tpm)
            yield gw
        finally:  # the background tasks stop before Redis and the HTTP session close
            await _cancel_all(tasks)
            await directory.leave(redis)


async def _cancel_all(tasks: list[asyncio.Task], timeout_s: float = 5.0) -> None:
    """Cancel the background loops and wait for them, a bounded time: each also checks
    `cancelling()` (a client library can swallow a cancellation), and a shutdown that waited
    forever kept a router whose bind failed alive."""
    for t in tasks:
        t.cancel()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            log.warning("background task %s did not stop within %.0f s", t.get_name(), timeout_s)
