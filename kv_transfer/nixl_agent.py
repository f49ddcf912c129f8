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
# Poll a running transfer in back-to-back bursts this long (an H200 READs ~4 GB in it), then every
# poll interval: the spin holds the GIL in bursts, which a co-located engine thread waits behind.
SPIN_S = 0.01
BURST_S = 0.0002  # the longest one poll holds the event loop
NOTIF_PREFIX = b"tandem:done:"  # + request id: the receiver has the blocks, free the lease


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
        return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False,
                                                            backends=["UCX"]))

    class WaitingConfig(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, PROGRESS_WAIT_US if key == "pthrDelay" else value)

    bind.nixlAgentConfig = WaitingConfig  # only while this agent is made
    try:
        return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=True,
                                                            backends=["UCX"]))
    finally:
        bind.nixlAgentConfig = base


async def wait_xfer(agent, handle, timeout_s: float, poll_interval_s: float, what: str) -> None:
    """Post `handle` and return once it is DONE; TransferTimeout / TransferError otherwise."""
    await finish_xfer(agent, handle, agent.transfer(handle), timeout_s, poll_interval_s, what)


async def finish_xfer(agent, handle, state: str, timeout_s: float, poll_interval_s: float,
                      what: str) -> None:
    """Return once the posted `handle` (whose post returned `state`) is DONE."""
    if state == "PROC":
        state = await _until_done(agent, handle, timeout_s, poll_interval_s, what)
    if state != "DONE":
        raise TransferError(f"{what} failed (state {state})")


async def _until_done(agent, handle, timeout_s: float, poll_interval_s: float, what: str) -> str:
    """Polls `handle` until it leaves PROC. For the first `SPIN_S` it checks back to back in
    bursts of `BURST_S`, yielding one turn of the event loop between bursts (`sleep(0)`): an
    `asyncio.sleep` of less than a millisecond sleeps a whole one (epoll's timeout is in ms), which
    put up to ~1.3 ms on a 4 ms READ (issue 30, H200). Longer transfers are polled each interval."""
    now = time.monotonic()
    spin_until, deadline = now + SPIN_S, now + timeout_s
    while True:
        burst_until = time.monotonic() + BURST_S  # a burst first: small READs end within it
        state = agent.check_xfer_state(handle)
        while state == "PROC" and time.monotonic() < burst_until:
            state = agent.check_xfer_state(handle)
        if state != "PROC":
            return state
        now = time.monotonic()
        if now > deadline:
            raise TransferTimeout(f"{what} timed out after {timeout_s} s")
        await asyncio.sleep(0 if now < spin_until else poll_interval_s)


def done_request_ids(notifs: dict[str, list[bytes]], errors) -> list[str]:
    """The request ids of `done` notifications (NIXL's get_new_notifs()). Any peer that loaded
    our metadata can send anything: a bad message is skipped and counted in `errors`
    (common.background.BackgroundErrors), never the end of the lease watcher."""
    done: list[str] = []
    for messages in notifs.values():
        for msg in messages:
            if not msg.startswith(NOTIF_PREFIX):
                errors.record("kv_notifications", f"unknown notification {msg[:64]!r}")
                continue
            try:
                done.append(msg[len(NOTIF_PREFIX):].decode("ascii"))
            except UnicodeDecodeError:
                errors.record("kv_notifications", f"undecodable notification {msg[:64]!r}")
    return done
