"""Sends a workload to an OpenAI-compatible endpoint, streaming, open-loop (sessions arrive as a
Poisson process at `rate`) or closed-loop (`concurrency` sessions in flight), and records one
`RequestRecord` per request."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from loadgen.workload import Session


@dataclass
class RequestRecord:
    session_id: int
    turn: int
    start: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    # the router's `tandem` field: plan, cached tokens, where the time went
    timing: dict | None = None

    @property
    def plan(self) -> str | None:
        return self.timing.get("plan") if self.timing else None

    @property
    def server_ttft_s(self) -> float | None:
        """The router's own first-token time (Tandem routers only)."""
        return self.timing.get("first_token_s") if self.timing else None


@dataclass
class RunConfig:
    base_url: str
    model: str
    api_key: str | None = None
    rate: float | None = None  # sessions per second (open loop)
    concurrency: int | None = None  # sessions in flight (closed loop)
    timeout_s: float = 120.0
    seed: int = 0


class Runner:
    def __init__(self, config: RunConfig) -> None:
        if (config.rate is None) == (config.concurrency is None):
            raise ValueError("give exactly one of rate (open loop) or concurrency (closed loop)")
        self.config = config
        self.records: list[RequestRecord] = []
        self._done = 0
        self._total = 0

    async def run(self, sessions: list[Session]) -> list[RequestRecord]:
        c = self.config
        self._total = sum(len(s.turns) for s in sessions)
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=c.base_url.rstrip("/"), headers=headers,
                                     timeout=c.timeout_s, limits=limits) as http:
            if c.rate is not None:
                rng = random.Random(c.seed)
                tasks = []
                for s in sessions:
                    tasks.append(asyncio.create_task(self._session(http, s)))
                    await asyncio.sleep(rng.expovariate(c.rate))
                await asyncio.gather(*tasks)
            else:
                queue: asyncio.Queue[Session] = asyncio.Queue()
                for s in sessions:
                    queue.put_nowait(s)

                async def loop() -> None:
                    while not queue.empty():
                        await self._session(http, queue.get_nowait())

                await asyncio.gather(*[loop() for _ in range(c.concurrency)])
        print(file=sys.stderr)
        return self.records

    async def run_round_robin(self, sessions: list[Session],
                              shuffle_seed: int | None = None) -> list[RequestRecord]:
        """Sessions visited round-robin: turn t of every session before turn t+1 of any, at most
        `concurrency` requests in flight, so a session comes back only after every other one ran
        (the traffic that outgrows a worker's KV cache). With `shuffle_seed` each round visits the
        sessions in another seeded order. A session whose answer failed sends no more turns."""
        c = self.config
        if c.concurrency is None:
            raise ValueError("round-robin runs are closed loop: give concurrency")
        self._total = sum(len(s.turns) for s in sessions)
        rng = random.Random(shuffle_seed)
        history = {s.session_id: [{"role": "system", "content": s.system}] if s.system else []
                   for s in sessions}
        failed: set[int] = set()
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        async with httpx.AsyncClient(base_url=c.base_url.rstrip("/"), headers=headers,
                                     timeout=c.timeout_s) as http:
            slots = asyncio.Semaphore(c.concurrency)

            async def visit(s: Session, i: int) -> None:
                async with slots:
                    messages = history[s.session_id]
                    messages.append({"role": "user", "content": s.turns[i].user})
                    rec, text = await self._one(http, s.session_id, i, messages,
                                                s.turns[i].max_tokens)
                self.records.append(rec)
                if rec.error:
                    failed.add(s.session_id)
                messages.append({"role": "assistant", "content": text})

            for i in range(max((len(s.turns) for s in sessions), default=0)):
                due = [s for s in sessions if i < len(s.turns) and s.session_id not in failed]
                if shuffle_seed is not None:
                    rng.shuffle(due)
                # Started in order: the semaphore admits them first come, first served.
                await asyncio.gather(*[visit(s, i) for s in due])
        return self.records

    async def _session(self, http: httpx.AsyncClient, s: Session) -> None:
        messages = [{"role": "system", "content": s.system}] if s.system else []
        for i, turn in enumerate(s.turns):
            messages.append({"role": "user", "content": turn.user})
            rec, text = await self._one(http, s.session_id, i, messages, turn.max_tokens)
            self.records.append(rec)
            self._done += 1
            if self._done % max(1, self._total // 20) == 0 or self._done == self._total:
                print(f"\r[bench] {self._done}/{self._total} requests", end="",
                      file=sys.stderr, flush=True)
            if rec.error:
                return  # the rest of this conversation depends on the lost answer
            messages.append({"role": "assistant", "content": text})

    async def _one(self, http, session_id, turn, messages, max_tokens) -> tuple[RequestRecord, str]:
        body = {"model": self.config.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        rec = RequestRecord(session_id, turn, time.perf_counter())
        parts: list[str] = []
        last = None
        try:
            # base_url is the OpenAI base URL (".../v1"), as for the openai client.
            async with http.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        code = json.loads(raw)["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        code = None
                    rec.error = f"HTTP {r.status_code}" + (f" {code}" if code else "")
                    rec.e2e_s = time.perf_counter() - rec.start
                    return rec, ""
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        rec.error = ev["error"].get("code") or "stream error"
                        break
                    if ev.get("usage"):
                        rec.completion_tokens = ev["usage"]["completion_tokens"]
                        rec.prompt_tokens = ev["usage"]["prompt_tokens"]
                    if ev.get("tandem"):
                        rec.timing = ev["tandem"]
                    for ch in ev.get("choices", []):
                        content = (ch.get("delta") or {}).get("content")
                        if content:
                            now = time.perf_counter()
                            if last is None:
                                rec.ttft_s = now - rec.start
                            else:
                                rec.itl_s.append(now - last)
                            last = now
                            parts.append(content)
        except httpx.HTTPError as e:
            rec.error = type(e).__name__
        rec.e2e_s = time.perf_counter() - rec.start
        if rec.error is None and rec.ttft_s is None:
            rec.ttft_s = rec.e2e_s  # an empty answer: the first (and last) event is the end
        return rec, "".join(parts)
