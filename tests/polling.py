"""Waiting on a condition in the real-process tests."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """`predicate()`'s first truthy value within `timeout` seconds; AssertionError naming
    `what` if none came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")
