"""Large buffers go back to the system when they are freed (glibc; elsewhere nothing changes).

glibc serves an allocation above its mmap threshold from a mapping of its own, unmapped when
freed, but it raises that threshold to the size of every such block freed (up to 32 MiB). After
the first batch of a few MiB, every later one came from the heap, whose free space glibc seldom
returns: under a flood of 15 MiB batches the bridge peaked ~150 MiB above its baseline and kept
~115 MiB it no longer used; with the threshold fixed, ~85 and ~20 (tests/vllm_bridge/
test_bridge_flood.py). Called once by `tandem vllm-bridge` (tandem/commands.py).
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def unmap_large_buffers() -> bool:
    """Fix this process's mmap threshold at 1 MiB; False where the C library has no mallopt."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
