"""What every benchmark result says about itself: the commit it measured (and whether the tree
had uncommitted changes), the machine (CPU model, cores, memory, GPU), the command and the time,
so a figure in the docs can be traced to the run behind it. Every result file a bench script
writes goes through `write_result` (tests/test_bench_provenance.py checks that none is written
another way)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def _gpu() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return out.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(command: str | None = None) -> dict:
    """The `provenance` field of a result file. `command` is the command that ran, when it is not
    this process's own (a shell script that merges what its steps wrote)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "command": command or shlex.join([Path(sys.executable).name, *sys.argv]),
        "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
                    "gpu": _gpu(), "load_average": os.getloadavg()},
    }


def write_result(path: str | Path, result: dict, *, indent: int | None = 2) -> Path:
    """Writes `result` as JSON at `path` (its folder made if missing), `provenance` first and
    then `result`'s own keys unchanged; returns the path. A script that rewrites its file after
    each measurement calls it each time (the provenance is then that of the latest write)."""
    if "provenance" in result:
        raise ValueError("the result already has a provenance: write_result adds it")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"provenance": provenance(), **result}, indent=indent) + "\n")
    return path
