"""The models this router serves (docs/contract.md "Registration per model"): one tokenizer, chat
template, block hasher and in-process index per served name, and the rule that decides which
workers may serve a name.

A name belongs to one model digest at a time: that of the workers that registered it first (the
oldest `started_at`), for as long as any of them lives. A worker that claims the name with another
digest is refused for that name (logged once, counted in
`tandem_worker_registrations_refused_total{reason}`): its token ids would not be the ones the
router computes, and a request sent there would answer garbage. Block sizes may differ (Tandem
workers at 16 beside vLLM workers at 128): the router hashes a prompt once per block size among
the name's live workers, each size with its own seed (`ServedModel.hasher_for`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from common.hashing import BlockHasher
from common.model_identity import config_vocab_size
from common.tokenizer import Tokenizer
from router.index import MemoryPrefixIndex
from router.worker_info import Identity, WorkerInfo

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """One served name: what requests for it are tokenized, hashed and routed with."""

    name: str
    tokenizer: Tokenizer
    identity: Identity | None = None  # None until a worker of it is accepted
    hasher: BlockHasher | None = None
    tokenizer_source: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    # Without Redis (and for vLLM backends, which publish nothing) the router remembers what it
    # sent where; per model, so one model's traffic never evicts another's entries.
    memory_index: MemoryPrefixIndex = field(default_factory=MemoryPrefixIndex)
    approx_index: MemoryPrefixIndex = field(default_factory=MemoryPrefixIndex)
    # The model's vocabulary (config.json's, which may exceed the tokenizer's: tiny-random has
    # 320 ids for 259 tokens): a worker that answers an id at or past it is failed. None: only
    # the wire bound (int32) holds.
    vocab_size: int | None = None
    _hashers: dict[int, BlockHasher] = field(default_factory=dict, repr=False)

    @property
    def block_size(self) -> int:
        """The first accepted worker's block size (a model is routed only once a worker gave it
        an identity); others may differ (`hasher_for`)."""
        return self.identity[1] if self.identity else 16

    def hasher_for(self, block_size: int) -> BlockHasher | None:
        """The block hasher of this model's workers of `block_size` (same digest and salt)."""
        if self.hasher is None or block_size == self.hasher.block_size:
            return self.hasher
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(self.hasher.model_id, block_size,
                                                             self.hasher.salt)
        return hasher


