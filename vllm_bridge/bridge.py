"""`tandem vllm-bridge`: one stock vLLM server, registered in Tandem's Redis as a worker with
`backend: vllm` (routers send it requests through router/vllm_backend.py) and its KV cache
mirrored there as Tandem block hashes, so routers index it exactly, as they do Tandem workers.

One bridge runs beside each vLLM server (same pod or host): ZMQ has no authentication, so the
event sockets stay on loopback or ipc://, and one process writes each server's block set however
many routers read it (routers subscribing themselves would make N x M subscriptions and N
writers per set).

While the server is healthy the bridge holds a session: a BlockChain (vllm_bridge/chain.py) fed
by an EventSubscriber (vllm_bridge/subscriber.py) through an EventMirror (vllm_bridge/mirror.py,
which decodes and hashes on a thread of its own, off this loop of probes and heartbeats),
published through common/publisher.py's WorkerPublisher. A reset from the subscriber (vLLM
restarted, history lost) empties the chain and rewrites the set under a new epoch. When
`/health` fails `unhealthy_after` times in a row, or the server's process start time changes,
the session ends: the registration and the block set are deleted at once (routers drop the
server within one refresh); once healthy it registers anew. A bad batch is counted and
skipped, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server

from common.background import BackgroundErrors, cancelling
from common.hashing import BlockHasher
from common.model_identity import config_vocab_size, model_digest
from common.publisher import WorkerPublisher
from common.registry import RedisKeys
from vllm_bridge.chain import BlockChain
from vllm_bridge.metrics import BridgeCollector, BridgeCounts, Counts
from vllm_bridge.mirror import EventMirror, Source
from vllm_bridge.server import ServedModel, ServerMetrics, VLLMServer
from vllm_bridge.settings import BridgeSettings

log = logging.getLogger(__name__)
KV_EVENTS_FLAG = ('--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", '
                  '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'')


@dataclass
class Session:
    """One healthy period of the server: what it holds, and what mirrors its events into it."""

    chain: BlockChain
    publisher: WorkerPublisher
    mirror: EventMirror
    start_time: float | None
    info: dict = field(default_factory=dict)


class Bridge:
    def __init__(self, settings: BridgeSettings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.server = VLLMServer(settings.vllm_url, settings.vllm_api_key,
                                 settings.health_timeout_s)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.errors = BackgroundErrors(self.registry)
        self.registry.register(BridgeCollector(self.counts, lambda: self.session is not None,
                                               lambda: len(self.session.chain)
                                                       if self.session else 0))
        self.tally = BridgeCounts()
        self.own = self.tally.totals["bridge"]  # what the bridge itself counts
        self.session: Session | None = None
        self.metrics = ServerMetrics()
        self._failures = 0

    # ---- the health loop ----------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled; deregisters on the way out."""
        await self.server.start()
        log.info("vllm bridge for %s: registering it once healthy", self.settings.vllm_url)
        httpd = None
        if self.settings.metrics_port is not None:
            httpd, _ = start_http_server(self.settings.metrics_port, "127.0.0.1", self.registry)
        try:
            while not cancelling():
                await self.check()
                await asyncio.sleep(self.settings.health_interval_s)
        finally:
            await self.detach("stopping")
            await self.server.close()
            if httpd is not None:
                httpd.shutdown()

    async def check(self) -> None:
        """One round: probe the server; register, re-register or deregister as it says."""
        if not await self.server.healthy():
            self._failures += 1
            if self._failures == 1:
                log.info("%s is not healthy (GET /health)", self.settings.vllm_url)
            if self.session is not None and self._failures >= self.settings.unhealthy_after:
                await self.detach(f"unhealthy ({self._failures} failed probes)")
            return
        self._failures = 0
        try:
            self.metrics = await self.server.metrics()
        except Exception as e:  # noqa: BLE001 - the load figures wait for the next round
            self.errors.record("vllm_bridge_probe", e, key="metrics")
        s, started = self.session, self.metrics.start_time
        if s is not None and started and s.start_time and started != s.start_time:
            await self.detach("restarted (a new process)")
        if self.session is None:
            try:
                await self.attach()
            except Exception as e:  # noqa: BLE001 - misconfigured or not ready: try next round
                self.errors.record("vllm_bridge_register", e, key=f"attach:{e}")
        self.tally.log(self.counts())

    async def attach(self) -> None:
        """Probe what the server serves, register it and start mirroring its events."""
        st = self.settings
        model = await self.server.model()
        metrics = self.metrics = await self.server.metrics()
        if st.block_size and metrics.block_size and st.block_size != metrics.block_size:
            raise ValueError(f"--block-size {st.block_size} but the server's is "
                             f"{metrics.block_size}")
        block_size = metrics.block_size or st.block_size
        if block_size is None:
            raise ValueError("the server's block size is unknown (no vllm:cache_config_info in "
                             "its /metrics): pass --block-size")
        identity = self._identity(model)
        hasher = BlockHasher(identity["model_digest"], block_size, st.hash_salt)
        source = await self._source()
        capacity = metrics.num_gpu_blocks or 0
        chain = BlockChain(hasher, st.max_blocks or max(4 * capacity, 1 << 16))
        info = {"model": model.names[0], "served_model_names": model.names, **identity,
                "block_size": block_size, "hash_seed": hasher.seed,
                "max_model_len": model.max_model_len, "role": st.role, "url": st.public_url,
                "backend": "vllm", "capacity": capacity, "engine_id": st.resolved_worker_id,
                "started_at": metrics.start_time or time.time()}
        info = {k: v for k, v in info.items() if v is not None}

        async def snapshot() -> dict[str, list[int]]:
            return await mirror.snapshot()

        publisher = WorkerPublisher(st.redis_url, RedisKeys(st.namespace), st.resolved_worker_id,
                                    info, snapshot=snapshot,
                                    load=lambda: self.metrics.load(chain.num_device_blocks),
                                    ttl_s=st.heartbeat_ttl_s, errors=self.errors,
                                    token=st.internal_token, cluster=st.redis_cluster)
        mirror = EventMirror(chain, publisher, source, st, self.tally, self.errors)
        session = Session(chain, publisher, mirror, metrics.start_time, info=info)
        publisher.start()
        mirror.start()
        self.session = session
        self.own["registrations"] += 1
        log.info("registered %s as %s (%s, model %s, block size %d); events from %s, replay %s",
                 st.public_url, st.resolved_worker_id, st.role, identity["model_digest"],
                 block_size, source.endpoint, source.replay_endpoint or "off (degraded)")

    async def detach(self, reason: str) -> None:
        """End the session: stop mirroring, delete the registration and the block set."""
        session, self.session = self.session, None
        if session is None:
            return
        await session.mirror.stop()  # the chain is empty after it
        self.tally.add("blocks", session.chain.counts)
        await session.publisher.close(deregister=True)
        self.own["deregistrations"] += 1
        log.warning("deregistered %s: %s", self.settings.public_url, reason)

    # ---- what the server is -------------------------------------------------------------------

    def _identity(self, model: ServedModel) -> dict:
        """The model's digest (and tokenizer folder, vocabulary size): from the model folder as
        Tandem workers compute it, if readable; else from the model path vLLM reports, as
        routers probing vLLM do."""
        folder = self.settings.model_folder
        if folder is not None:
            try:
                return {"model_digest": model_digest(folder), "tokenizer_path": str(folder),
                        "vocab_size": config_vocab_size(folder)}
            except OSError as e:
                self.errors.record("vllm_bridge_register", f"model folder unreadable ({e}); the "
                                   "model is named by its path", key="model_folder")
        return {"model_digest": model.root_digest}

    async def _source(self) -> Source:
        st = self.settings
        if st.events_endpoint:
            replay = st.resolve_endpoint(st.replay_endpoint) if st.replay_endpoint else None
            return Source(st.resolve_endpoint(st.events_endpoint), replay, st.topic or "")
        src = (await self.server.event_sources()).get(st.dp_rank)
        if src is None or not src.enable_kv_cache_events or src.publisher != "zmq":
            raise ValueError(f"{st.vllm_url} publishes no KV events (rank {st.dp_rank}): start "
                             f"vLLM with {KV_EVENTS_FLAG}, or give --events-endpoint")
        if (src.endpoint.startswith("tcp://") and "*" not in src.endpoint
                and "::" not in src.endpoint):
            raise ValueError(f"vLLM connects to {src.endpoint} (it binds only wildcard or ipc:// "
                             "endpoints): give it tcp://*:PORT")
        replay = st.replay_endpoint or src.replay_endpoint
        if not replay:
            log.warning("%s has no replay endpoint: a missed batch empties its index until "
                        "blocks are reported again", st.vllm_url)
        for endpoint in (src.endpoint, replay):
            if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"cannot connect to vLLM's endpoint {endpoint!r}")
        return Source(st.resolve_endpoint(src.endpoint),
                      st.resolve_endpoint(replay) if replay else None,
                      src.topic if st.topic is None else st.topic)

    # ---- counts -------------------------------------------------------------------------------

    def counts(self) -> Counts:
        """Everything counted so far, the live session's parts included."""
        session = self.session
        live = {}
        if session is not None:
            live["blocks"] = session.chain.counts
            if session.mirror.subscriber is not None:
                live["events"] = session.mirror.subscriber.counts
        return self.tally.read(live)

