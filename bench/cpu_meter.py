"""CPU accounting for the benchmarks: a process's CPU seconds and run-queue waits from /proc,
this process's own CPU time, and what this machine's cores are worth when all are busy."""

from __future__ import annotations

import os
import resource
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spin(n: int) -> float:
    t, x = time.perf_counter(), 0
    for i in range(n):
        x += i
    return time.perf_counter() - t


def host_capacity(cores: int, loops: int = 20_000_000) -> float:
    """This machine's cores as single-process speed when all of them are busy: `cores` busy
    processes at once against one alone. SMT siblings, shared caches or a shared hypervisor make
    it less than the core count (seen here: 2 cores worth ~1.55)."""
    with ProcessPoolExecutor(cores) as pool:
        list(pool.map(_spin, [loops // 10] * cores))  # start the processes, warm them up
        alone = pool.submit(_spin, loops).result()
        together = list(pool.map(_spin, [loops] * cores))
    return min(float(cores), cores * alone / statistics.fmean(together))


def run_queue(pid: int) -> tuple[float, int]:
    """Seconds a process's threads (those alive) spent runnable but waiting for a core, and how
    many times they were switched in: /proc/<pid>/task/*/schedstat."""
    wait, switches = 0, 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            _, waited, slices = (int(x) for x in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue  # the thread ended, or no schedstats in this kernel
        wait, switches = wait + waited, switches + slices
    return wait / 1e9, switches


def own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
