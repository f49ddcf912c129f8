"""The disk tier: a folder of block files (engine/tier_file.py) under a byte budget, evicted in
LRU order (by last use; across a restart, by modification time, which a read refreshes).

It survives a restart: `scan` indexes the valid files a folder already holds and deletes (and
counts) the corrupt, truncated, foreign and stale ones, and the files that a crash left half
written. Writes are atomic (a temporary file, then `os.replace`). A full disk (ENOSPC, EDQUOT,
EROFS) or repeated write errors stop the tier's writes; it keeps serving what it holds, and the
worker never fails for it. Reads come from the engine's thread and writes from the tiers'
thread: the index has its own lock, file I/O runs outside it, and every read is checked again
(a file deleted or replaced meanwhile is a miss, never wrong contents).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.tier_file import (
    BlockFormat,
    TierFileError,
    decode,
    encode_header,
    file_name,
    hash_of_name,
)

log = logging.getLogger(__name__)

Writer = Callable[[Path, Sequence[bytes | memoryview]], None]
_FATAL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_MAX_CONSECUTIVE_ERRORS = 3


def write_atomically(path: Path, chunks: Sequence[bytes | memoryview]) -> None:
    """Write `chunks` to `path` so a reader sees the whole file or none (no fsync: a crash of
    the process leaves the old file or the new one; a torn write after a power cut fails the
    checksum)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class DiskTier:
    def __init__(self, folder: str | Path, capacity_bytes: int, fmt: BlockFormat,
                 writer: Writer = write_atomically, lock_timeout_s: float = 10.0) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.fmt = fmt
        self._writer = writer
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # block hash -> file bytes, LRU first
        self.used_bytes = 0  # indexed files plus the one being written
        self.stopped: str | None = None  # why writes stopped; None while they go on
        self.num_rejected: dict[str, int] = {}  # files deleted unserved, by reason
        self.num_write_errors = 0
        self._consecutive_errors = 0
        # One worker per folder: a second one would count the same bytes against two budgets and
        # delete the other's files in flight. Its tier stays empty and off. The lock goes with
        # the process, so a restart after a crash takes it again (waiting `lock_timeout_s` for
        # the crashed worker's engine process to exit).
        self._lock_file = open(self.folder / ".lock", "a+b")  # noqa: SIM115 - held until close
        deadline = time.monotonic() + lock_timeout_s
        while True:
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    self._lock_file.close()
                    self._lock_file = None
                    self._stop(f"{self.folder} is in use by another process")
                    break
                time.sleep(0.1)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._index)

    def _path(self, block_hash: int) -> Path:
        return self.folder / file_name(block_hash)

    # ---- start ------------------------------------------------------------------------------

    def scan(self) -> list[int]:
        """Index the valid block files in the folder, least recently used first, within the
        budget; delete and count every other block file (and half-written ones). Returns the
        hashes indexed. Files that are no block files are left alone."""
        found: list[tuple[float, int, int]] = []
        if self._lock_file is None:
            return []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if not entry.is_file(follow_symlinks=False):
                    continue
                block_hash = hash_of_name(entry.name)
                if block_hash is None:
                    if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                        self._reject(Path(entry.path), "stale")  # a write a crash cut short
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                    self._load(block_hash)
                except TierFileError as e:
                    self._reject(Path(entry.path), e.reason)
                    continue
                except OSError as e:
                    log.warning("disk tier: cannot read %s: %s", entry.path, e)
                    continue
                found.append((st.st_mtime, block_hash, st.st_size))
        found.sort()
        with self._lock:
            for _, block_hash, size in found:
                self._index[block_hash] = size
                self.used_bytes += size
        evicted = self._make_room(0)
        self._unlink(evicted)
        return self.hashes()

    def _load(self, block_hash: int) -> memoryview:
        """The checked payload of a block's file (OSError when unreadable)."""
        with open(self._path(block_hash), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > self.fmt.file_bytes_max:
                raise TierFileError("corrupt", f"{size} bytes is too long")
            data = bytearray(size)
            num = f.readinto(data)
        return decode(self.fmt, block_hash, memoryview(data)[:num])

    def _reject(self, path: Path, reason: str) -> None:
        log.warning("disk tier: %s block file %s deleted", reason, path.name)
        self.num_rejected[reason] = self.num_rejected.get(reason, 0) + 1
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    # ---- serving ----------------------------------------------------------------------------

    def read_into(self, block_hash: int, dst: torch.Tensor) -> bool:
        """Copy block `block_hash` into `dst` (its bytes: a flat uint8 view); False, `dst`
        untouched, when it is not here or its file fails a check (then deleted and counted)."""
        with self._lock:
            if block_hash not in self._index:
                return False
            self._index.move_to_end(block_hash)
        path = self._path(block_hash)
        try:
            payload = self._load(block_hash)
        except TierFileError as e:
            self._forget(block_hash)
            self._reject(path, e.reason)
            return False
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                log.warning("disk tier: cannot read %s: %s", path.name, e)
            self._forget(block_hash)
            return False
        dst.copy_(torch.frombuffer(payload, dtype=torch.uint8))
        try:
            os.utime(path)  # its last use, for the LRU order after a restart
        except OSError:
            pass
        return True

    def write(self, block_hash: int, payload: memoryview) -> tuple[bool, list[int]]:
        """Store `payload` (the block's bytes) as `block_hash`, evicting LRU files to keep the
        budget: (whether it is stored now, the hashes evicted)."""
        if self.stopped is not None:
            return False, []
        header = encode_header(self.fmt, block_hash, payload)
        size = len(header) + len(payload)
        if size > self.capacity_bytes:
            self._stop("the budget holds no block")
            return False, []
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True, []
        evicted = self._make_room(size)  # reserves `size`
        self._unlink(evicted)
        try:
            self._writer(self._path(block_hash), (header, payload))
        except OSError as e:
            with self._lock:
                self.used_bytes -= size
            self._write_failed(e)
            return False, evicted
        self._consecutive_errors = 0
        with self._lock:
            self._index[block_hash] = size
        return True, evicted

    def _make_room(self, size: int) -> list[int]:
        """Evict LRU entries until `size` more bytes fit, and reserve them."""
        evicted: list[int] = []
        with self._lock:
            while self._index and self.used_bytes + size > self.capacity_bytes:
                block_hash, n = self._index.popitem(last=False)
                self.used_bytes -= n
                evicted.append(block_hash)
            self.used_bytes += size
        return evicted

    def _unlink(self, block_hashes: list[int]) -> None:
        for block_hash in block_hashes:
            try:
                self._path(block_hash).unlink(missing_ok=True)
            except OSError as e:
                log.warning("disk tier: cannot delete %016x: %s", block_hash, e)

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            n = self._index.pop(block_hash, None)
            if n is not None:
                self.used_bytes -= n

    def _write_failed(self, error: OSError) -> None:
        self.num_write_errors += 1
        self._consecutive_errors += 1
        if error.errno in _FATAL_ERRNOS:
            self._stop(f"{errno.errorcode.get(error.errno, error.errno)}: {error}")
        elif self._consecutive_errors >= _MAX_CONSECUTIVE_ERRORS:
            self._stop(f"{self._consecutive_errors} write errors in a row, the last: {error}")
        else:
            log.warning("disk tier: a block write failed: %s", error)

    def _stop(self, why: str) -> None:
        if self.stopped is None:
            log.error("disk tier stops writing (%s); it serves what it holds", why)
            self.stopped = why

    def close(self) -> None:
        """Let the folder go (another process may take it)."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def clear(self) -> list[int]:
        """Delete every block file; their hashes."""
        with self._lock:
            gone = list(self._index)
            self._index.clear()
            self.used_bytes = 0
        self._unlink(gone)
        return gone
