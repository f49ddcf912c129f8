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


def test_a_stream_open_when_the_drain_ends_gets_an_error_event_and_done():
    """The router's drain ran out (`OpenStreams.end_all`) with a stream still open: it ends with
    an OpenAI error event, `[DONE]` and the response's end, and its source is closed. Before,
    uvicorn's shutdown cancelled it and closed the connection with neither (a silent cut); one
    that opens after the drain ended ends at once."""
    from router.open_streams import DRAIN_ENDED, OpenStreams
    from router.sse import DeadlineStreamingResponse

    async def one(streams: OpenStreams, end_after_first: bool) -> tuple[list[dict], Source]:
        source, sent = Source(1), []

        async def send(message: dict) -> None:
            sent.append(message)

        response = DeadlineStreamingResponse(source.frames(), write_timeout_s=5,
                                             open_streams=streams)
        task = asyncio.create_task(response.stream_response(send))
        if end_after_first:
            while len(sent) < 2:  # the start and the first frame went out
                await asyncio.sleep(0.01)
            streams.end_all()
        await asyncio.wait_for(task, 5)  # hung until uvicorn's deadline before
        return sent, source

    async def main():
        streams = OpenStreams()
        for end_after_first in (True, False):  # the second opens after the drain ended
            sent, source = await one(streams, end_after_first)
            bodies = [(m.get("body"), m.get("more_body")) for m in sent[1:]]
            assert bodies[-2:] == [(DRAIN_ENDED, True), (b"", False)], bodies
            assert b'"code":"draining"' in DRAIN_ENDED and DRAIN_ENDED.endswith(b"[DONE]\n\n")
            assert source.closed

    asyncio.run(main())
