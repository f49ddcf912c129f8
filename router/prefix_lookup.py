"""One request's prefix lookup: how many leading blocks of its prompt each live worker holds, and
from which source that is known.

- Tandem workers, and vLLM workers that a `tandem vllm-bridge` registered, publish their blocks:
  the published index (router/index.py) is exact for them.
- Bridged vLLM workers report a prompt's blocks only after its prefill step: until then this
  router's own recent decisions stand in (router/speculative.py).
- Static vLLM entries publish nothing: the model's approximate index, learned from routing.

A model's workers may use several block sizes (Tandem's 16 beside vLLM's 128): the prompt is
hashed once per size, and each worker is matched and recorded in blocks of its own size.

A worker's match is its leading run held in any of its KV tiers (device, host, disk); `media`
says, per published worker, how that run splits by tier (router/tiered_match.py), which the
policy prices at the worker's reload rates. The other sources know of the device only.
"""

from __future__ import annotations

from router.index import UNAVAILABLE
from router.models import ServedModel
from router.plan import Plan
from router.speculative import SpeculativeIndex
from router.tiered_match import MatchByMedium
from router.worker_info import WorkerInfo


class IndexUnavailable(RuntimeError):
    """The published index gave no answer: `matches` is the best left to route on (the
    approximate and speculative sources, zeros for the rest). `redis_down`: it did not answer
    (a connection error, `router/index.py` UNAVAILABLE); otherwise it raised something else (a
    bug, an answer it could not read), which is not Redis being down: the cause is counted as a
    background error, never reported as `tandem_redis_up` 0."""

    def __init__(self, matches: dict[str, int], redis_down: bool = True) -> None:
        super().__init__("prefix index unavailable" if redis_down else "prefix lookup failed")
        self.matches = matches
        self.redis_down = redis_down


def published(w: WorkerInfo) -> bool:
    """Whether a worker's cache is in the published (exact) index: every Tandem worker, and a
    vLLM worker registered in Redis by its bridge; a static vLLM entry publishes nothing."""
    return w.backend == "tandem" or not w.static


class PrefixLookup:
    def __init__(self, model: ServedModel, live: list[WorkerInfo], index,
                 recent: SpeculativeIndex, cache_salt: str | None = None) -> None:
        self.model, self.live, self.index, self.recent = model, live, index, recent
        self.cache_salt = cache_salt  # the request's chain root (common/hashing.py chain_root)
        self.chains: dict[int, list[int]] = {}  # block size -> the prompt's hashes at that size
        self._by_id = {w.worker_id: w for w in live}
        self.media: dict[str, MatchByMedium] = {}  # worker id -> its match by tier (published)

    async def match(self, prompt: list[int]) -> dict[str, int]:
        """Leading matched blocks per live worker id (in its own block size, held in any tier;
        `media` has their split by tier); raises IndexUnavailable when the published index
        fails."""
        for w in self.live:
            if w.block_size not in self.chains:
                hasher = self.model.hasher_for(w.block_size)
                self.chains[w.block_size] = hasher(prompt, cache_salt=self.cache_salt) \
                    if hasher else []
        exact = [w.worker_id for w in self.live if published(w)]
        approx = [w.worker_id for w in self.live if not published(w)]
        bridged = [w.worker_id for w in self.live if published(w) and w.backend != "tandem"]
        matches: dict[str, int] = {}
        failure, down = None, False
        try:
            self.media = await self._match_by_medium(exact)
            matches.update({wid: m.total for wid, m in self.media.items()})
        except UNAVAILABLE as e:  # Redis down: route on load (and the rest) alone
            failure, down = e, True
        except Exception as e:  # noqa: BLE001 - not Redis down: counted by the caller
            failure = e
        if failure is not None:
            matches.update(dict.fromkeys(exact, 0))
        matches.update(await self._match(self.model.approx_index, approx))
        for wid, n in (await self._match(self.recent, bridged)).items():
            if n > matches.get(wid, 0):  # routed here just now: being computed on the device
                matches[wid] = n
                self.media[wid] = MatchByMedium(n)
        if failure is not None:
            raise IndexUnavailable(matches, down) from failure
        return matches

    async def _match(self, source, worker_ids: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for size, hashes in self.chains.items():
            group = [wid for wid in worker_ids if self._by_id[wid].block_size == size]
            if group:
                out.update(await source.match(hashes, group))
        return out

    async def _match_by_medium(self, worker_ids: list[str]) -> dict[str, MatchByMedium]:
        out: dict[str, MatchByMedium] = {}
        for size, hashes in self.chains.items():
            group = [wid for wid in worker_ids if self._by_id[wid].block_size == size]
            if group:
                out.update(await self.index.match_by_medium(hashes, group))
        return out

    def record(self, plan: Plan, known_ids) -> None:
        """Both legs of `plan` end up holding the prompt's blocks (the decode side after its
        pull): tell the sources that learn from routing."""
        for w in {w.worker_id: w for w in (plan.decode, plan.prefill or plan.decode)}.values():
            hashes = self.chains.get(w.block_size, [])
            if w.backend == "tandem":
                self.index.record(w.worker_id, hashes)
            elif published(w):
                self.recent.forget(known_ids)
                self.recent.record(w.worker_id, hashes)
            else:
                self.model.approx_index.record(w.worker_id, hashes)
