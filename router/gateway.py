"""The router's request path (docs/contract.md "Request path", steps 1-3 and 7): validate and
tokenize a request, hash its blocks, one index round trip for every live worker's leading match, a
plan from the policy (`plan_for`, pure: the simulator calls it too), the plan run by the dispatcher.
Response shaping (JSON, SSE) is in router/responses.py; app.py only wires HTTP to this."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from prometheus_client import CollectorRegistry

from common.background import BackgroundErrors
from common.errors import OUT_OF_KV_BLOCKS, APIError
from common.protocol import SamplingOptions, StreamEvent, Tenant
from common.registry import RedisKeys
from common.tool_calls import PARSERS
from router.admission import Admission
from router.backend import KVCacheFull, RequestRejected, TransferFailed, WorkerFailure
from router.choices import Choices
from router.clients import ClientGate
from router.dispatch import Dispatcher
from router.eviction_cost import note_placement
from router.fabric import Fabric
from router.index import PrefixIndex
from router.limits import KeyAuth, RateLimiter, load_keys
from router.metrics import RouterMetrics
from router.models import ModelCatalog, ServedModel
from router.open_streams import OpenStreams
from router.plan import NoWorkers, Plan, Policy
from router.policy import make_policy, plan_for
from router.prefix_lookup import IndexUnavailable, PrefixLookup
from router.prompts import Prompts
from router.pull_metrics import PullMetrics
from router.settings import RouterSettings
from router.speculative import SpeculativeIndex
from router.trace import Trace
from router.workers import WorkerDirectory

log = logging.getLogger(__name__)

class Gateway:
    """One router's collaborators, given explicitly: the model catalog (a tokenizer and block
    hasher per served model), worker directory, routing policy, prefix index, dispatcher,
    admission, key auth, rate limiter and metrics. The index, limiter and dispatcher need Redis
    and an HTTP session: router/lifespan.py opens them (the app's lifespan) unless they were
    given."""

    def __init__(self, settings: RouterSettings, *, catalog: ModelCatalog,
                 directory: WorkerDirectory, policy: Policy, metrics: RouterMetrics,
                 registry: CollectorRegistry, admission: Admission, auth: KeyAuth,
                 index: PrefixIndex | None = None, limiter: RateLimiter | None = None,
                 dispatcher: Dispatcher | None = None, clients: ClientGate | None = None) -> None:
        self.settings = settings
        self.catalog = catalog
        self.directory = directory
        self.policy = policy
        self.metrics = metrics
        self.registry = registry
        # Peer pulls' costs per locality pair: learned from each pull here, priced by kv_aware
        # (a policy that prices no pulls has no fabric of its own: they are only counted).
        self.pulls = PullMetrics(registry, getattr(policy, "fabric", None)
                                 or Fabric.from_settings(settings))
        self.admission = admission
        self.clients = clients or ClientGate(None)
        self.auth = auth
        self.index = index  # Redis's; without Redis each model's in-process index
        self.limiter = limiter
        self.dispatcher = dispatcher
        self.keys = RedisKeys(settings.namespace)
        self.draining = False
        self.open_streams = OpenStreams()  # what a drain that runs out ends with an error event
        self.choices = Choices(settings.max_tokens_default)  # every choice's options, checked
        # Bridged vLLM workers report a prompt's blocks only after its prefill step: until then
        # this router's own recent decisions stand in (router/speculative.py).
        self.recent = SpeculativeIndex(settings.speculative_ttl_s)
        self.prompts = Prompts(settings.offload_chars)

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> Gateway:
        registry = CollectorRegistry()
        errors = BackgroundErrors(registry)
        if settings.tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {settings.tool_call_parser!r}; choose from "
                             f"{', '.join(PARSERS)}")
        template = settings.chat_template.read_text() if settings.chat_template else None
        catalog = ModelCatalog(only=settings.model, tokenizer_path=settings.tokenizer_path,
                               model_dir=settings.model_folder_root, hash_salt=settings.hash_salt,
                               registry=registry, chat_template=template)
        catalog.preload()
        directory = WorkerDirectory(RedisKeys(settings.namespace), settings.workers,
                                    settings.breaker_failures, settings.breaker_cooldown_s,
                                    settings.redis_restart_grace_s, errors, settings.internal_token,
                                    catalog=catalog, static_model=settings.model,
                                    block_size=settings.block_size)
        return cls(settings, catalog=catalog, directory=directory,
                   policy=make_policy(settings.policy, settings),
                   metrics=RouterMetrics(registry), registry=registry,
                   admission=Admission(settings.max_running, settings.max_queued,
                                       settings.client_max_running),
                   clients=ClientGate(settings.client_max_requests, settings.client_max_waiting,
                                      settings.client_requests_per_s, settings.client_burst),
                   auth=KeyAuth(load_keys(settings.api_keys, settings.api_keys_file)))

    # ---- lifecycle (the run itself, from the app's lifespan: router/lifespan.py) ---------------

    async def drain(self) -> None:
        """SIGTERM/SIGINT: not ready from now on (a load balancer stops sending); uvicorn stops
        listening and lets in-flight requests finish (tandem/server.py). A stream still open
        after `drain_timeout_s` ends with an error event and `[DONE]` (uvicorn's own deadline,
        a little later, would close it with neither)."""
        self.draining = True
        asyncio.get_running_loop().call_later(self.settings.drain_timeout_s,
                                              self.open_streams.end_all)

    # ---- one request ---------------------------------------------------------------------------

    async def route(self, model: ServedModel, prompt: list[int], cache_salt: str | None = None
                    ) -> Plan:
        t0 = time.perf_counter()
        live = self.directory.live(model=model.name)
        lookup = PrefixLookup(model, live, self.index or model.memory_index, self.recent,
                              cache_salt)
        try:
            matches = await lookup.match(prompt)
            # The replica answers from memory even while Redis is away (a stale copy costs
            # misses only): the gauge says whether Redis itself answers, as the directory sees.
            self.metrics.redis_up.set(0 if self.directory.redis_ok is False else 1)
        except IndexUnavailable as e:
            matches = e.matches
            if e.redis_down:
                log.warning("prefix index unavailable (%s): load-only routing", e.__cause__)
                self.metrics.redis_up.set(0)
            else:  # a bug, or an answer it could not read: counted and logged, not Redis down
                self.directory.errors.record("prefix_lookup", e.__cause__,
                                             key=f"prefix_lookup:{type(e.__cause__).__name__}")
                self.metrics.redis_up.set(0 if self.directory.redis_ok is False else 1)
        try:
            plan = plan_for(self.policy, len(prompt), matches, live,
                            len(lookup.chains.get(model.block_size, ())), model.block_size,
                            lookup.media)
        except NoWorkers as e:
            raise APIError(503, f"{e} for model {model.name!r}", "no_workers",
                           headers={"Retry-After": "1"}) from e
        if plan.kv_source is not None:  # the holder is asked for these (router/peer_pull.py)
            plan.pull_hashes = lookup.chains[plan.kv_source.block_size][:plan.pull_blocks]
        lookup.record(plan, self.directory.workers)
        # Its workers' headroom reports lag: count the blocks sent there now (eviction_cost.py).
        note_placement(plan, len(prompt), matches, self.settings.placement_memory_s)
        self.metrics.route.labels(plan.kind, model.name).inc()
        self.metrics.count_cached(plan, model.name)
        self.metrics.overhead.labels(model.name).observe(time.perf_counter() - t0)
        return plan

    def model_for(self, body) -> ServedModel:
        """The served model a request names: 404 for a name no worker serves (or this router
        is not serving), with the names it does serve."""
        model = self.catalog.get(body.model)
        if model is None:
            served = self.catalog.served(self.directory.workers.values())
            raise APIError(404, f"model {body.model!r} does not exist; this router serves "
                           f"{', '.join(map(repr, served)) or 'no model yet'}",
                           "model_not_found", "model")
        return model

    async def prompt_ids(self, model: ServedModel, body, body_bytes: int = 0) -> list[int]:
        """The request's prompt ids within the model's context (router/prompts.py)."""
        limit = self.directory.max_model_len(self.settings.max_model_len_default, model.name)
        return await self.prompts.token_ids(model.tokenizer, body, limit, body_bytes)

    async def run_one(self, body, model: ServedModel, prompt: list[int], opts: SamplingOptions,
                      rid: str, client_rid: str | None, tenant: Tenant | None = None
                      ) -> AsyncIterator[tuple[StreamEvent, Trace]]:
        """One choice's events as they come, each with the request's trace; `tenant`
        (router/clients.py) tells workers who sent it and salts its blocks."""
        plan = await self.route(model, prompt, tenant.cache_salt if tenant else None)
        trace = Trace(plan.kind, client_request_id=client_rid, model=model.name)
        try:
            async with aclosing(self.dispatcher.run(plan, rid, prompt, opts, trace,
                                                    model.vocab_size, tenant)) as events:
                async for ev in events:
                    if ev.finish_reason == "error":
                        # The grammar engine gave up on the constraint (engine/stop.py): the
                        # output would break it, so it is not answered as `stop`.
                        param = body.constraint_field() or "tool_choice"
                        raise APIError(400, f"{param}: the output constraint failed in the "
                                       "grammar engine", "structured_output_failed", param)
                    yield ev, trace
        except RequestRejected as e:
            log_failure(rid, trace, f"refused by a worker (HTTP {e.status}): {e}")
            raise APIError(e.status, str(e), "rejected_by_worker") from e
        except TransferFailed as e:
            log_failure(rid, trace, str(e))
            raise APIError(503, "the prompt's KV cache was lost in transfer from the prefill "
                           "worker, and this cluster does not recompute it; retry the request",
                           "kv_transfer_failed", headers={"Retry-After": "1"}) from e
        except KVCacheFull as e:
            log_failure(rid, trace, str(e))
            raise APIError(503, "every decode worker's KV cache is full; retry the request",
                           OUT_OF_KV_BLOCKS, headers={"Retry-After": "1"}) from e
        except WorkerFailure as e:
            # What failed where goes to the log; the client learns only that it failed (worker
            # ids carry addresses, exception reprs carry internals).
            log_failure(rid, trace, str(e))
            raise APIError(503, "no worker could serve the request", "worker_failure",
                           headers={"Retry-After": "1"}) from e

    def observe_trace(self, trace: Trace | None) -> None:
        if trace is None:
            return
        m, model = self.metrics, trace.model
        pool = "prefill" if trace.plan == "disagg" else "decode"
        m.hit_tokens.labels(pool, model).inc(trace.num_cached_tokens)
        if trace.prefill_s:
            m.prefill.labels(model).observe(trace.prefill_s)
        if trace.retries:
            m.retries.labels("prefill", model).inc(trace.retries)
        if trace.resumed:
            m.retries.labels("resume", model).inc(trace.resumed)
        if trace.kv_full_retries:
            m.retries.labels("kv_full", model).inc(trace.kv_full_retries)


def log_failure(request_id: str, trace: Trace, cause: str) -> None:
    """The one log line of a failed request: its id, plan, workers and cause."""
    log.warning("request %s failed: plan %s, prefill %s, decode %s, resumed %d: %s", request_id,
                trace.plan, trace.prefill_worker, trace.decode_worker, trace.resumed, cause,
                extra={"request_id": request_id})
