"""The KV tiers' load path (engine/kv_tiers.py): blocks held in the host or disk tier are copied
into device blocks the caller allocated, on a thread of its own (`kv-loader`), so that a
sequence whose prefix is reloaded waits in the scheduler's loading state while the running
streams' steps go on (engine/kv_cache_manager.py `start_load`, engine/scheduler.py).

A `Load` fills its blocks in order and stops at the first that is gone from its tier or fails
its checks (a disk file deleted, truncated or corrupt): `num_loaded` says how many leading
blocks hold their contents, and the caller computes the rest; a block past it holds nothing it
may serve. A cancelled load stops between two blocks; its blocks stay the caller's until `done`
(no write lands in a block after that). On a GPU the copies run on a side stream that first
waits for the device work queued when the load was submitted.

`load_now` runs the same copies on the caller's thread (imports and prefix pins, which need the
blocks before they answer).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from engine.disk_tier import DiskTier
from engine.host_tier import HostTier
from engine.tier_stats import MEDIA, TierStats

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Load:
    """Block `block_hashes[i]`, held in tier `media[i]`, into device block `block_ids[i]`."""

    block_hashes: list[int]
    media: list[str]
    block_ids: list[int]
    after: torch.cuda.Event | None = None  # the device work the copies follow (GPU)
    num_loaded: int = 0  # leading blocks filled, once done
    done: bool = False
    cancelled: bool = False


class Loader:
    def __init__(self, kv_cache: torch.Tensor, host: HostTier, disk: DiskTier | None,
                 stats: TierStats, tiers_lock: threading.Condition) -> None:
        """`tiers_lock` guards the host tier and `stats` (shared with engine/kv_offloader.py)."""
        self.kv_cache, self.host, self.disk, self.stats_ = kv_cache, host, disk, stats
        self._tiers_lock = tiers_lock
        self._cond = threading.Condition()  # the queue and every load's `done`
        self._queue: deque[Load] = deque()
        self._working = False
        self._closing = False
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._thread = threading.Thread(target=self._run, name="kv-loader", daemon=True)
        self._thread.start()

    def submit(self, load: Load) -> None:
        """Start filling `load`'s blocks (off this thread); `load.done` says when it is over."""
        self._follow(load)
        with self._cond:
            if self._closing:
                load.done = True
                return
            self._queue.append(load)
            self._cond.notify_all()

    def cancel(self, load: Load) -> None:
        """Stop `load` at its next block (its blocks are still written until `done`)."""
        with self._cond:
            load.cancelled = True

    def wait(self, loads: list[Load], timeout_s: float) -> bool:
        """Until one of `loads` is done, at most `timeout_s`; whether one is."""
        with self._cond:
            return self._cond.wait_for(lambda: any(x.done for x in loads), timeout_s)

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._queue or self._working)

    def load_now(self, block_hashes: list[int], media: list[str], block_ids: list[int]) -> int:
        """`Load` on the caller's thread: how many leading blocks were filled."""
        load = Load(block_hashes, media, block_ids)
        self._follow(load)
        return self._copy(load)

    def _follow(self, load: Load) -> None:
        """On a GPU: `load`'s copies wait for the work the caller's stream has queued so far
        (a step still in flight may write a block that was freed meanwhile)."""
        if self._stream is not None:
            load.after = torch.cuda.Event()
            load.after.record()

    def close(self) -> None:
        """Stop the thread after the load in progress; queued ones end with nothing loaded."""
        with self._cond:
            self._closing = True
            for load in self._queue:
                load.done = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._queue or self._closing):
                    self._cond.wait()
                if self._closing:
                    return
                load = self._queue.popleft()
                self._working = True
            num = 0
            try:
                num = self._copy(load)
            except Exception:  # noqa: BLE001 - a failed load is computed instead
                log.exception("kv tiers: a reload failed")
            with self._cond:
                load.num_loaded, load.done, self._working = num, True, False
                self._cond.notify_all()

    def _copy(self, load: Load) -> int:
        """Fill `load`'s blocks in order, stopping at the first that is gone or fails its
        checks (or at a cancellation); how many were filled. Counted per tier."""
        seconds, counts = dict.fromkeys(MEDIA, 0.0), dict.fromkeys(MEDIA, 0)
        stream = self._stream
        if stream is not None and load.after is not None:
            stream.wait_event(load.after)
        num = 0
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for block_hash, medium, block_id in zip(load.block_hashes, load.media,
                                                    load.block_ids, strict=True):
                if load.cancelled:
                    break
                t0 = time.perf_counter()
                if not self._copy_block(block_hash, medium, self.kv_cache[block_id]):
                    break
                if stream is not None:
                    stream.synchronize()
                seconds[medium] += time.perf_counter() - t0
                counts[medium] += 1
                num += 1
        with self._tiers_lock:
            for medium, n in counts.items():
                self.stats_.reloaded(medium, n, seconds[medium])
        return num

    def _copy_block(self, block_hash: int, medium: str, dst: torch.Tensor) -> bool:
        with self._tiers_lock:
            self.stats_.counters[medium].hit_blocks += 1
            if medium == "host":
                # Under the lock: the offloader's thread may not reuse the slot meanwhile.
                slot = self.host.slot(block_hash)
                if slot is None:
                    return False
                dst.copy_(self.host.slab[slot])
                self.host.touch(block_hash)
                return True
        return self.disk is not None and self.disk.read_into(
            block_hash, dst.view(torch.uint8).view(-1))

