"""A streaming load that checks every answer, for the lifecycle tests and the rolling-restart
soak (bench/rolling_restart.py): no request may fail, no token may be lost or repeated."""

from __future__ import annotations

import json
import threading

import httpx


class StreamingLoad:
    """Clients that stream greedy completions through a router until stopped, each answer checked
    against the same prompt's answer taken before the load: a failure is an HTTP error, an error
    event or a stream without `[DONE]`; a mismatch is a token lost, repeated or changed."""

    def __init__(self, url: str, model: str, num_clients: int = 3, num_prompts: int = 6,
                 max_tokens: int = 40) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.prompts = [f"Stream number {i} tells a story about" for i in range(num_prompts)]
        self.num_clients = num_clients
        self.want: dict[str, str] = {}
        self.num_ok = 0
        self.failures: list[str] = []
        self.mismatches: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _body(self, prompt: str, stream: bool) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": stream}

    def start(self) -> StreamingLoad:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            for p in self.prompts:
                r = c.post("/v1/completions", json=self._body(p, False))
                r.raise_for_status()
                self.want[p] = r.json()["choices"][0]["text"]
        for i in range(self.num_clients):
            t = threading.Thread(target=self._client, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _client(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            n = i
            while not self._stop.is_set():
                prompt = self.prompts[n % len(self.prompts)]
                n += self.num_clients
                try:
                    text, done = self._one(c, prompt)
                except Exception as e:  # noqa: BLE001 - every failure is a finding
                    self.failures.append(f"{prompt!r}: {type(e).__name__}: {e}")
                    continue
                if not done:
                    self.failures.append(f"{prompt!r}: stream ended without [DONE]")
                elif text != self.want[prompt]:
                    self.mismatches.append(f"{prompt!r}: {text!r} != {self.want[prompt]!r}")
                else:
                    self.num_ok += 1

    def _one(self, c: httpx.Client, prompt: str) -> tuple[str, bool]:
        text, done = "", False
        with c.stream("POST", "/v1/completions", json=self._body(prompt, True)) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                text += "".join(ch.get("text", "") for ch in event.get("choices", []))
        return text, done

    def stop(self) -> dict:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        return {"ok": self.num_ok, "failures": self.failures, "mismatches": self.mismatches}
