"""The live worker set: discovered from Redis (`worker:*` keys, present only while a worker's
heartbeat refreshes them) and/or a static list, with a circuit breaker per worker."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from common.background import BackgroundErrors, cancelling
from common.model_identity import check_name
from common.registry import ProbedModel, RedisKeys, WorkerRegistration
from router.backends import BACKENDS
from router.models import ModelCatalog
from router.worker_info import WorkerInfo

log = logging.getLogger(__name__)


def parse_static(entry: str) -> tuple[str, str, str, str | None]:
    """`[backend:]role=url[,model=NAME]` -> (backend, role, url, model), e.g.
    `vllm:prefill=http://10.0.0.5:8100,model=qwen2.5-7b`."""
    spec, _, rest = entry.partition("=")
    url, _, model = rest.partition(",model=")
    backend, _, role = spec.rpartition(":")
    backend = backend or "tandem"
    if not url or role not in ("prefill", "decode", "colocated") or backend not in BACKENDS:
        raise ValueError(f"static worker {entry!r} must look like [backend:]prefill=http://host:port"
                         f"[,model=NAME] (roles: prefill, decode, colocated; backends: "
                         f"{', '.join(BACKENDS)})")
    return backend, role, url.rstrip("/"), check_name(model) if model else None


class WorkerDirectory:
    def __init__(self, keys: RedisKeys, static: list[str], breaker_failures: int = 3,
                 breaker_cooldown_s: float = 5.0, restart_grace_s: float = 5.0,
                 errors: BackgroundErrors | None = None, token: str | None = None,
                 catalog: ModelCatalog | None = None, static_model: str | None = None,
                 block_size: int = 16) -> None:
        self.keys = keys
        self.catalog = catalog  # told of every change, to decide which worker serves which model
        self.token = token  # set: only registrations signed with it count (common/registry.py)
        self.errors = errors or BackgroundErrors()
        # A key of this router's own (it expires only if the router stops refreshing): when it
        # is gone, Redis lost its data (restart, flush, failover to an empty replica), and the
        # workers' keys vanished with it although the workers live. For `restart_grace_s` the
        # known workers stay while they re-register, instead of 503s for a heartbeat.
        self._sentinel = f"{keys.prefix}router:{uuid.uuid4().hex}"
        self.restart_grace_s = restart_grace_s
        self._grace_until = 0.0
        self._last_ok: float | None = None  # when Redis last answered a whole refresh
        self.refresh_interval_s = 0.5  # set by `run`
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        self.workers: dict[str, WorkerInfo] = {}
        self.redis_ok: bool | None = None
        self.index = None  # a PrefixIndex to tell of the registered workers (router/index.py)
        for i, entry in enumerate(static):
            backend, role, url, model = parse_static(entry)
            wid = f"static-{role}-{i}"
            # Named in the entry, else the router's --model, else what its probe reports.
            names = (model or static_model,) if (model or static_model) else ()
            self.workers[wid] = WorkerInfo(wid, role, url, static=True, backend=backend,
                                           served_names=names, block_size=block_size)
        self._static_named = {wid for wid, w in self.workers.items() if w.served_names}

    def max_model_len(self, default: int, model: str | None = None) -> int:
        """The longest sequence every worker of `model` can take: its context length, and for
        decode-side workers also what its whole KV cache holds (a longer one is refused there)."""
        ws = [w for w in self.workers.values() if w.serves(model)]
        lens = [w.max_model_len for w in ws if w.max_model_len]
        lens += [w.capacity * w.block_size for w in ws
                 if w.capacity and w.role in ("decode", "colocated")]
        return min(lens) if lens else default

    def live(self, role: str | None = None, model: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers.values()
                if (role is None or w.role == role) and w.available and w.serves(model)]

    def next_decoder(self, tried: set[str], model: str) -> WorkerInfo | None:
        """Where a stream resumes: the live decode or colocated worker of `model` not in
        `tried` with the fewest requests; None when there is none."""
        pool = [w for w in self.live(model=model or None)
                if w.role in ("decode", "colocated") and w.worker_id not in tried]
        return min(pool, key=lambda w: (w.inflight, w.running())) if pool else None

    async def reconcile(self) -> None:
        if self.catalog is not None:
            await self.catalog.reconcile(list(self.workers.values()))

    async def refresh(self, redis) -> None:
        """Replace the Redis-discovered workers with those whose keys exist now."""
        try:
            lost = await redis.set(self._sentinel, b"1", ex=10, get=True) is None
            keys = [k async for k in redis.scan_iter(match=self.keys.worker_pattern, count=500)]
            pipe = redis.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            # Each answer on its own: one key of the wrong type (anyone who can write to Redis
            # can make one) is one skipped registration, not a failed discovery round.
            infos = await pipe.execute(raise_on_error=False)
        except Exception as e:  # noqa: BLE001 - any Redis failure: keep the last view
            if self.redis_ok is not False:
                log.warning("redis unavailable (%s): routing on the last known workers "
                            "and load only", e)
            self.redis_ok = False
            return
        self.redis_ok = True
        now = time.monotonic()
        # Away (down, or stalled: a refresh that hung counts too) for longer than a few
        # rounds: keys may have expired while their workers could not reach Redis either. The
        # sentinel alone misses a stall shorter than its own TTL (its write lands first).
        away = self._last_ok is not None and now - self._last_ok > 2 * self.refresh_interval_s + 1.0
        self._last_ok = now
        if (lost or away) and any(not w.static for w in self.workers.values()):
            log.warning("redis %s: keeping %d known workers for %.1f s while they re-register",
                        "lost its data" if lost else "was unreachable", len(self.workers),
                        self.restart_grace_s)
            self._grace_until = now + self.restart_grace_s
        seen = set()
        for key, raw in zip(keys, infos, strict=True):
            wid = self.keys.worker_id_of(key)
            if isinstance(raw, Exception):
                self.errors.record("worker_discovery", f"registration {wid!r} unreadable: {raw}",
                                   key=f"unreadable:{wid}")
                continue
            if not raw:
                continue
            try:
                reg = WorkerRegistration.from_hash(raw, wid, self.token)
            except (ValueError, UnicodeDecodeError) as e:
                self.errors.record("worker_discovery", f"registration {wid!r} refused: {e}",
                                   key=f"refused:{wid}")
                continue
            seen.add(wid)
            w = self.workers.get(wid)
            if w is None:
                w = self.workers[wid] = WorkerInfo(wid, reg.role, reg.url)
                log.info("worker joined: %s (%s at %s)", wid, w.role, w.url)
            w.role, w.url, w.model, w.backend = reg.role, reg.url, reg.model, reg.backend
            w.served_names, w.digest, w.hash_seed = (tuple(reg.names), reg.model_digest,
                                                     reg.hash_seed)
            w.tokenizer_path, w.started_at = reg.tokenizer_path, reg.started_at
            w.block_size, w.capacity = reg.block_size, reg.capacity
            w.max_model_len, w.block_bytes = reg.max_model_len, reg.block_bytes
            w.vocab_size, w.locality = reg.vocab_size, reg.locality
            w.report(reg.load.model_dump())  # settles what this router sent there before
            w.events = reg.events
        if time.monotonic() >= self._grace_until:
            for wid in [w for w, info in self.workers.items() if not info.static and w not in seen]:
                log.info("worker left: %s", wid)
                del self.workers[wid]
        if self.index is not None:
            # Registered workers publish their blocks: Tandem workers themselves, vLLM workers
            # through their bridge (vllm_bridge/).
            tracked = [w for w in self.workers.values() if not w.static]
            self.index.track({w.worker_id: w.events for w in tracked}, data_lost=lost,
                             capacities={w.worker_id: w.capacity for w in tracked})
        await self.reconcile()

    async def leave(self, redis) -> None:
        """On shutdown: remove this router's own key, so a stopped cluster leaves none behind."""
        if redis is None:
            return
        try:
            await asyncio.wait_for(redis.delete(self._sentinel), 2.0)
        except Exception as e:  # noqa: BLE001 - best effort; the key expires anyway
            log.warning("could not remove %s from Redis: %s", self._sentinel, e)

    async def run(self, redis, interval_s: float) -> None:
        self.refresh_interval_s = interval_s
        while not cancelling():
            try:
                await self.refresh(redis)
            except Exception as e:  # noqa: BLE001 - discovery must outlive any bad entry or bug
                self.errors.record("worker_discovery", e)
            await asyncio.sleep(interval_s)

    async def probe_all(self, probe) -> None:
        """Health-check every worker, static or discovered: a heartbeat proves the process
        lives, not that it can serve (a worker whose engine died kept heart-beating once, and
        every request to it failed). `probe(w)` returns what it learned or raises."""
        async def one(w: WorkerInfo) -> None:
            try:
                info = await probe(w)
            except Exception as e:  # noqa: BLE001 - any failure: not healthy
                if w.available:
                    log.warning("worker %s failed its health check: %s", w.worker_id, e)
                self.mark_dead(w)
                return
            if not w.available:
                log.info("worker %s is healthy again", w.worker_id)
                self.record_success(w)
            if w.static:
                self._learn(w, info)

        await asyncio.gather(*(one(w) for w in list(self.workers.values())))
        await self.reconcile()

    def _learn(self, w: WorkerInfo, info: dict) -> None:
        """What a static worker's probe says of its model (bounded like a registration)."""
        try:
            reg = ProbedModel.model_validate(info)
        except ValueError as e:
            self.errors.record("worker_probes", f"{w.worker_id} reported a malformed model: {e}")
            return
        w.model = reg.model or w.model
        if w.worker_id not in self._static_named and reg.names:
            w.served_names = tuple(reg.names)
        w.digest, w.hash_seed, w.tokenizer_path = (reg.model_digest, reg.hash_seed,
                                                   reg.tokenizer_path)
        w.block_size = reg.block_size or w.block_size
        w.max_model_len = reg.max_model_len or w.max_model_len
        w.vocab_size = reg.vocab_size or w.vocab_size

    async def run_probes(self, probe, interval_s: float) -> None:
        while not cancelling():
            try:
                await self.probe_all(probe)
            except Exception as e:  # noqa: BLE001 - a probe bug must not end health checking
                self.errors.record("worker_probes", e)
            await asyncio.sleep(interval_s)

    def record_failure(self, w: WorkerInfo) -> None:
        w.failures += 1
        if w.failures >= self.breaker_failures:
            w.open_until = time.monotonic() + self.breaker_cooldown_s
            log.warning("circuit open for %s for %.1f s", w.worker_id, self.breaker_cooldown_s)

    def record_success(self, w: WorkerInfo) -> None:
        w.failures = 0
        w.open_until = 0.0

    def mark_dead(self, w: WorkerInfo) -> None:
        """A connection error: stop routing there until its key says otherwise or cooldown ends."""
        w.failures = self.breaker_failures
        w.open_until = time.monotonic() + self.breaker_cooldown_s
