"""What bench/vllm_routing.py sends and counts: the multi-turn load spread over several
endpoints, the ideal's floor from token counts, and a tally of the KV events the servers publish
(how many bytes and blocks a `kv_cache_report_mode: full` run adds)."""

from __future__ import annotations

import threading

import httpx
import msgspec
import zmq

from loadgen.runner import RequestRecord, RunConfig, Runner
from loadgen.workload import Session


class SpreadRunner(Runner):
    """loadgen's closed loop over several endpoints: turn i of conversation s goes to endpoint
    (s + i) % n (router replicas: no replica sees a whole conversation), or with `sticky` to
    endpoint s % n (each conversation pinned to one server: the ideal)."""

    def __init__(self, config: RunConfig, urls: list[str], sticky: bool = False) -> None:
        super().__init__(config)
        self.urls = urls
        self.sticky = sticky

    async def _session(self, http: httpx.AsyncClient, s: Session) -> None:
        clients = [httpx.AsyncClient(base_url=u, timeout=self.config.timeout_s) for u in self.urls]
        try:
            messages = [{"role": "system", "content": s.system}] if s.system else []
            for i, turn in enumerate(s.turns):
                messages.append({"role": "user", "content": turn.user})
                client = clients[(s.session_id + (0 if self.sticky else i)) % len(clients)]
                rec, text = await self._one(client, s.session_id, i, messages, turn.max_tokens)
                self.records.append(rec)
                if rec.error:
                    return
                messages.append({"role": "assistant", "content": text})
        finally:
            for c in clients:
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


class EventTally:
    """Counts one server's KV event batches as a second subscriber: payload bytes and the
    blocks named in BlockStored events (re-reported ones included)."""

    def __init__(self, endpoint: str) -> None:
        self.num_bytes = 0
        self.num_stored_blocks = 0
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def snapshot(self) -> tuple[int, int]:
        return self.num_bytes, self.num_stored_blocks

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            self.num_bytes += len(frames[-1])
            _ts, events, *_ = msgspec.msgpack.decode(frames[-1])
            self.num_stored_blocks += sum(len(e.get("block_hashes", ())) for e in events
                                          if isinstance(e, dict) and e.get("type") == "BlockStored")
