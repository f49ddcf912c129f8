"""Runs one request's plan against the workers and yields its tokens: prefill leg, decode leg,
retries, fallbacks and mid-stream resume, so the client sees each token exactly once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import aiohttp

from common.protocol import (
    KVTransferParams,
    PrefillResponse,
    RequestTiming,
    SamplingOptions,
    StreamEvent,
    Tenant,
)
from router.backend import Backend, RequestRejected, TransferFailed, WorkerFailure
from router.handoff import HandedOff, check_handoff, take_over
from router.kv_full_retry import KVFullRetry, refused_for_kv
from router.leg_outcomes import check_vocab, learn_bandwidth, learn_prefill_rate
from router.local_prefill import queued_until_first, uncached_tokens
from router.peer_pull import export_prefix, leg_pull
from router.plan import Plan
from router.pull_metrics import PullMetrics
from router.trace import Trace
from router.worker_info import WorkerInfo
from router.workers import WorkerDirectory

log = logging.getLogger(__name__)


class Dispatcher:
    """Each hop goes through the worker's backend (router/backends.py); this class owns the
    request's life across legs and workers."""

    def __init__(self, backends: dict[str, Backend], directory: WorkerDirectory,
                 max_prefill_retries: int, retry_backoff_s: float, kv_full_waits: int = 3,
                 request_timeout_s: float = 300.0, export_timeout_s: float = 10.0,
                 pulls: PullMetrics | None = None, handoff_pulls: bool = True) -> None:
        self.backends = backends
        self.handoff_pulls = handoff_pulls  # a drained stream's blocks pulled, not recomputed
        self.pulls = pulls  # peer pulls' outcomes: learned per locality pair, counted
        self.directory = directory
        self.max_prefill_retries = max_prefill_retries
        self.retry_backoff_s = retry_backoff_s
        self.kv_full = KVFullRetry(directory.next_decoder, kv_full_waits, request_timeout_s)
        self._aborts: set[asyncio.Task] = set()
        self.export_timeout = aiohttp.ClientTimeout(total=export_timeout_s)  # peer pulls'

    def abort(self, w: WorkerInfo, request_id: str) -> None:
        """Tell `w` to drop `request_id` (a leg given up on), without waiting for it: in a task of
        its own, so the cancellation that gave the leg up (a client gone) neither cancels the
        abort nor waits on it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a generator finalized after its loop ended: nothing to send with
            return
        task = loop.create_task(self.backends[w.backend].abort(w, request_id),
                                name=f"abort-{request_id}")
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def run(self, plan: Plan, request_id: str, prompt: list[int], sampling: SamplingOptions,
                  trace: Trace, vocab_size: int | None = None, tenant: Tenant | None = None
                  ) -> AsyncIterator[StreamEvent]:
        """The request's tokens; every worker answer is checked against the model's
        `vocab_size` (an id at or past it fails that worker: retried or resumed elsewhere).
        `tenant` goes to each worker: its batch is shared fairly between clients, and the
        request's blocks are salted apart (docs/contract.md "Cache isolation")."""
        sent: list[int] = []
        kv_params = None
        decode = plan.decode
        lease_id = request_id  # what the prefill worker holds the prompt's blocks under
        prefilled_on: WorkerInfo | None = None
        prefix = await export_prefix(self.backends, plan, request_id, trace,  # a peer's, or None
                                     self.export_timeout)
        if plan.kind == "disagg":
            # The decode worker is taken from the moment of routing, not from when its stream
            # opens: a burst routed while every prefill is still running would otherwise see idle
            # decode workers and pile onto the first one.
            decode.inflight += 1
            try:
                got = await self._prefill_with_retries(plan, request_id, prompt, sampling, trace,
                                                       vocab_size, tenant, prefix)
            finally:
                decode.inflight -= 1
            if got is not None:
                pre, prefilled_on = got
                trace.record_cached(pre.num_cached_tokens, pre.num_cached_tokens_by_medium)
                trace.num_pulled_tokens = pre.num_pulled_tokens
                if self.pulls is not None:
                    self.pulls.leg(plan, prefilled_on, trace.model, pre.num_pulled_tokens,
                                   pre.pull_bytes, pre.pull_s, trace.export_s)
                kv_params = pre.kv_transfer_params
                first = pre.first_token_id
                if first is not None:  # Tandem: the client has its first token now
                    trace.first_token_at = time.perf_counter()
                    sent.append(first)
                    lp = pre.first_token_logprob
                    try:
                        yield StreamEvent(request_id=request_id, token_ids=[first],
                                          finish_reason=pre.finish_reason,
                                          num_cached_tokens=pre.num_cached_tokens,
                                          logprobs=[lp] if lp else None)
                    except BaseException:
                        # The client left before any decode worker had the handle: nobody will
                        # pull the blocks held for it. (Once a decode worker has it, it may be
                        # reading them: its pull, or the lease's end, frees them.)
                        if kv_params is not None and kv_params.do_remote_prefill:
                            self.abort(prefilled_on, request_id)
                        raise
                    if pre.finish_reason:
                        return
        tried: set[str] = set()
        handoff: dict = {}  # a drained worker's lease for the resume leg (router/handoff.py)
        while True:
            tried.add(decode.worker_id)
            trace.decode_worker = decode.worker_id
            num_sent = len(sent)
            try:
                # aclosing: a client that leaves closes the worker stream now, not at GC time.
                backend = self.backends[decode.backend]
                leg = backend.generate(decode, request_id, prompt, sent, sampling, kv_params,
                                       tenant, **(handoff or leg_pull(prefix, plan, decode, sent)))
                if kv_params is None:  # it prefills there: queued on it until its first token
                    leg = queued_until_first(
                        leg, decode, uncached_tokens(plan, decode, len(prompt) + len(sent)))
                async with aclosing(leg) as events:
                    async for ev in events:
                        check_vocab(decode, ev.token_ids, ev.logprobs, vocab_size)
                        check_handoff(decode, ev)
                        if trace.first_token_at is None and ev.token_ids:
                            trace.first_token_at = time.perf_counter()
                        room = sampling.max_tokens - len(sent)
                        if len(ev.token_ids) >= room and ev.finish_reason is None or \
                                len(ev.token_ids) > room:
                            # The router enforces max_tokens itself: a worker that streams on
                            # (400,000 tokens for max_tokens 8, once) is cut, not relayed.
                            ev = ev.model_copy(update={
                                "token_ids": ev.token_ids[:max(room, 0)], "finish_reason": "length",
                                "logprobs": ev.logprobs[:max(room, 0)] if ev.logprobs
                                            else ev.logprobs})
                        sent.extend(ev.token_ids)
                        if ev.finish_reason is not None:
                            trace.worker_timing = ev.timing or RequestTiming()
                            learn_bandwidth(decode, trace.worker_timing)
                            if self.pulls is not None and prefilled_on is not None:
                                self.pulls.transfer(prefilled_on, decode,
                                                    trace.worker_timing.transfer_bytes,
                                                    trace.worker_timing.transfer_s)
                            if trace.handoff_held_tokens and ev.num_cached_tokens is not None:
                                trace.handoff_cached_tokens = ev.num_cached_tokens
                                trace.handoff_pulled_tokens = trace.worker_timing.num_pulled_tokens
                            if trace.plan != "disagg" and ev.num_cached_tokens is not None:
                                trace.record_cached(ev.num_cached_tokens,
                                                    ev.num_cached_tokens_by_medium)
                                wt = trace.worker_timing
                                trace.num_pulled_tokens = wt.num_pulled_tokens
                                if self.pulls is not None and num_sent == 0:
                                    self.pulls.leg(plan, decode, trace.model,
                                                   wt.num_pulled_tokens, wt.pull_bytes,
                                                   wt.pull_s, trace.export_s)
                        yield ev
                        if ev.finish_reason is not None:
                            self.directory.record_success(decode)
                            return
                raise WorkerFailure(f"{decode.worker_id} ended the stream without a finish reason")
            except TransferFailed:
                # The decode worker's policy is to fail a request whose pull failed, not to
                # recompute it: no other decode worker recomputes it either. The prefill worker
                # it pulled from is the one that failed.
                if prefilled_on is not None:
                    self.directory.record_failure(prefilled_on)
                raise
            except HandedOff as h:  # drained: resumed elsewhere, pulling what it held
                handoff = {}
                nxt = self.directory.next_decoder(tried, trace.model)
                if nxt is None:
                    raise WorkerFailure(f"{h}; no other worker to resume on") from h
                trace.resumed += 1
                trace.handoff_held_tokens = len(h.block_hashes) * h.worker.block_size
                request_id = f"{lease_id}.h{trace.resumed}"
                if self.handoff_pulls:
                    handoff = await take_over(self.backends, h, nxt, request_id,
                                              self.export_timeout)
                decode, kv_params = nxt, None
            except WorkerFailure as e:
                handoff = {}  # a lease for the worker that failed is no use to the next
                if refused_for_kv(e) and len(sent) == num_sent:  # no fault of the worker's
                    try:
                        decode, tried = await self.kv_full.next_try(e, tried, trace)
                    except BaseException:  # given up, or the client left: the blocks go now
                        if prefilled_on is not None and kv_params is not None:
                            self.abort(prefilled_on, lease_id)
                        raise
                    request_id = f"{lease_id}.k{trace.kv_full_retries}"
                    continue
                self.directory.record_failure(decode)
                # Resume elsewhere with every token the client has: no token lost or repeated.
                nxt = self.directory.next_decoder(tried, trace.model)
                if nxt is None:
                    raise
                log.warning("decode on %s failed (%s); resuming on %s after %d tokens",
                            decode.worker_id, e, nxt.worker_id, len(sent),
                            extra={"request_id": request_id})
                trace.resumed += 1
                # A worker that refused the stream (draining, full) pulled nothing: the next one
                # can still pull the prefilled blocks. Otherwise it prefills prompt + tokens so far.
                refused = e.status in (429, 503) and len(sent) == num_sent
                decode, kv_params = nxt, (kv_params if refused else None)
                request_id = f"{request_id}.r{trace.resumed}"

    async def _prefill_with_retries(self, plan: Plan, request_id, prompt, sampling, trace: Trace,
                                    vocab_size: int | None, tenant: Tenant | None = None,
                                    prefix: KVTransferParams | None = None
                                    ) -> tuple[PrefillResponse, WorkerInfo] | None:
        """The first prefill answer and the worker that gave it; None: prefill locally. A leg
        given up on (timed out, a bad answer, the client gone) is aborted on its worker."""
        tried: set[str] = set()
        p = plan.prefill
        for attempt in range(self.max_prefill_retries + 1):
            tried.add(p.worker_id)
            trace.prefill_worker = p.worker_id
            t0 = time.monotonic()
            # The plan's cached blocks are its own worker's; another computes the whole prompt.
            cached = plan.cached_blocks * p.block_size if p is plan.prefill else 0
            uncached = max(len(prompt) - cached, 0)
            # Its time limit grows with what the worker computes before answering it.
            to_compute = uncached + p.queued_tokens()
            p.inflight += 1
            p.inflight_tokens += uncached
            failure: WorkerFailure | None = None
            try:
                resp = await self.backends[p.backend].prefill(p, request_id, prompt, sampling,
                                                              tenant, num_uncached=to_compute,
                                                              **leg_pull(prefix, plan, p))
                check_vocab(p, [] if resp.first_token_id is None else [resp.first_token_id],
                            [resp.first_token_logprob] if resp.first_token_logprob else None,
                            vocab_size)
            except RequestRejected:
                raise  # the worker refused it: nothing runs there
            except WorkerFailure as e:
                failure = e
            except BaseException:
                self.abort(p, request_id)  # cancelled: the client left; it runs for nobody now
                raise
            finally:
                p.inflight -= 1
                p.inflight_tokens -= uncached
            if failure is None:
                elapsed = time.monotonic() - t0
                trace.prefill_s = elapsed
                learn_prefill_rate(p, len(prompt) - resp.num_cached_tokens
                                   - resp.num_pulled_tokens, elapsed)
                self.directory.record_success(p)
                return resp, p
            if failure.status is None:
                # No answer in time, or one refused here: the worker may still be computing it,
                # or hold its blocks for a decode leg that will never come.
                self.abort(p, request_id)
            self.directory.record_failure(p)
            trace.retries += 1
            others = [w for w in self.directory.live("prefill", trace.model or None)
                      if w.worker_id not in tried]
            if not others or attempt == self.max_prefill_retries:
                log.warning("prefill failed on %s (%s); decode worker prefills locally",
                            p.worker_id, failure, extra={"request_id": request_id})
                trace.fallback = "decode_local"
                return None
            p = min(others, key=lambda w: (w.inflight, w.queued_tokens()))
            await asyncio.sleep(self.retry_backoff_s * (2 ** attempt))
        return None
