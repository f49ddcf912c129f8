"""What bench/vllm_routing.py sends and counts: the multi-turn load spread over several
endpoints, the ideal's floor from token counts, and a tally of the KV events the servers publish
(how many bytes and blocks a `kv_cache_report_mode: full` run adds), and the scenarios: traffic
that bypasses the router and a restart in the middle of the run."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadgen.runner import RequestRecord, RunConfig, Runner
from loadgen.workload import Session
from testing.processes import ROOT, free_port
from testing.vllm_fleet import EventTap
from testing.vllm_server import MODEL


@dataclass(frozen=True)
class Scenario:
    """What happens to a run: `routers` replicas of the arm's router; `out_of_band`: each
    conversation's odd turns go straight to a server of the client's own choosing (seeded, the
    same in every arm), as another client or router of the fleet would send them; `pause`:
    when the middle conversation reaches its middle turn the load pauses, in-flight requests
    finish and `"server"`
    restarts the second vLLM server or `"router"` restarts the arm's routers, then it resumes."""

    routers: int = 1
    out_of_band: bool = False
    pause: str | None = None


class MidRunPause:
    """Runs `action` (blocking, in a thread) when conversation `at[0]` is about to send its turn
    `at[1]`, once the requests in flight have finished; every request after that waits for it.
    A point in the middle of conversations (the others in flight are mid-way too), the same in
    every arm."""

    def __init__(self, at: tuple[int, int], action: Callable[[], None]) -> None:
        self.at, self.action = at, action
        self.num_in_flight = 0
        self._firing = False
        self._done = asyncio.Event()

    async def enter(self, session_id: int, turn: int) -> None:
        if (session_id, turn) == self.at and not self._firing:
            self._firing = True
            while self.num_in_flight:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self.action)
            self._done.set()
        elif self._firing:
            await self._done.wait()
        self.num_in_flight += 1

    def exit(self) -> None:
        self.num_in_flight -= 1


class SpreadRunner(Runner):
    """loadgen's closed loop over several endpoints. Through routers (`urls`, replaceable while
    paused): turn i of conversation s goes to router (s + i) % n, so no replica sees a whole
    conversation. `sticky` (the ideal, `urls` are the servers): turn 0 to server s % n, every
    later turn to the server of the turn before. With `out_of_band_servers`, odd turns go to a
    server drawn from (seed, s, i) instead, whatever the arm."""

    def __init__(self, config: RunConfig, urls: list[str], sticky: bool = False,
                 out_of_band_servers: list[str] | None = None,
                 pause: MidRunPause | None = None) -> None:
        super().__init__(config)
        self.urls = urls
        self.sticky = sticky
        self.out_of_band_servers = out_of_band_servers
        self.pause = pause

    def _url(self, s: int, i: int, previous: str | None) -> str:
        if self.out_of_band_servers and i % 2 == 1:
            rng = random.Random(f"{self.config.seed}-{s}-{i}")
            return self.out_of_band_servers[rng.randrange(len(self.out_of_band_servers))]
        if self.sticky:
            return previous or self.urls[s % len(self.urls)]
        return self.urls[(s + i) % len(self.urls)]

    async def _session(self, http: httpx.AsyncClient, s: Session) -> None:
        clients: dict[str, httpx.AsyncClient] = {}
        try:
            messages = [{"role": "system", "content": s.system}] if s.system else []
            url = None
            for i, turn in enumerate(s.turns):
                messages.append({"role": "user", "content": turn.user})
                if self.pause:
                    await self.pause.enter(s.session_id, i)
                try:
                    url = self._url(s.session_id, i, url)
                    if url not in clients:
                        clients[url] = httpx.AsyncClient(base_url=url,
                                                         timeout=self.config.timeout_s)
                    rec, text = await self._one(clients[url], s.session_id, i, messages,
                                                turn.max_tokens)
                finally:
                    if self.pause:
                        self.pause.exit()
                self.records.append(rec)
                if rec.error:
                    return
                messages.append({"role": "assistant", "content": text})
        finally:
            for c in clients.values():
                await c.aclose()


def prev_prompt_hits(records: list[RequestRecord], block_size: int) -> int:
    """Every turn after the first hits its previous prompt's full blocks (vLLM computes at
    least the last prompt token, so at most (len - 1) // block_size of them). A floor: the
    blocks the previous answer filled hit too where the next prompt repeats its tokens."""
    by_session: dict[int, list[RequestRecord]] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    total = 0
    for recs in by_session.values():
        recs.sort(key=lambda r: r.turn)
        for prev, cur in zip(recs, recs[1:], strict=False):
            total += min(prev.prompt_tokens // block_size,
                         (cur.prompt_tokens - 1) // block_size) * block_size
    return total


class EventTally(EventTap):
    """Counts one server's KV event batches as a second subscriber: payload bytes and the
    blocks named in BlockStored events (re-reported ones included)."""

    def __init__(self, endpoint: str) -> None:
        self.num_bytes = 0
        self.num_stored_blocks = 0
        super().__init__(endpoint)

    def snapshot(self) -> tuple[int, int]:
        return self.num_bytes, self.num_stored_blocks

    def on_batch(self, seq: int, payload: bytes, events: list) -> None:
        self.num_bytes += len(payload)
        self.num_stored_blocks += sum(len(e.get("block_hashes", ())) for e in events
                                      if isinstance(e, dict) and e.get("type") == "BlockStored")


class VLLMRouterProc:
    """A `vllm-router` process over the two servers."""

    def __init__(self, servers: list, policy: str, log_dir: Path, block_size: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(ROOT / ".venv" / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port",
               str(self.port), "--policy", policy, "--worker-urls", *[s.url for s in servers],
               "--prometheus-port", str(free_port())]
        if policy == "kv_aware":
            for s in servers:
                cmd += ["--kv-event-source", f"{s.url}={s.events_endpoint}",
                        "--kv-event-replay-source", f"{s.url}={s.replay_endpoint}"]
            cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", MODEL]
        self.log = open(log_dir / f"vllm-router-{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start; see {self.log.name}")
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.log.close()
