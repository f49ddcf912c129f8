"""Everything one worker process holds, built in the app's lifespan and torn down with it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from common.background import BackgroundErrors
from common.publisher import WorkerPublisher
from common.registry import RedisKeys
from engine.async_engine import AsyncEngine
from engine.core_client import CoreView, ProcessEngine
from engine.engine_client import EngineClient
from engine.llm_engine import LLMEngine
from kv_transfer import handle
from kv_transfer.connector import KVConnector
from kv_transfer.layout import KVLayout
from kv_transfer.metrics import TransferMetrics
from kv_transfer.transport import TransportConfig
from kv_transfer.transports import default_transport_name
from worker.errors import APIError
from worker.handoff import Handoff
from worker.metrics import WorkerMetrics
from worker.role import RoleParts
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    settings: WorkerSettings
    registry: CollectorRegistry
    metrics: WorkerMetrics
    parts: RoleParts[WorkerState] = field(default_factory=RoleParts)  # what the role packages add
    engine: EngineClient | None = None
    connector: KVConnector | None = None
    publisher: WorkerPublisher | None = None
    ready: bool = False
    draining: bool = False  # SIGTERM/SIGINT: new work is refused (see drain)
    num_prefill_inflight: int = 0
    num_streams: int = 0  # generations in flight (internal /generate and the OpenAI endpoints)
    # Prefills in flight by request id, which /abort cancels (worker/abortable.py).
    abortable: dict[str, asyncio.Task] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    # Set when the engine thread died: the process should exit with it (see on_engine_death).
    exit_code: int | None = None
    # What the edge (the CLI) gives to stop the server: called once after an engine failure.
    request_shutdown: Callable[[], None] | None = None
    errors: BackgroundErrors | None = None  # built in __post_init__ on the worker's registry
    # Peer prefix handles this worker pulled with, refused if presented again (a replay).
    spent_prefix_handles: handle.SpentHandles = field(default_factory=handle.SpentHandles)
    # The /generate streams a drain hands to other workers (worker/handoff.py).
    handoff: Handoff = field(default_factory=Handoff)

    def __post_init__(self) -> None:
        if self.errors is None:
            self.errors = BackgroundErrors(self.registry)

    @property
    def core(self) -> LLMEngine | CoreView:
        """What the API reads of the engine (model id, tokenizer, hasher, KV cache, sizes)."""
        return self.engine.core

    async def start(self) -> None:
        s = self.settings
        config = s.engine_config()
        if s.engine_process and not s.use_engine_process:
            log.info("engine on a thread: the engine-core process needs the CPU device")
        if s.use_engine_process:
            self.engine = ProcessEngine(config, on_events=self._on_events,
                                        on_death=self.on_engine_death,
                                        log_level=logging.getLogger().getEffectiveLevel())
        else:
            llm = await asyncio.to_thread(LLMEngine, config)
            self.engine = AsyncEngine(llm, on_events=self._on_events, on_death=self.on_engine_death)
        await self.engine.start()
        core = self.core
        # Every role has one: a colocated worker, too, is a peer prefix source or puller.
        transport = s.transport or default_transport_name()
        tconfig = TransportConfig(engine_id=s.resolved_worker_id, token=s.internal_token,
                                  listen_host=s.host, advertise_host=s.advertise_host,
                                  port=s.transport_port, pull_timeout_s=s.pull_timeout_s,
                                  handshake_timeout_s=s.handshake_timeout_s)
        self.connector = KVConnector(
            core.kv_cache, KVLayout.of_cache(core.kv_cache, core.model_digest),
            tconfig, transport, release=lambda rid: self.engine.post("release", rid),
            lease_seconds=s.lease_seconds, metrics=TransferMetrics(self.registry),
            errors=self.errors, handshake_timeout_s=s.handshake_timeout_s,
            max_lease_seconds=s.max_lease_seconds,
        )
        await self.connector.start()
        log.info("kv transfer: %s (%s)", transport, self.connector.transport.label)
        if s.redis_url:
            self.publisher = WorkerPublisher(
                s.redis_url, RedisKeys(s.namespace), s.resolved_worker_id, self.registration_info(),
                snapshot=self._snapshot, load=self.load, ttl_s=s.heartbeat_ttl_s,
                errors=self.errors, token=s.internal_token, cluster=s.redis_cluster)
            self.publisher.start()
        self.ready = True

    def admit(self) -> None:
        """Raise the 503 a new request gets while this worker drains: the router retries the
        prefill elsewhere or resumes the stream on another decode worker."""
        if self.draining:
            raise APIError(503, "this worker is shutting down", "draining",
                           headers={"Retry-After": "1"})

    def admit_export(self) -> None:
        """A prefix export is refused while draining, except in a hand-off: the streams handed
        off are resumed elsewhere by pulling their blocks from here."""
        if not self.handoff.active:
            self.admit()

    def busy(self) -> bool:
        """Work that a drain waits for: prefills and streams in flight, blocks leased to a pull."""
        leased = self.connector.leases.num_leased_blocks if self.connector is not None else 0
        return bool(self.num_prefill_inflight or self.num_streams or leased)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking work, leave Redis at once (the router stops routing here within one
        refresh), then let what runs finish, for at most `timeout_s`. What is still running
        after that is cut when the server stops, and the router resumes it elsewhere. With
        `--drain-handoff`, the streams are handed off at once instead (worker/handoff.py), and
        the drain lasts until their blocks have been pulled."""
        if self.draining:
            return
        self.draining, self.ready = True, False
        log.info("draining: deregistering; %d prefills and %d streams in flight",
                 self.num_prefill_inflight, self.num_streams)
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            await publisher.close(deregister=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.settings.drain_handoff and self.engine is not None:
            num = self.handoff.begin(self.engine.end_stream)
            log.info("draining: %d streams handed off; their blocks stay here to be pulled", num)
        while (self.busy() or self.handoff.waiting()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.busy():
            log.warning("drain timeout (%.1f s): %d prefills and %d streams cut; "
                        "the router resumes them elsewhere", timeout_s, self.num_prefill_inflight,
                        self.num_streams)
        else:
            log.info("drained")

    def on_engine_death(self, error: BaseException) -> None:
        """The engine thread died (its requests have been failed already). A worker without an
        engine must not look alive: not ready at once, its Redis registration and block set
        deleted now (the router stops routing here within one refresh), and the process exits
        non-zero so its supervisor (`tandem up`, Kubernetes, compose) starts a fresh one."""
        log.critical("engine failed (%s: %s): deregistering and exiting",
                     type(error).__name__, error)
        self.ready = False
        self.exit_code = 1

        async def leave() -> None:
            if self.publisher is not None:
                await self.publisher.close(deregister=True)
                self.publisher = None
            if self.request_shutdown is not None:
                self.request_shutdown()

        self._leaving = asyncio.get_running_loop().create_task(leave(), name="engine-death")

    async def stop(self) -> None:
        self.ready = False
        leaving = getattr(self, "_leaving", None)
        if leaving is not None:
            await asyncio.gather(leaving, return_exceptions=True)
        if self.publisher is not None:
            await self.publisher.close()
        if self.connector is not None:
            await self.connector.close()
        if self.engine is not None:
            await self.engine.stop()

    def _on_events(self, events) -> None:
        if self.publisher is not None:
            self.publisher.on_events(events)

    async def _snapshot(self) -> dict[str, list[int]]:
        return await self.engine.call("cached_hashes_by_medium")

    @property
    def served_names(self) -> list[str]:
        return self.settings.served_names

    def model_info(self) -> dict:
        """Which model this worker serves, as registered and as `/ready` tells a static router."""
        core = self.core
        return {"model": self.served_names[0], "served_model_names": self.served_names,
                "model_digest": core.model_digest, "tokenizer_path": str(core.folder),
                "block_size": core.block_size, "hash_seed": core.hasher.seed,
                "max_model_len": core.max_model_len,
                # The model's own (config.json), which may exceed the tokenizer's: routers
                # refuse a token id at or past it as a lying worker's.
                "vocab_size": getattr(core, "vocab_size", None) or core.model_config.vocab_size}

    def registration_info(self) -> dict:
        s, core = self.settings, self.core
        return {
            **self.model_info(), "role": s.role, "url": s.url, "backend": "tandem",
            "capacity": core.num_blocks, "engine_id": s.resolved_worker_id,
            "transport": self.connector.transport.name if self.connector else "",
            "max_model_len": core.max_model_len, "started_at": self.started_at,
            "locality": s.locality,
            # What one block costs to move: the router's kv_aware charges transfers with it.
            "block_bytes": KVLayout.of_cache(core.kv_cache, core.model_digest).bytes_per_block,
        }

    def load(self) -> dict:
        """What the registration's `load` carries: the engine's figures but its tier counters
        (those are metrics); with tiers, `reload_tokens_per_s` by tier (None: not measured)."""
        stats = self.engine.stats()
        stats.pop("kv_tiers", None)
        return {**stats, "prefill_inflight": self.num_prefill_inflight}
