"""A streamed OpenAI response: SSE chunks for each of a request's `n` choices (interleaved as
their tokens arrive, each chunk naming its choice by `index`), stop strings cut on the text,
logprobs, tool-call deltas, the `tandem` timing field on each choice's last chunk, usage, and
`[DONE]`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing

import anyio
from starlette.responses import StreamingResponse

from common.errors import APIError
from common.openai_response import chunk_choice, envelope, usage
from common.protocol import TokenLogprob
from common.stops import StopCut
from common.streams import prepend
from common.tool_calls import ToolCalls, ToolStream
from router.gateway import Gateway
from router.models import ServedModel
from router.open_streams import DRAIN_ENDED, OpenStreams
from router.openai_format import (
    chat_logprobs,
    completion_logprobs,
    sse_data,
    timing_field,
    wants_logprobs,
)

log = logging.getLogger(__name__)

# Frames buffered per choice between its worker stream and the client: past this a choice waits
# (backpressure up to the worker), instead of the router buffering n x max_tokens frames.
FRAMES_PER_CHOICE = 32


class DeadlineStreamingResponse(StreamingResponse):
    """A stream whose every write must complete within `write_timeout_s`: a client that stops
    reading is cut, and its admission slot and worker streams are freed, instead of holding
    them for as long as its TCP window stays shut. One still open when the router's drain ends
    (`open_streams.end_all`) ends with an error event and `[DONE]`, not a silent close."""

    def __init__(self, content, *, write_timeout_s: float, open_streams: OpenStreams,
                 **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout_s = write_timeout_s
        self.open_streams = open_streams
        self.timed_out = False

    async def stream_response(self, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            until_drain_end = asyncio.timeout(None)
            try:
                async with until_drain_end:
                    with self.open_streams.track(until_drain_end):
                        if not await self._relay(send):
                            return
            except TimeoutError:
                if not until_drain_end.expired():
                    raise
                log.warning("the router's drain ended with this stream open: ended with an error")
                if not await self._write(send, DRAIN_ENDED):
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with anyio.CancelScope(shield=True):  # the slot and worker streams go now, not at GC
                await self.body_iterator.aclose()

    async def _relay(self, send) -> bool:
        """Every chunk of the body; False: the client read nothing in time (cut)."""
        async for chunk in self.body_iterator:
            if not await self._write(send, chunk):
                return False
        return True

    async def _write(self, send, chunk: bytes) -> bool:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            return True
        except TimeoutError:
            self.timed_out = True
            log.warning("a streaming client read nothing for %.0f s: stream cut",
                        self.write_timeout_s)
            return False


class ChoiceStream:
    """The chunks of one choice."""

    def __init__(self, gw: Gateway, served: ServedModel, body, chat: bool, rid: str, created: int,
                 index: int, t_start: float) -> None:
        self.gw, self.served, self.body, self.chat = gw, served, body, chat
        self.rid, self.created, self.index, self.t_start = rid, created, index, t_start
        self.want_lp = wants_logprobs(body, chat)
        self.pending_lps: list[TokenLogprob] = []  # logprobs that go out with the next chunk
        self.lp_offset = 0  # completions' text_offset runs on across chunks
        tools = ToolCalls.for_request(body, chat, gw.settings.tool_call_parser)
        self.tools = ToolStream(tools) if tools is not None else None
        self.num_output = 0
        self.trace = None

    def token_text(self, token_id: int) -> str:
        return self.served.tokenizer.decode([token_id], skip_special_tokens=False)

    def chunk(self, delta: str, finish: str | None) -> dict:
        lp = None
        if self.want_lp and self.pending_lps:
            lp = (chat_logprobs(self.pending_lps, self.token_text) if self.chat
                  else completion_logprobs(self.pending_lps, self.token_text, self.lp_offset))
            if not self.chat:
                self.lp_offset += sum(len(t) for t in lp["tokens"])
            self.pending_lps.clear()
        c = chunk_choice(delta, finish, self.chat, lp)
        c["index"] = self.index
        return envelope(self.rid, self.chat, self.created, self.body.model, [c], stream=True)

    async def frames(self, first, events) -> AsyncIterator[bytes]:
        """SSE frames from the role chunk to the last chunk (with its finish reason)."""
        metrics, label = self.gw.metrics, self.served.name
        if self.chat:
            role = self.chunk("", None)
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield sse_data(role)
        stream = self.served.tokenizer.decode_stream()
        stops = StopCut(self.body.stop)  # each piece of text scanned once: linear in the stream
        finish, last_t = None, None
        async for ev, self.trace in prepend([] if first is None else [first], events):
            now = time.perf_counter()
            if last_t is None:
                metrics.ttft.labels(label).observe(now - self.t_start)
            else:
                metrics.itl.labels(label).observe(now - last_t)
            last_t = now
            self.num_output += len(ev.token_ids)
            self.pending_lps.extend(ev.logprobs or [])
            piece, stopped = stops.feed("".join(stream.step(t) for t in ev.token_ids),
                                        final=bool(ev.finish_reason))
            finish = "stop" if stopped else ev.finish_reason
            if piece:
                if self.tools is None:
                    yield sse_data(self.chunk(piece, None))
                else:
                    for data in self._tool_frames(self.tools.feed(piece)):
                        yield data
            if finish:
                break
        if self.tools is not None:
            for data in self._tool_frames(self.tools.finish()):
                yield data
            if self.tools.num_calls:
                finish = "tool_calls"
        final = self.chunk("", finish or "stop")
        final["tandem"] = timing_field(self.trace, self.t_start, self.gw.settings.expose_worker_ids)
        yield sse_data(final)

    def _tool_frames(self, out: tuple[str, list[dict]]):
        content, deltas = out
        if content:
            yield sse_data(self.chunk(content, None))
        if deltas:
            frame = self.chunk("", None)
            frame["choices"][0]["delta"] = {"tool_calls": deltas}
            yield sse_data(frame)


async def sse(gw: Gateway, served: ServedModel, starts: list, body, chat: bool, rid: str,
              created: int, prompt: list[int], t_start: float, slot: AsyncExitStack):
    """The whole response; `starts` is each choice's (first event, rest of its events)."""
    metrics, label = gw.metrics, served.name
    choices = [ChoiceStream(gw, served, body, chat, rid, created, i, t_start)
               for i in range(len(starts))]
    try:
        try:
            parts = [c.frames(first, events)
                     for c, (first, events) in zip(choices, starts, strict=True)]
            merged = parts[0] if len(parts) == 1 else _interleave(parts)
            # Closed before the slot (below): a cut stream's choices stop reading their worker
            # streams first, so closing those finds no generator still running.
            async with aclosing(merged):
                async for data in merged:
                    yield data
            n_out = sum(c.num_output for c in choices)
            if body.stream_options and body.stream_options.include_usage:
                trace = choices[0].trace
                yield sse_data(envelope(rid, chat, created, body.model, [], stream=True,
                                        usage_=usage(len(prompt), n_out,
                                                     trace.num_cached_tokens if trace else None)))
            yield b"data: [DONE]\n\n"
            metrics.count(200, label)
            metrics.completion_tokens.labels(label).inc(n_out)
            metrics.latency.labels(label).observe(time.perf_counter() - t_start)
            for c in choices:
                gw.observe_trace(c.trace)
        except APIError as e:
            metrics.count(e.status, label)
            yield sse_data({"error": {"message": e.message, "type": "server_error",
                                      "code": e.code}})
            yield b"data: [DONE]\n\n"
    finally:
        await slot.aclose()  # closes every worker stream (a client gone aborts both legs)


async def _interleave(parts: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """Frames of several choices in the order they are ready; the first error ends them all."""
    queue: asyncio.Queue = asyncio.Queue(FRAMES_PER_CHOICE * len(parts))
    done = object()

    async def pump(part: AsyncIterator[bytes]) -> None:
        try:
            async for data in part:
                await queue.put(data)
            await queue.put(done)
        except asyncio.CancelledError:
            raise  # the consumer is gone (a full queue would hold this task forever)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(e)

    tasks = [asyncio.create_task(pump(p)) for p in parts]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in parts:
            await p.aclose()
