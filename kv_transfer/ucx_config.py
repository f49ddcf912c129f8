"""The UCX settings the NIXL transport decides once, at its edge (before its agent exists), and
the UCX log it reads the chosen lane from.

Each variable is set only where the operator left it unset, and every decision is logged:
- `UCX_NET_DEVICES`: the interface of the worker's address plus every RDMA port
  (kv_transfer/netdev.py), so UCX's TCP lane listens only there and RDMA stays usable.
- `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on` when the cache is on a GPU. UCX's `auto` turns cuda_ipc's
  GET zero-copy off on GPUs without an active NVLink, and Tandem pulls with GET (READ): every
  VRAM pull then went through host staging over `tcp/lo`, 0.6 GB/s on an H200 instead of
  ~1 TB/s (measured on an H200 with bench/kv_transfer.py, docs/benchmarks.md).
- `UCX_PROTO_INFO=y` with `UCX_LOG_FILE` in a private directory, unless the operator pointed UCX
  at a log already (`ucx_proto_log`, or `UCX_LOG_FILE` set by hand): UCX prints the protocol it
  chose for each remote read there, which is how the transport label names the lane actually
  used (`ucx:cuda_ipc`, `ucx:rc_mlx5`, `ucx:cma`, `ucx:tcp`). Warnings and errors UCX writes
  to that file are passed on to this process's log.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
LOG_FILE_NAME = "ucx.log.%p"  # UCX replaces %p with the process id
_READ_TABLE = "remote memory read by ucp_get"
_LANE = re.compile(r"\|\s*[^|]*\|\s*[^|]*\|[^|/]*?([A-Za-z0-9_]+)/")
_PROBLEM = re.compile(r"\b(ERROR|WARN)\b")


@dataclass(frozen=True)
class UcxSettings:
    """What to set (`env`), what the operator had set and is kept (`kept`), and the log file
    pattern the lane is read from (None: the lane stays unknown, label `ucx`)."""

    env: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    log_file: str | None = None


def decide(environ: Mapping[str, str], net_devices: str | None, vram: bool,
           proto_log: str | None, log_dir: str | None) -> UcxSettings:
    """The settings for a transport whose cache is in VRAM (`vram`) or host memory. Pure:
    `environ` is read, never written. `log_dir`: where to put UCX's log when nobody chose one."""
    env: dict[str, str] = {}
    kept: dict[str, str] = {}

    def want(key: str, value: str | None) -> None:
        if value is None:
            return
        if key in environ:
            kept[key] = environ[key]
        else:
            env[key] = value

    want("UCX_NET_DEVICES", net_devices)
    if vram:
        want(GET_ZCOPY, "on")
    log_file = proto_log
    if log_file is None and "UCX_LOG_FILE" not in environ and log_dir is not None:
        log_file = os.path.join(log_dir, LOG_FILE_NAME)
        env["UCX_LOG_FILE"] = log_file
        want("UCX_PROTO_INFO", "y")
    elif log_file is None and "UCX_LOG_FILE" in environ:
        kept["UCX_LOG_FILE"] = environ["UCX_LOG_FILE"]
        log_file = (environ["UCX_LOG_FILE"]
                    if environ.get("UCX_PROTO_INFO", "n") in ("y", "yes", "1", "on") else None)
    return UcxSettings(env=env, kept=kept, log_file=log_file)


def apply(settings: UcxSettings, environ: dict[str, str]) -> None:
    """Write the decided variables into `environ` (the process environment at the edge) and log
    each decision once."""
    for key, value in settings.env.items():
        environ[key] = value
        log.info("nixl: %s=%s", key, value)
    for key, value in settings.kept.items():
        log.info("nixl: %s=%s (set by the operator, kept)", key, value)


def restore(settings: UcxSettings, environ: dict[str, str]) -> None:
    """Undo `apply` where nobody changed the values since: UCX has read them, and a process
    started later (a sender after this transport closed, an engine process) must not inherit
    a log file in a directory that is gone (UCX exits when it cannot open its log)."""
    for key, value in settings.env.items():
        if environ.get(key) == value:
            del environ[key]


def lane_of(text: str, memory: str | None = None) -> str | None:
    """The UCX transport of the last remote-read protocol table in a UCX_PROTO_INFO log
    (e.g. 'cuda_ipc', 'rc_mlx5', 'cma', 'tcp'); tables for reads into `memory` ('host',
    'cuda') are preferred where there are any."""
    lines = text.splitlines()
    found: str | None = None
    found_any: str | None = None
    for i, line in enumerate(lines):
        if _READ_TABLE not in line:
            continue
        for row in lines[i + 1: i + 12]:
            m = _LANE.search(row)
            if m and m.group(1) not in ("Range", "Config"):
                found_any = m.group(1)
                if memory is None or f"into {memory} memory" in line:
                    found = m.group(1)
                break
    return found or found_any


class UcxLog:
    """Reads a UCX log file (pattern with `%p`, or a name whose rotated siblings share its
    prefix) incrementally: the lane of the latest remote-read table, and UCX's own warnings."""

    def __init__(self, pattern: str, memory: str | None = None) -> None:
        self.pattern = pattern.replace("%p", str(os.getpid()))
        self.memory = memory
        self._offsets: dict[str, int] = {}
        self._text = ""  # read so far (tables are printed once per endpoint configuration)
        self.lane: str | None = None

    def refresh(self) -> str | None:
        """Read what UCX appended since the last call; returns the lane (or None)."""
        ctypes.CDLL(None).fflush(None)  # UCX writes through stdio: flush every C stream first
        new = []
        for path in sorted(glob.glob(glob.escape(self.pattern) + "*")):
            try:
                with open(path, errors="replace") as f:
                    f.seek(self._offsets.get(path, 0))
                    chunk = f.read()
                    self._offsets[path] = f.tell()
            except OSError:
                continue
            new.append(chunk)
        text = "".join(new)
        if text:
            for line in text.splitlines():
                if _PROBLEM.search(line) and "|" not in line:
                    log.warning("ucx: %s", line.strip()[:500])
            self._text = (self._text + text)[-(1 << 20):]  # bounded
            self.lane = lane_of(self._text, self.memory) or self.lane
        return self.lane


class UcxEnvironment:
    """The decided settings, applied to a process environment for one transport's lifetime:
    `enter` before the agent is made, `exit` when it is gone (restores the environment and
    removes the private log directory)."""

    def __init__(self, environ: dict[str, str]) -> None:
        self.environ = environ
        self.settings: UcxSettings | None = None
        self.log: UcxLog | None = None
        self._log_dir: str | None = None

    def enter(self, net_devices: str | None, vram: bool, proto_log: str | None) -> None:
        if proto_log is None and "UCX_LOG_FILE" not in self.environ:
            self._log_dir = tempfile.mkdtemp(prefix="tandem-ucx-")
        self.settings = decide(self.environ, net_devices, vram, proto_log, self._log_dir)
        apply(self.settings, self.environ)
        if self.settings.log_file:
            self.log = UcxLog(self.settings.log_file, "cuda" if vram else "host")

    def exit(self) -> None:
        if self.settings is not None:
            restore(self.settings, self.environ)
            self.settings = None
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)  # UCX keeps its open descriptor
            self._log_dir = None
