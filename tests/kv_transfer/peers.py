"""Starting and driving `peer.py` processes (optionally inside a network namespace)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.kv_transfer.peer import PREFIX

ROOT = Path(__file__).resolve().parents[2]


class Peer:
    def __init__(self, transport: str, engine_id: str, *, netns: str | None = None,
                 env: dict | None = None, **options) -> None:
        cmd = [sys.executable, "-m", "tests.kv_transfer.peer", "--transport", transport,
               "--engine-id", engine_id]
        for key, value in options.items():
            if value is True:
                cmd.append(f"--{key.replace('_', '-')}")
            elif value is not None and value is not False:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, **(env or {})},
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        hello = self._read(60)
        assert hello.get("ready"), hello
        self.url = hello["url"]
        self.engine_id = engine_id

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._lines.put(line[len(PREFIX):])

    def _read(self, timeout: float) -> dict:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            err = ""
            if self.proc.poll() is not None:
                err = self.proc.stderr.read()
            raise TimeoutError(f"peer gave no answer in {timeout} s; "
                               f"stderr: {err[-2000:]}") from None

    def send(self, cmd: str, timeout: float = 60, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def send_nowait(self, cmd: str, **kwargs) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(15)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def wait_for(pred, timeout=10.0):
    """`pred()`'s first truthy value within `timeout`, else its last value (the caller asserts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    return pred()
