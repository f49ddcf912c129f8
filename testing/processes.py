"""Starting and stopping the processes the harness runs: a port for each, waiting until it
serves, stopping it, and starting it again on a new port when another process took its port
first."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

# A port free now, free until something binds it: a service started on it may still find it
# taken (`start_on_free_port` retries).
from tandem.ports import free_port as free_port

ROOT = Path(__file__).resolve().parents[1]
# How many ports a service is started on before its start fails: a port is taken between
# free_port and the service's bind only rarely (another test's process got it first).
PORT_ATTEMPTS = 5
BIND_FAILED = 2  # the exit status of a tandem service that cannot bind (tandem/commands.py)


def wait_http_ok(proc: subprocess.Popen, log_path: Path, get, what: str, timeout: float,
                 interval: float, any_status: bool = False) -> None:
    """Polls `get()` until it answers 200 (`any_status`: answers at all); the process exiting
    first, or the timeout, raises with the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log_path.read_text()[-3000:]}")
        try:
            if get().status_code == 200 or any_status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"{what} not ready in {timeout} s: {log_path.read_text()[-2000:]}")


def lost_its_port(proc: subprocess.Popen, log_path: Path, log_start: int) -> bool:
    """Whether `proc` exited because its port was taken: the bind failure's exit status, and
    the kernel's reason in what it logged since `log_start` (a byte offset)."""
    if proc.poll() != BIND_FAILED:
        return False
    with open(log_path, "rb") as f:
        f.seek(log_start)
        return b"address already in use" in f.read().lower()


def start_on_free_port(use_port: Callable[[int], None], start: Callable[[], subprocess.Popen],
                       wait: Callable[[], None], log_path: Callable[[], Path]) -> subprocess.Popen:
    """Start a service on a free port, again on another one while it exits because its port
    was taken before it could bind it. `use_port(port)` points the command (and the caller's
    URL) at `port`; `start()` launches it, logging to `log_path()`; `wait()` returns once it
    serves and raises if it exited. Returns the running process; raises what `wait` raised
    when it failed for another reason, or lost its port `PORT_ATTEMPTS` times."""
    num_tries = 0
    while True:
        num_tries += 1
        use_port(free_port())
        path = log_path()
        log_start = path.stat().st_size if path.exists() else 0
        proc = start()
        try:
            wait()
            return proc
        except (RuntimeError, TimeoutError):
            if num_tries == PORT_ATTEMPTS or not lost_its_port(proc, path, log_start):
                raise


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGINT (each service drains and exits 0 on it), SIGKILL after `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, theirs, ...), read from /proc: a launcher's workers
    live in sessions of their own, out of reach of a signal to its process group."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
