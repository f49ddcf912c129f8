"""Finding NIXL and making its agent.

The agent runs NIXL's progress thread with a wait: between bursts it sleeps in `poll` on the
UCX worker's event descriptor (woken by any arriving message) for up to `PROGRESS_WAIT_US`.
NIXL's Python API always asks for a wait of 0, which spins a core at 100% while idle; without
the thread, a sender made progress only when its lease watcher polled (every millisecond at
best), and a READ that carries a notification, or follows one on the same connection, waited
for that: about 1.2 ms of a 1-block pull's 1.3 ms (bench/kv_transfer.py). With the waiting
thread the sender's side costs ~0.6% of a core idle and answers at once.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time

from kv_transfer.transport import TransferError, TransferTimeout

log = logging.getLogger(__name__)

_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
PROGRESS_WAIT_US = 100_000
SPIN_S = 0.002  # poll a running transfer back to back this long, then every poll interval
BURST_S = 0.0002  # the longest one poll holds the event loop


def import_nixl():
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "nixl_agent"):
            return mod
    return None


def nixl_available() -> bool:
    return import_nixl() is not None


def make_agent(nixl, name: str):
    """A UCX agent named `name` with a waiting progress thread (see above), or, where this
    NIXL's bindings are not as expected, one without a progress thread (correct, slower)."""
    bind = getattr(getattr(nixl, "_api", None), "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None:
        log.warning("nixl: cannot set the progress thread's wait; running without the thread")
        return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))

    class WaitingConfig(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, PROGRESS_WAIT_US if key == "pthrDelay" else value)

    bind.nixlAgentConfig = WaitingConfig  # only while this agent is made
    try:
        return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    finally:
        bind.nixlAgentConfig = base


async def wait_xfer(agent, handle, timeout_s: float, poll_interval_s: float, what: str) -> None:
    """Post `handle` and return once it is DONE; TransferTimeout / TransferError otherwise."""
    state = agent.transfer(handle)
    now = time.monotonic()
    spin_until, deadline = now + SPIN_S, now + timeout_s
    # Back to back first: a 1-block READ on cuda_ipc is done in tens of microseconds.
    while state == "PROC" and time.monotonic() < spin_until:
        state = agent.check_xfer_state(handle)
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TransferTimeout(f"{what} timed out after {timeout_s} s")
        await asyncio.sleep(poll_interval_s)
        # Each check drives UCX a little (a few descriptors of a scattered read): a burst of
        # checks per turn of the event loop, not one.
        burst_until = time.monotonic() + BURST_S
        state = agent.check_xfer_state(handle)
        while state == "PROC" and time.monotonic() < burst_until:
            state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise TransferError(f"{what} failed (state {state})")
