"""Closing a stream of several choices (router/sse.py `_interleave`), as a write deadline does
when its client reads nothing: every choice's task ends and every choice's source is closed,
whether the task was waiting on a full queue or on a silent worker stream.

Before, a task cancelled while its queue was full caught the cancellation and waited on the
queue forever, and a source still being read could not be closed ("aclose(): asynchronous
generator is already running"), so its worker stream stayed open."""

from __future__ import annotations

import asyncio

from router.sse import FRAMES_PER_CHOICE, _interleave


class Source:
    """A choice's events: `n` frames, then silence (a parked generation) until closed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False

    async def frames(self):
        try:
            for i in range(self.n):
                yield f"frame {i}".encode()
            await asyncio.Event().wait()  # silent, as a parked worker stream
        finally:
            self.closed = True


def test_closing_ends_every_choice_task_and_closes_every_source():
    async def main():
        busy, silent = Source(10 * FRAMES_PER_CHOICE), Source(0)
        merged = _interleave([busy.frames(), silent.frames()])
        assert (await anext(merged)).startswith(b"frame")
        await asyncio.sleep(0.05)  # the busy choice fills the queue and waits on it
        before = set(asyncio.all_tasks())
        await asyncio.wait_for(merged.aclose(), 5)  # hung forever before
        assert busy.closed and silent.closed
        assert all(t.done() for t in before if t is not asyncio.current_task())

    asyncio.run(main())