class ModelCatalog:
    """Served names -> `ServedModel`, kept in step with the live workers by `reconcile`."""

    def __init__(self, *, only: str | None, tokenizer_path: Path | None, model_dir: Path,
                 hash_salt: str | None, registry: CollectorRegistry | None = None,
                 chat_template: str | None = None) -> None:
        self.chat_template = chat_template  # --chat-template: replaces every model's own
        self.only = only  # --model: serve this name alone
        self.tokenizer_path = tokenizer_path  # --tokenizer: `only`'s, or any model's fallback
        self.model_dir = model_dir
        self.hash_salt = hash_salt
        self.models: dict[str, ServedModel] = {}
        self._refused_logged: set[tuple[str, str, str]] = set()
        self._tokenizer_failures: dict[str, float] = {}  # name -> when to try again
        self.refused = Counter("tandem_worker_registrations_refused", "Workers (or one of their "
                               "names) left out of routing, by reason", ["reason"],
                               registry=registry)
        for reason in ("model_identity", "hash_seed", "tokenizer"):
            self.refused.labels(reason)

    def preload(self) -> None:
        """Load the `--model`'s tokenizer now, so a missing one fails at startup."""
        if self.only and (self.tokenizer_path or (self.model_dir / self.only).is_dir()):
            path = self.tokenizer_path or self.model_dir / self.only
            self.models[self.only] = ServedModel(self.only, self._tokenizer(path),
                                                 tokenizer_source=str(path),
                                                 vocab_size=config_vocab_size(path))

    def _tokenizer(self, path: Path) -> Tokenizer:
        tokenizer = Tokenizer(path)
        if self.chat_template is not None:
            tokenizer.set_chat_template(self.chat_template)
        return tokenizer

    def get(self, name: str) -> ServedModel | None:
        return self.models.get(name)

    def served(self, workers: Iterable[WorkerInfo]) -> list[str]:
        """The names that have an available worker now."""
        live = {n for w in workers if w.available for n in w.accepted}
        return sorted(n for n in self.models if n in live)

    def hasher(self, identity: Identity) -> BlockHasher:
        digest, block_size = identity
        # Workers that publish no digest (vLLM, older ones) get the seed of an empty digest: their
        # hashes only feed their model's own approximate index, so no two models share entries.
        return BlockHasher(digest, block_size, self.hash_salt)

    async def reconcile(self, workers: Iterable[WorkerInfo]) -> None:
        """Decide, for every worker, the names it may serve (`WorkerInfo.accepted`)."""
        workers = sorted(workers, key=lambda w: (w.started_at, w.worker_id))
        claims: dict[str, list[WorkerInfo]] = {}
        for w in workers:
            for name in w.served_names:
                if self.only is None or name == self.only:
                    claims.setdefault(name, []).append(w)
        accepted: dict[str, set[str]] = {w.worker_id: set() for w in workers}
        for name, claimants in claims.items():
            model = self.models.get(name)
            current = model.identity if model else None
            # The name keeps its digest while a worker of it lives; else the oldest claimant's.
            if current is None or all(w.digest != current[0] for w in claimants):
                current = claimants[0].identity
            model = await self._model(name, current, claimants[0])
            if model is None:
                for w in claimants:
                    self._refuse(w, name, "tokenizer", "its tokenizer could not be loaded")
                continue
            for w in claimants:
                if w.digest != current[0]:
                    self._refuse(w, name, "model_identity",
                                 f"it is model {w.digest or 'without a digest'} while {name!r} is "
                                 f"served by {current[0] or 'a model without a digest'}")
                elif w.hash_seed is not None and w.hash_seed != model.hasher_for(w.block_size).seed:
                    self._refuse(w, name, "hash_seed", "its block hash seed differs from this "
                                 "router's (another --hash-salt?)")
                else:
                    accepted[w.worker_id].add(name)
        for w in workers:
            w.accepted = frozenset(accepted[w.worker_id])

    async def _model(self, name: str, identity: Identity,
                     example: WorkerInfo) -> ServedModel | None:
        model = self.models.get(name)
        if model is not None and model.identity == identity:
            model.vocab_size = model.vocab_size or example.vocab_size
            return model
        pinned = self.only == name and self.tokenizer_path is not None
        if model is not None and (pinned or model.identity is None):
            model.identity, model.hasher = identity, self.hasher(identity)
            model.vocab_size = example.vocab_size or model.vocab_size
            return model
        if time.monotonic() < self._tokenizer_failures.get(name, 0.0):
            return None
        sources = [Path(example.tokenizer_path)] if example.tokenizer_path else []
        if self.tokenizer_path is not None:  # --tokenizer: --model's, or any model's fallback
            sources.append(self.tokenizer_path)
        sources.append(self.model_dir / name)
        for path in sources:
            if not (path / "tokenizer.json").is_file():
                continue
            try:
                tokenizer = await asyncio.to_thread(self._tokenizer, path)
            except Exception as e:  # noqa: BLE001 - a bad folder: try the next, then refuse
                log.warning("model %r: tokenizer at %s failed to load: %s", name, path, e)
                continue
            served = ServedModel(name, tokenizer, identity, self.hasher(identity), str(path),
                                 vocab_size=example.vocab_size or config_vocab_size(path))
            log.info("serving model %r (%s, block size %d; tokenizer from %s)", name,
                     identity[0] or "no digest", identity[1], path)
            self.models[name] = served
            self._tokenizer_failures.pop(name, None)
            return served
        log.warning("model %r: no tokenizer at %s; its workers are left out (retrying in 10 s)",
                    name, " or ".join(str(p) for p in sources))
        self._tokenizer_failures[name] = time.monotonic() + 10.0
        return None

    def _refuse(self, w: WorkerInfo, name: str, reason: str, why: str) -> None:
        key = (w.worker_id, name, reason)
        if key in self._refused_logged:
            return
        if len(self._refused_logged) > 10_000:  # bounded: worker ids come from Redis
            self._refused_logged.clear()
        self._refused_logged.add(key)
        self.refused.labels(reason).inc()
        log.warning("worker %s refused for model %r: %s", w.worker_id, name, why)

